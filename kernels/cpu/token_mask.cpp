#include "cpu/token_mask.h"

#include <algorithm>
#include <cmath>

#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

// x[j] = -inf for every set bit j of `forbid`; nothing else is written.
inline void forbid_bits(float* x, uint32_t forbid) {
  for (; forbid != 0; forbid &= forbid - 1) x[__builtin_ctz(forbid)] = -INFINITY;
}

// forbid_bits over a whole word, x[0..32) inside the row. Its intrinsics live here rather than in
// vec.h because no other kernel turns bits into lanes.
inline void forbid32(float* x, uint32_t forbid) {
#if defined(MINDIE_ISA_AVX512)
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  _mm512_mask_storeu_ps(x, static_cast<__mmask16>(forbid), ninf);
  _mm512_mask_storeu_ps(x + 16, static_cast<__mmask16>(forbid >> 16), ninf);
#elif defined(MINDIE_ISA_AVX2)
  // A full load + blend + store, not vmaskmovps: masked stores are microcoded and slow on AMD cores.
  if (forbid == 0) return;
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  if (forbid == ~0u) {
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(x + 8 * k, ninf);
    return;
  }
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int k = 0; k < 4; ++k) {
    const __m256i sel = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(forbid >> (8 * k))), bit);
    const __m256 lanes = _mm256_castsi256_ps(_mm256_cmpeq_epi32(sel, bit));
    _mm256_storeu_ps(x + 8 * k, _mm256_blendv_ps(_mm256_loadu_ps(x + 8 * k), ninf, lanes));
  }
#else
  forbid_bits(x, forbid);
#endif
}

void mask_row(float* x, const int32_t* words, int64_t vocab, int64_t mask_words) {
  const int64_t covered = std::min(vocab, 32 * mask_words);
  const int64_t full = covered / 32;
  for (int64_t w = 0; w < full; ++w) forbid32(x + 32 * w, ~static_cast<uint32_t>(words[w]));
  if (const int rest = static_cast<int>(covered % 32); rest != 0)
    forbid_bits(x + 32 * full, ~static_cast<uint32_t>(words[full]) & ((1u << rest) - 1u));
  std::fill(x + covered, x + vocab, -INFINITY);
}

}  // namespace

void apply_token_bitmask(const TokenMaskArgs& a) {
  // A row is a few microseconds of stores; chunks of at least ~64k logits keep the pool's wake-up
  // cost small against the work.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(a.vocab_size, 1));
  parallel_for(a.num_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t m = a.mask_index[r];
      if (m < 0) continue;
      mask_row(a.logits + r * a.logits_row_stride, a.bitmask + m * a.bitmask_row_stride, a.vocab_size,
               a.mask_words);
    }
  });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
