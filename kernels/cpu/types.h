// Plain data types shared by the kernels and the host code: no intrinsics, no Python.
#pragma once

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace mindie::kernels::cpu {

// A kernel's scratch starts on a 64-byte boundary: its 64-byte rows (a panel's runs, a tile's rows)
// would each straddle two cache lines where malloc happened to put it, costing two loads a row (a
// 1.7B model's prefill ran at 255 or 365 tok/s by that luck).
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <class T>
using ScratchVector = std::vector<T, CacheLineAllocator<T>>;

// v's first n values (grown as needed).
template <class T>
T* sized(ScratchVector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

// bfloat16 travels as its raw 16 bits; the upper half of an IEEE float32.
using bf16_t = uint16_t;

enum class DType : int { kFloat32 = 0, kBFloat16 = 1 };

inline float bf16_to_float(bf16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch does; NaN stays a quiet NaN.
inline bf16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<bf16_t>(0x7FC0);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<bf16_t>(u >> 16);
}

// IEEE half precision (GGUF block scales) to float32, exact, subnormals included.
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24
    std::memcpy(&u, &f, sizeof u);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7F800000u | (man << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &u, sizeof out);
  return out;
}

inline int dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace mindie::kernels::cpu
