// One SIMD vocabulary for every kernel. A kernel source is compiled once per ISA variant with
// MINDIE_ISA_AVX512, MINDIE_ISA_AVX2 or MINDIE_ISA_SCALAR defined (see CMakeLists.txt); the same
// kernel code then works on VecF of that variant's width. Only this file contains intrinsics.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(MINDIE_ISA_AVX512) || defined(MINDIE_ISA_AVX2)
#include <immintrin.h>
#endif

#include "cpu/types.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

#if defined(MINDIE_ISA_AVX512)

struct VecF {
  static constexpr int W = 16;
  __m512 v;
  VecF() = default;
  explicit VecF(__m512 x) : v(x) {}
  static VecF zero() { return VecF(_mm512_setzero_ps()); }
  static VecF set1(float x) { return VecF(_mm512_set1_ps(x)); }
  static VecF load(const float* p) { return VecF(_mm512_loadu_ps(p)); }
  static VecF load(const bf16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return VecF(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  // Loads n < W elements; the rest are `fill`.
  static VecF load_partial(const float* p, int n, float fill = 0.f) {
    __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
    return VecF(_mm512_mask_loadu_ps(_mm512_set1_ps(fill), m, p));
  }
  static VecF load_partial(const bf16_t* p, int n, float fill = 0.f) {
    __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return VecF(_mm512_mask_blend_ps(m, _mm512_set1_ps(fill), x));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store_partial(float* p, int n) const {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1u), v);
  }
  static __m256i to_bf16_bits(__m512 x) {
    // Round to nearest even; NaN stays a quiet NaN.
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
  }
  void store(bf16_t* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v));
  }
  void store_partial(bf16_t* p, int n) const {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1u), to_bf16_bits(v));
  }
  friend VecF operator+(VecF a, VecF b) { return VecF(_mm512_add_ps(a.v, b.v)); }
  friend VecF operator-(VecF a, VecF b) { return VecF(_mm512_sub_ps(a.v, b.v)); }
  friend VecF operator*(VecF a, VecF b) { return VecF(_mm512_mul_ps(a.v, b.v)); }
  friend VecF operator/(VecF a, VecF b) { return VecF(_mm512_div_ps(a.v, b.v)); }
  static VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm512_fmadd_ps(a.v, b.v, c.v)); }
  static VecF max(VecF a, VecF b) { return VecF(_mm512_max_ps(a.v, b.v)); }
  static VecF min(VecF a, VecF b) { return VecF(_mm512_min_ps(a.v, b.v)); }
  float reduce_add() const { return _mm512_reduce_add_ps(v); }
  float reduce_max() const { return _mm512_reduce_max_ps(v); }
  // out[i] = sum of the lanes of v[i] for i < W: W horizontal sums as one transpose-and-add tree,
  // all full-width and independent, instead of W latency-bound reductions.
  // Always inlined: out of line, the call cost every vector register the caller held (decode attention's queries).
  [[gnu::always_inline]] static void reduce_add_w(const VecF* v, float* out) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].v, v[2 * i + 1].v), _mm512_unpackhi_ps(v[2 * i].v, v[2 * i + 1].v));
    for (int i = 0; i < 4; ++i)
      b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1))));
  }
  // x[i] = row i of a 16 x 16 square -> x[j] = its column j: pairs of rows interleaved, then quads
  // within each 128-bit lane, then the lanes across four rows and across eight.
  [[gnu::always_inline]] static void transpose_square(VecF (&x)[16]) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = x[i].v;
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // r[4g + e], 128-bit lane L: element 4L + e of rows 4g .. 4g + 3.
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int e = 0; e < 4; ++e) {
      t[e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88);
      t[4 + e] = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
      t[8 + e] = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
      t[12 + e] = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    }
    for (int e = 0; e < 4; ++e) {
      x[e] = VecF(_mm512_shuffle_f32x4(t[e], t[8 + e], 0x88));
      x[8 + e] = VecF(_mm512_shuffle_f32x4(t[e], t[8 + e], 0xDD));
      x[4 + e] = VecF(_mm512_shuffle_f32x4(t[4 + e], t[12 + e], 0x88));
      x[12 + e] = VecF(_mm512_shuffle_f32x4(t[4 + e], t[12 + e], 0xDD));
    }
  }
  // exp for x <= 88.7; x < -87.3 (including -inf) gives exactly 0.
  static VecF exp(VecF x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
    __m512 xv = _mm512_min_ps(_mm512_max_ps(x.v, lo), _mm512_set1_ps(88.7f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xv);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    // Scale by 2^n in two steps so n = 128 does not overflow the exponent field.
    __m512i ni = _mm512_cvtps_epi32(n);
    __m512i n1 = _mm512_srai_epi32(ni, 1);
    __m512i n2 = _mm512_sub_epi32(ni, n1);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, _mm512_set1_epi32(127)), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, _mm512_set1_epi32(127)), 23));
    __m512 res = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
    return VecF(_mm512_mask_mov_ps(res, under, _mm512_setzero_ps()));
  }
};

#elif defined(MINDIE_ISA_AVX2)

