#include "cpu/kv_cache.h"

#include <cstring>
#include <type_traits>

#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

template <typename Src, typename Dst>
void write_rows(const KVWriteArgs& a, const Src* key, const Src* value, Dst* kc, Dst* vc) {
  const int64_t row = static_cast<int64_t>(a.kv_heads) * a.head_dim;
  parallel_for(a.num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = a.slot_mapping[t];
      if (slot < 0) continue;
      const Src* k = key + t * a.key_token_stride;
      const Src* v = value + t * a.value_token_stride;
      if constexpr (std::is_same_v<Src, Dst>) {
        std::memcpy(kc + slot * row, k, row * sizeof(Dst));
        std::memcpy(vc + slot * row, v, row * sizeof(Dst));
      } else {
        store_scaled(kc + slot * row, k, 1.f, static_cast<int>(row));
        store_scaled(vc + slot * row, v, 1.f, static_cast<int>(row));
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const KVWriteArgs& a) {
  if (a.src_dtype == a.cache_dtype) {
    if (a.src_dtype == DType::kFloat32)
      write_rows(a, static_cast<const float*>(a.key), static_cast<const float*>(a.value),
                 static_cast<float*>(a.key_cache), static_cast<float*>(a.value_cache));
    else
      write_rows(a, static_cast<const bf16_t*>(a.key), static_cast<const bf16_t*>(a.value),
                 static_cast<bf16_t*>(a.key_cache), static_cast<bf16_t*>(a.value_cache));
  } else {
    // Only float32 activations into a bfloat16 cache is a supported conversion (checked by host).
    write_rows(a, static_cast<const float*>(a.key), static_cast<const float*>(a.value),
               static_cast<bf16_t*>(a.key_cache), static_cast<bf16_t*>(a.value_cache));
  }
}

void copy_blocks(const BlockCopyArgs& a) {
  const char* src = static_cast<const char*>(a.src);
  char* dst = static_cast<char*>(a.dst);
  parallel_for(a.num_pairs, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const char* s = src + a.pairs[2 * i] * a.block_bytes;
      char* d = dst + a.pairs[2 * i + 1] * a.block_bytes;
      if (s != d) std::memmove(d, s, a.block_bytes);
    }
  });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
