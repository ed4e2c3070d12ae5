// Int8 dot products for the quantized matmul (quant_matmul.cpp), one struct per ISA variant: the
// only other file with intrinsics besides vec.h. Activations come as two int8 planes, x = d * (128 *
// hi + lo) (see quantize_block32), so an int32 lane dot is 128 * dot(w, hi) + dot(w, lo), exact.
// A *step* covers kValues weights of one staged row (see quant.h) against the same kValues
// activations; accumulate<Signed>() adds
//   sum over 4-value lanes of  float(int32 lane dot) * (weight scale * activation scale)
//   + weight offset * activation lane sum        (unsigned q only; signed q has no offset)
// into a float accumulator, always with the same operations in the same order, so that an output
// element is reduced identically wherever it is computed. Unsigned q goes straight into the
// unsigned operand of the byte products; signed q (Q8_0) goes in as |q| with its sign moved onto
// the activations.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/quant.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

// Block decoding helpers (quant_stage.cpp and Int8Dot::decode_w): 16 bytes of nibbles to 32 int8 values (low nibbles first);
// and a GGUF half-precision scale.
#if defined(MINDIE_ISA_AVX512) || defined(MINDIE_ISA_AVX2)
inline void unpack_nibbles(const uint8_t* qs, int8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm_and_si128(v, mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
}
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
#else
inline void unpack_nibbles(const uint8_t* qs, int8_t* q) {
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>(qs[i] & 0x0F);
    q[i + 16] = static_cast<int8_t>(qs[i] >> 4);
  }
}
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_float(h);
}
#endif

#if defined(MINDIE_ISA_AVX512)

// Two 32-value blocks per step; 16 lanes of 4 values each. Vnni: vpdpbusd, else vpmaddubsw+vpmaddwd
// (the same exact int32 sums either way).
template <bool Vnni>
struct Int8Dot {
  static constexpr int kValues = 64;
  // Activation rows per register tile: 4 x 3 accumulators and three activation steps fit the 32
  // vector registers (4 x 4 spills; 4 x 3 runs the prefill GEMM 1.2x faster than 4 x 2).
  static constexpr int kTileCols = 3;
  struct Acc { __m512 v; };
  struct W { __m512i q; __mmask64 neg; __m512 scale, offset; };
  struct X { __m512i hi, lo; __m512 d, sum; };

