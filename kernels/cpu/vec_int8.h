// Int8 dot products for the quantized matmul (quant_matmul.cpp), one struct per ISA variant: the
// only other file with intrinsics besides vec.h. Activations come as two int8 planes, x = d * (128 *
// hi + lo) (see quantize_block32), so an int32 lane dot is 128 * dot(w, hi) + dot(w, lo), exact.
// A *step* covers kValues weights of one staged row (see quant.h) against the same kValues
// activations; accumulate() adds
//   sum over 4-value lanes of  float(int32 lane dot) * (weight scale * activation scale)
//   + weight offset * activation lane sum
// into a float accumulator, always with the same operations in the same order, so that an output
// element is reduced identically wherever it is computed.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

#if defined(MINDIE_ISA_AVX512)

// Two 32-value blocks per step; 16 lanes of 4 values each. Vnni: vpdpbusd, else vpmaddubsw+vpmaddwd
// (the same exact int32 sums either way).
template <bool Vnni>
struct Int8Dot {
  static constexpr int kValues = 64;
  struct Acc { __m512 v; };
  struct W { __m512i absq; __mmask64 neg; __m512 scale, offset; };
  struct X { __m512i hi, lo; __m512 d, sum; };

  static __mmask64 value_mask(int n) { return n >= 64 ? ~0ULL : (1ULL << n) - 1ULL; }
  static __m512i dot(__m512i u, __m512i s) {
    if constexpr (Vnni) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
    else return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
  static Acc zero() { return {_mm512_setzero_ps()}; }
  static W load_w(const int8_t* q, const float* scale16, const float* offset32, int n) {
    const __m512i qv = _mm512_maskz_loadu_epi8(value_mask(n), q);
    const __mmask16 groups = n >= 64 ? 0xF : 0x3, blocks = n >= 64 ? 0x3 : 0x1;
    const __m512i by4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i by8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return {_mm512_abs_epi8(qv), _mm512_movepi8_mask(qv),
            _mm512_permutexvar_ps(by4, _mm512_maskz_loadu_ps(groups, scale16)),
            _mm512_permutexvar_ps(by8, _mm512_maskz_loadu_ps(blocks, offset32))};
  }
  // 128 * dot(u, hi) + dot(u, lo), exact in int32.
  static __m512i dot2(__m512i u, __m512i hi, __m512i lo) {
    const __m512i h = _mm512_slli_epi32(dot(u, hi), 7);
    if constexpr (Vnni) return _mm512_dpbusd_epi32(h, u, lo);
    else return _mm512_add_epi32(h, dot(u, lo));
  }
  static X load_x(const int8_t* hi, const int8_t* lo, const float* d32, bool with_sum, int n) {
    const __m512i h = _mm512_maskz_loadu_epi8(value_mask(n), hi), l = _mm512_maskz_loadu_epi8(value_mask(n), lo);
    const __m512i by8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 d = _mm512_permutexvar_ps(by8, _mm512_maskz_loadu_ps(n >= 64 ? 0x3 : 0x1, d32));
    __m512 sum = _mm512_setzero_ps();
    if (with_sum) sum = _mm512_mul_ps(_mm512_cvtepi32_ps(dot2(_mm512_set1_epi8(1), h, l)), d);
    return {h, l, d, sum};
  }
  template <bool HasOffset>
  static void accumulate(Acc& acc, const W& w, const X& x) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i hi = _mm512_mask_sub_epi8(x.hi, w.neg, zero, x.hi), lo = _mm512_mask_sub_epi8(x.lo, w.neg, zero, x.lo);
    const __m512 f = _mm512_cvtepi32_ps(dot2(w.absq, hi, lo));
    acc.v = _mm512_fmadd_ps(f, _mm512_mul_ps(w.scale, x.d), acc.v);
    if constexpr (HasOffset) acc.v = _mm512_fmadd_ps(w.offset, x.sum, acc.v);
  }
  static float reduce(const Acc& acc) { return _mm512_reduce_add_ps(acc.v); }
};

// One block of 32 floats as x ~= d * (128 * hi + lo): hi rounds x to 127 steps of its largest
// magnitude, lo rounds what hi leaves to 1/128 of a step (about 15 bits in all). Returns d.
inline float quantize_block32(const float* x, int8_t* hi, int8_t* lo) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
  const __m512 iv = _mm512_set1_ps(inv), iv_lo = _mm512_set1_ps(inv * 128.f), sv = _mm512_set1_ps(step);
  for (int h = 0; h < 2; ++h) {
    const __m512 v = h == 0 ? a : b;
    const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(v, iv));
    const __m512 rest = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qh), sv, v);
    const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(rest, iv_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * h), _mm512_cvtsepi32_epi8(qh));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * h), _mm512_cvtsepi32_epi8(ql));
  }
  return step / 128.f;
}

#elif defined(MINDIE_ISA_AVX2)