struct VecF {
  static constexpr int W = 8;
  __m256 v;
  VecF() = default;
  explicit VecF(__m256 x) : v(x) {}
  static __m256i tail_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static VecF zero() { return VecF(_mm256_setzero_ps()); }
  static VecF set1(float x) { return VecF(_mm256_set1_ps(x)); }
  static VecF load(const float* p) { return VecF(_mm256_loadu_ps(p)); }
  static VecF load(const bf16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  static VecF load_partial(const float* p, int n, float fill = 0.f) {
    __m256i m = tail_mask(n);
    __m256 x = _mm256_maskload_ps(p, m);
    return VecF(_mm256_blendv_ps(_mm256_set1_ps(fill), x, _mm256_castsi256_ps(m)));
  }
  static VecF load_partial(const bf16_t* p, int n, float fill = 0.f) {
    alignas(32) bf16_t tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tmp, p, sizeof(bf16_t) * n);
    VecF x = load(tmp);
    return VecF(_mm256_blendv_ps(_mm256_set1_ps(fill), x.v, _mm256_castsi256_ps(tail_mask(n))));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store_partial(float* p, int n) const { _mm256_maskstore_ps(p, tail_mask(n), v); }
  static __m128i to_bf16_bits(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
    r = _mm256_srli_epi32(r, 16);
    // Pack 8 x u32 (each < 65536) into 8 x u16.
    __m128i lo = _mm256_castsi256_si128(r);
    __m128i hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
  }
  void store(bf16_t* p) const {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_bits(v));
  }
  void store_partial(bf16_t* p, int n) const {
    alignas(16) bf16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), to_bf16_bits(v));
    std::memcpy(p, tmp, sizeof(bf16_t) * n);
  }
  friend VecF operator+(VecF a, VecF b) { return VecF(_mm256_add_ps(a.v, b.v)); }
  friend VecF operator-(VecF a, VecF b) { return VecF(_mm256_sub_ps(a.v, b.v)); }
  friend VecF operator*(VecF a, VecF b) { return VecF(_mm256_mul_ps(a.v, b.v)); }
  friend VecF operator/(VecF a, VecF b) { return VecF(_mm256_div_ps(a.v, b.v)); }
  static VecF fma(VecF a, VecF b, VecF c) { return VecF(_mm256_fmadd_ps(a.v, b.v, c.v)); }
  static VecF max(VecF a, VecF b) { return VecF(_mm256_max_ps(a.v, b.v)); }
  static VecF min(VecF a, VecF b) { return VecF(_mm256_min_ps(a.v, b.v)); }
  float reduce_add() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void reduce_add_w(const VecF* v, float* out) {
    __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(v[0].v, v[1].v), _mm256_hadd_ps(v[2].v, v[3].v));
    __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(v[4].v, v[5].v), _mm256_hadd_ps(v[6].v, v[7].v));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
  }
  // x[i] = row i of an 8 x 8 square -> x[j] = its column j: pairs of rows interleaved, then quads
  // within each 128-bit lane, then the two lanes.
  [[gnu::always_inline]] static void transpose_square(VecF (&x)[8]) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = x[i].v;
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    // r[4g + e], 128-bit lane L: element 4L + e of rows 4g .. 4g + 3.
    for (int i = 0; i < 8; i += 4) {
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int e = 0; e < 4; ++e) {
      x[e] = VecF(_mm256_permute2f128_ps(r[e], r[4 + e], 0x20));
      x[4 + e] = VecF(_mm256_permute2f128_ps(r[e], r[4 + e], 0x31));
    }
  }
  float reduce_max() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static VecF exp(VecF x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x.v, lo, _CMP_LT_OQ);
    __m256 xv = _mm256_min_ps(_mm256_max_ps(x.v, lo), _mm256_set1_ps(88.7f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xv, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xv);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i n1 = _mm256_srai_epi32(ni, 1);
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, _mm256_set1_epi32(127)), 23));
    __m256 res = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return VecF(_mm256_blendv_ps(res, _mm256_setzero_ps(), under));
  }
};

#else  // MINDIE_ISA_SCALAR: portable fallback, one lane.