  static __mmask64 value_mask(int n) { return n >= 64 ? ~0ULL : (1ULL << n) - 1ULL; }
  static __m512i dot(__m512i u, __m512i s) {
    if constexpr (Vnni) return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
    else return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
  static Acc zero() { return {_mm512_setzero_ps()}; }
  // The per-16 scales (and offsets) of the step, one per 4-value lane.
  static __m512 per_lane16(const float* v, int n) {
    const __m512i by4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(by4, _mm512_maskz_loadu_ps(n >= 64 ? 0xF : 0x3, v));
  }
  template <bool Signed>
  static W load_w(const int8_t* q, const float* scale16, const float* offset16, int n) {
    const __m512i qv = _mm512_maskz_loadu_epi8(value_mask(n), q);
    if constexpr (Signed) return {_mm512_abs_epi8(qv), _mm512_movepi8_mask(qv), per_lane16(scale16, n), _mm512_setzero_ps()};
    else return {qv, 0, per_lane16(scale16, n), per_lane16(offset16, n)};
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
  template <bool Signed>
  static void accumulate(Acc& acc, const W& w, const X& x) {
    __m512i hi = x.hi, lo = x.lo;
    if constexpr (Signed) {
      const __m512i zero = _mm512_setzero_si512();
      hi = _mm512_mask_sub_epi8(hi, w.neg, zero, hi);
      lo = _mm512_mask_sub_epi8(lo, w.neg, zero, lo);
    }
    const __m512 f = _mm512_cvtepi32_ps(dot2(w.q, hi, lo));
    acc.v = _mm512_fmadd_ps(f, _mm512_mul_ps(w.scale, x.d), acc.v);
    if constexpr (!Signed) acc.v = _mm512_fmadd_ps(w.offset, x.sum, acc.v);
  }
  static float reduce(const Acc& acc) { return _mm512_reduce_add_ps(acc.v); }

  // A step of raw GGUF blocks decoded straight into registers (quant_matmul.cpp's GEMV path): the
  // same W, lane for lane and bit for bit, as staging the blocks and load_w.
  static constexpr bool decodes(QFormat f) { return f == QFormat::kQ4_0 || f == QFormat::kQ4_1 || f == QFormat::kQ8_0; }
  template <QFormat F>
  static W decode_w(const uint8_t* row, int64_t i, int n) {
    constexpr int kBytes = qformat_info(static_cast<int>(F)).block_bytes;
    constexpr int kHeader = F == QFormat::kQ4_1 ? 4 : 2;  // d (and Q4_1's min) as halves
    const uint8_t* b0 = row + (i / 32) * kBytes;
    const uint8_t* b1 = b0 + kBytes;
    const bool two = n > 32;
    uint32_t h0 = 0, h1 = 0;
    std::memcpy(&h0, b0, kHeader);
    if (two) std::memcpy(&h1, b1, kHeader);
    const __m512 dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(static_cast<int>(h0), static_cast<int>(h1), 0, 0)));
    const __m512 scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dm);
    if constexpr (F == QFormat::kQ8_0) {
      const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2));
      const __m256i q1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)) : _mm256_setzero_si256();
      const __m512i qv = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
      return {_mm512_abs_epi8(qv), _mm512_movepi8_mask(qv), scale, _mm512_setzero_ps()};
    } else {
      const __m128i n0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + kHeader));
      const __m128i n1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + kHeader)) : _mm_setzero_si128();
      const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(n0), n1, 1);
      // [n0, n1, n0 >> 4, n1 >> 4] reordered to value order [n0 & 15, n0 >> 4, n1 & 15, n1 >> 4]
      const __m512i z = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1),
                                         _mm512_set1_epi8(0x0F));
      const __m512i qv = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
      __m512 offset;
      if constexpr (F == QFormat::kQ4_1)
        offset = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dm);
      else  // -8 * d; the lanes of a missing block stay +0 as staging leaves them
        offset = _mm512_maskz_mul_ps(two ? 0xFFFF : 0x00FF, scale, _mm512_set1_ps(-8.f));
      return {qv, 0, scale, offset};
    }
  }
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
  static constexpr int kTileCols = 2;  // 16 vector registers
  struct Acc { __m256 v; };
  struct W { __m256i q, sign; __m256 scale, offset; };
  struct X { __m256i hi, lo; __m256 d, sum; };

  static __m256i dot(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
  static __m256i dot2(__m256i u, __m256i hi, __m256i lo) {
    return _mm256_add_epi32(_mm256_slli_epi32(dot(u, hi), 7), dot(u, lo));
  }
  static Acc zero() { return {_mm256_setzero_ps()}; }
  static __m256 per_lane16(const float* v) { return _mm256_set_m128(_mm_set1_ps(v[1]), _mm_set1_ps(v[0])); }
  template <bool Signed>
  static W load_w(const int8_t* q, const float* scale16, const float* offset16, int) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    if constexpr (Signed) return {_mm256_abs_epi8(qv), qv, per_lane16(scale16), _mm256_setzero_ps()};
    else return {qv, qv, per_lane16(scale16), per_lane16(offset16)};
  }
  static X load_x(const int8_t* hi, const int8_t* lo, const float* d32, bool with_sum, int) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
    const __m256 d = _mm256_set1_ps(d32[0]);
    __m256 sum = _mm256_setzero_ps();
    if (with_sum) sum = _mm256_mul_ps(_mm256_cvtepi32_ps(dot2(_mm256_set1_epi8(1), h, l)), d);
    return {h, l, d, sum};
  }
  template <bool Signed>
  static void accumulate(Acc& acc, const W& w, const X& x) {
    __m256i hi = x.hi, lo = x.lo;
    if constexpr (Signed) {
      hi = _mm256_sign_epi8(hi, w.sign);
      lo = _mm256_sign_epi8(lo, w.sign);
    }
    const __m256 f = _mm256_cvtepi32_ps(dot2(w.q, hi, lo));
    acc.v = _mm256_fmadd_ps(f, _mm256_mul_ps(w.scale, x.d), acc.v);
    if constexpr (!Signed) acc.v = _mm256_fmadd_ps(w.offset, x.sum, acc.v);
  }
  static float reduce(const Acc& acc) { return VecF(acc.v).reduce_add(); }

  // See the AVX-512 variant: one block per step here.
  static constexpr bool decodes(QFormat f) { return f == QFormat::kQ4_0 || f == QFormat::kQ4_1 || f == QFormat::kQ8_0; }
  template <QFormat F>
  static W decode_w(const uint8_t* row, int64_t i, int) {
    constexpr int kBytes = qformat_info(static_cast<int>(F)).block_bytes;
    const uint8_t* b = row + (i / 32) * kBytes;
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    if constexpr (F == QFormat::kQ8_0) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
      return {_mm256_abs_epi8(qv), qv, d, _mm256_setzero_ps()};
    } else {
      constexpr int kHeader = F == QFormat::kQ4_1 ? 4 : 2;
      const __m128i nib = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + kHeader));
      const __m256i qv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nib, 4), nib), _mm256_set1_epi8(0x0F));
      const __m256 offset = F == QFormat::kQ4_1 ? _mm256_set1_ps(half_to_float(b + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
      return {qv, qv, d, offset};
    }
  }
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
  static constexpr int kTileCols = 2;
  struct Acc { float v; };
  struct W { const int8_t* q; float scale[2], offset[2]; };
  struct X { const int8_t* hi; const int8_t* lo; float d, sum[2]; };

  static Acc zero() { return {0.f}; }
  template <bool Signed>
  static W load_w(const int8_t* q, const float* scale16, const float* offset16, int) {
    return {q, {scale16[0], scale16[1]}, {offset16[0], offset16[1]}};
  }
  static X load_x(const int8_t* hi, const int8_t* lo, const float* d32, bool with_sum, int) {
    X x{hi, lo, d32[0], {0.f, 0.f}};
    if (with_sum)
      for (int g = 0; g < 2; ++g) {
        int32_t s = 0;
        for (int i = 16 * g; i < 16 * g + 16; ++i) s += 128 * hi[i] + lo[i];
        x.sum[g] = static_cast<float>(s) * x.d;
      }
    return x;
  }
  template <bool Signed>
  static void accumulate(Acc& acc, const W& w, const X& x) {
    for (int g = 0; g < 2; ++g) {
      int32_t s = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) s += static_cast<int32_t>(w.q[i]) * (128 * x.hi[i] + x.lo[i]);
      acc.v += static_cast<float>(s) * (w.scale[g] * x.d);
      if constexpr (!Signed) acc.v += w.offset[g] * x.sum[g];
    }
  }
  static float reduce(const Acc& acc) { return acc.v; }

  static constexpr bool decodes(QFormat) { return false; }  // scalar rows are always staged
  template <QFormat F>
  static W decode_w(const uint8_t*, int64_t, int);
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

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