// One 32-value block per step; 8 lanes of 4 values each (lanes 0-3 use the first 16-value scale).
template <bool Vnni>
struct Int8Dot {
  static constexpr int kValues = 32;
  struct Acc { __m256 v; };
  struct W { __m256i q, absq; __m256 scale, offset; };
  struct X { __m256i hi, lo; __m256 d, sum; };

  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  static __m256i dot2(__m256i u, __m256i hi, __m256i lo) {
    return _mm256_add_epi32(_mm256_slli_epi32(dot(u, hi), 7), dot(u, lo));
  }
  static Acc zero() { return {_mm256_setzero_ps()}; }
  static W load_w(const int8_t* q, const float* scale16, const float* offset32, int) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    return {qv, _mm256_abs_epi8(qv), _mm256_set_m128(_mm_set1_ps(scale16[1]), _mm_set1_ps(scale16[0])),
            _mm256_set1_ps(offset32[0])};
  }
  static X load_x(const int8_t* hi, const int8_t* lo, const float* d32, bool with_sum, int) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
    const __m256 d = _mm256_set1_ps(d32[0]);
    __m256 sum = _mm256_setzero_ps();
    if (with_sum) sum = _mm256_mul_ps(_mm256_cvtepi32_ps(dot2(_mm256_set1_epi8(1), h, l)), d);
    return {h, l, d, sum};
  }
  template <bool HasOffset>
  static void accumulate(Acc& acc, const W& w, const X& x) {
    const __m256 f = _mm256_cvtepi32_ps(dot2(w.absq, _mm256_sign_epi8(x.hi, w.q), _mm256_sign_epi8(x.lo, w.q)));
    acc.v = _mm256_fmadd_ps(f, _mm256_mul_ps(w.scale, x.d), acc.v);
    if constexpr (HasOffset) acc.v = _mm256_fmadd_ps(w.offset, x.sum, acc.v);
  }
  static float reduce(const Acc& acc) { return VecF(acc.v).reduce_add(); }
};

inline void store_int8x32(int8_t* dst, const __m256i* w) {
  // packs interleave 128-bit lanes; the permute puts the 32 values back in order.
  const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline float quantize_block32(const float* x, int8_t* hi, int8_t* lo) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  const float amax = VecF(m).reduce_max();
  const float inv = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
  const __m256 iv = _mm256_set1_ps(inv), iv_lo = _mm256_set1_ps(inv * 128.f), sv = _mm256_set1_ps(step);
  __m256i qh[4], ql[4];
  for (int i = 0; i < 4; ++i) {
    qh[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));
    const __m256 rest = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(qh[i]), sv, v[i]);
    ql[i] = _mm256_cvtps_epi32(_mm256_mul_ps(rest, iv_lo));
  }
  store_int8x32(hi, qh);
  store_int8x32(lo, ql);
  return step / 128.f;
}

#else  // scalar

template <bool Vnni>
struct Int8Dot {
  static constexpr int kValues = 32;
  struct Acc { float v; };
  struct W { const int8_t* q; float scale[2]; float offset; };
  struct X { const int8_t* hi; const int8_t* lo; float d, sum; };

  static Acc zero() { return {0.f}; }
  static W load_w(const int8_t* q, const float* scale16, const float* offset32, int) {
    return {q, {scale16[0], scale16[1]}, offset32[0]};
  }
  static X load_x(const int8_t* hi, const int8_t* lo, const float* d32, bool with_sum, int) {
    int32_t s = 0;
    if (with_sum)
      for (int i = 0; i < 32; ++i) s += 128 * hi[i] + lo[i];
    return {hi, lo, d32[0], static_cast<float>(s) * d32[0]};
  }
  template <bool HasOffset>
  static void accumulate(Acc& acc, const W& w, const X& x) {
    for (int g = 0; g < 2; ++g) {
      int32_t s = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) s += static_cast<int32_t>(w.q[i]) * (128 * x.hi[i] + x.lo[i]);
      acc.v += static_cast<float>(s) * (w.scale[g] * x.d);
    }
    if constexpr (HasOffset) acc.v += w.offset * x.sum;
  }
  static float reduce(const Acc& acc) { return acc.v; }
};

inline float quantize_block32(const float* x, int8_t* hi, int8_t* lo) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f, step = amax / 127.f;
  for (int i = 0; i < 32; ++i) {
    const float qh = std::nearbyint(x[i] * inv);
    hi[i] = static_cast<int8_t>(qh);
    lo[i] = static_cast<int8_t>(std::fmax(-127.f, std::fmin(127.f, std::nearbyint((x[i] - qh * step) * (inv * 128.f)))));
  }
  return step / 128.f;
}

#endif

// Staging helpers (quant_stage.cpp): 16 bytes of nibbles to 32 int8 values (low nibbles first),
// minus `bias`; and a GGUF half-precision scale.
#if defined(MINDIE_ISA_AVX512) || defined(MINDIE_ISA_AVX2)
inline void unpack_nibbles(const uint8_t* qs, int8_t* q, int bias) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F), b = _mm_set1_epi8(static_cast<char>(bias));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_sub_epi8(_mm_and_si128(v, mask), b));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), mask), b));
}
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#else
inline void unpack_nibbles(const uint8_t* qs, int8_t* q, int bias) {
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>((qs[i] & 0x0F) - bias);
    q[i + 16] = static_cast<int8_t>((qs[i] >> 4) - bias);
  }
}
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