struct VecF {
  static constexpr int W = 1;
  float v;
  VecF() = default;
  explicit VecF(float x) : v(x) {}
  static VecF zero() { return VecF(0.f); }
  static VecF set1(float x) { return VecF(x); }
  static VecF load(const float* p) { return VecF(*p); }
  static VecF load(const bf16_t* p) { return VecF(bf16_to_float(*p)); }
  static VecF load_partial(const float* p, int n, float fill = 0.f) { return VecF(n > 0 ? *p : fill); }
  static VecF load_partial(const bf16_t* p, int n, float fill = 0.f) {
    return VecF(n > 0 ? bf16_to_float(*p) : fill);
  }
  void store(float* p) const { *p = v; }
  void store_partial(float* p, int n) const { if (n > 0) *p = v; }
  void store(bf16_t* p) const { *p = float_to_bf16(v); }
  void store_partial(bf16_t* p, int n) const { if (n > 0) *p = float_to_bf16(v); }
  friend VecF operator+(VecF a, VecF b) { return VecF(a.v + b.v); }
  friend VecF operator-(VecF a, VecF b) { return VecF(a.v - b.v); }
  friend VecF operator*(VecF a, VecF b) { return VecF(a.v * b.v); }
  friend VecF operator/(VecF a, VecF b) { return VecF(a.v / b.v); }
  static VecF fma(VecF a, VecF b, VecF c) { return VecF(std::fma(a.v, b.v, c.v)); }
  static VecF max(VecF a, VecF b) { return VecF(a.v > b.v ? a.v : b.v); }
  static VecF min(VecF a, VecF b) { return VecF(a.v < b.v ? a.v : b.v); }
  float reduce_add() const { return v; }
  float reduce_max() const { return v; }
  static void reduce_add_w(const VecF* v, float* out) { out[0] = v[0].v; }
  static void transpose_square(VecF (&)[1]) {}  // a 1 x 1 square is its own transpose
  static VecF exp(VecF x) { return VecF(x.v < -87.3f ? 0.f : std::exp(x.v)); }
};

#endif

// Helpers over whole rows, built on VecF so every variant shares them.


template <typename T>
inline float dot(const float* a, const T* b, int n) {
  constexpr int W = VecF::W;
  VecF acc0 = VecF::zero(), acc1 = VecF::zero();
  int i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = VecF::fma(VecF::load(a + i), VecF::load(b + i), acc0);
    acc1 = VecF::fma(VecF::load(a + i + W), VecF::load(b + i + W), acc1);
  }
  for (; i + W <= n; i += W) acc0 = VecF::fma(VecF::load(a + i), VecF::load(b + i), acc0);
  if (i < n) acc1 = VecF::fma(VecF::load_partial(a + i, n - i), VecF::load_partial(b + i, n - i), acc1);
  return (acc0 + acc1).reduce_add();
}

// y[i] += w * x[i]
template <typename T>
inline void axpy(float* y, float w, const T* x, int n) {
  constexpr int W = VecF::W;
  const VecF wv = VecF::set1(w);
  int i = 0;
  for (; i + W <= n; i += W) VecF::fma(wv, VecF::load(x + i), VecF::load(y + i)).store(y + i);
  if (i < n) VecF::fma(wv, VecF::load_partial(x + i, n - i), VecF::load_partial(y + i, n - i))
                 .store_partial(y + i, n - i);
}

// dst[i] = T(src[i] * scale)
template <typename T>
inline void store_scaled(T* dst, const float* src, float scale, int n) {
  constexpr int W = VecF::W;
  const VecF s = VecF::set1(scale);
  int i = 0;
  for (; i + W <= n; i += W) (VecF::load(src + i) * s).store(dst + i);
  if (i < n) (VecF::load_partial(src + i, n - i) * s).store_partial(dst + i, n - i);
}

// dst[i] = float(src[i]) * scale
template <typename T>
inline void load_scaled(float* dst, const T* src, float scale, int n) {
  constexpr int W = VecF::W;
  const VecF s = VecF::set1(scale);
  int i = 0;
  for (; i + W <= n; i += W) (VecF::load(src + i) * s).store(dst + i);
  if (i < n) (VecF::load_partial(src + i, n - i) * s).store_partial(dst + i, n - i);
}

// gelu_tanh(x) = x / 2 (1 + tanh(y)) = x * sigmoid(2 y) with y = sqrt(2 / pi) (x + 0.044715 x^3):
// this is 2 y, so callers take the sigmoid with VecF::exp (which clamps: no NaN in the far tails).
constexpr float kGeluTanhA = 1.5957691216057308f;  // 2 sqrt(2 / pi)
constexpr float kGeluTanhB = 0.044715f * kGeluTanhA;
inline VecF gelu_tanh_2y(VecF x) {
  return x * VecF::fma(VecF::set1(kGeluTanhB), x * x, VecF::set1(kGeluTanhA));
}
inline float gelu_tanh_2y(float x) { return x * (kGeluTanhA + kGeluTanhB * x * x); }

// In place x[i] = exp(x[i] - m); returns the sum.
inline float exp_sub_sum(float* x, float m, int n) {
  constexpr int W = VecF::W;
  const VecF mv = VecF::set1(m);
  VecF acc = VecF::zero();
  int i = 0;
  for (; i + W <= n; i += W) {
    VecF e = VecF::exp(VecF::load(x + i) - mv);
    e.store(x + i);
    acc = acc + e;
  }
  if (i < n) {
    VecF e = VecF::exp(VecF::load_partial(x + i, n - i, -INFINITY) - mv);
    e.store_partial(x + i, n - i);
    acc = acc + e;
  }
  return acc.reduce_add();
}

inline float row_max(const float* x, int n) {
  constexpr int W = VecF::W;
  VecF m = VecF::set1(-INFINITY);
  int i = 0;
  for (; i + W <= n; i += W) m = VecF::max(m, VecF::load(x + i));
  if (i < n) m = VecF::max(m, VecF::load_partial(x + i, n - i, -INFINITY));
  return m.reduce_max();
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
