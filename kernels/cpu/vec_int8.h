// Int8 and bf16 dot products for the quantized matmul (quant_matmul.cpp), one struct per ISA
// variant: the only other file with intrinsics besides vec.h. Int8 activations come as two planes,
// x = d * (128 * hi + lo) (see quantize_block32); bf16 activations as they are (Bf16Panel).
//
// The weights are read as *panels*: 16 rows side by side, so that a vector lane is an output row
// (see PanelRef). Int8Panel::tile<..., S> computes, for each output element (weight row r,
// activation row c), over *spans* of 16 * S values that share one weight scale (S = 2 for formats
// whose scale covers 32 values, 1 for Q6_K's 16):
//   f = 0;  for each span j in order:
//     s = sum over the span of q * (128 * hi + lo)                         (exact int32)
//     f = fma(float(s), scale_j * d_c(j), f)
//     f = fma(offset_j, sum_c(j), f)        (unsigned q only; sum_c(j) = d * sum of 128 * hi + lo)
// one scalar chain per element in one lane, whatever the ISA's vector width, the tile shape or the
// thread split: an output element is reduced identically wherever it is computed. Unsigned q goes
// straight into the unsigned operand of the byte products; signed q (Q8_0) goes in as |q| with its
// sign moved onto the activations.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/quant.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

// A panel: weight rows [row0, row0 + 16) side by side. For 16-value group j, q holds four 64-byte
// vectors whose 4-byte lane r is values 4v..4v+3 of the group in row r (kPanelGroupBytes per group),
// scale and offset hold the group's 16 row values. Rows past the matrix's end are zero.
constexpr int kPanelRows = 16;
constexpr int64_t kPanelGroupBytes = 16 * kPanelRows;
struct PanelRef {
  const int8_t* q;
  const float* scale;
  const float* offset;
};
// A bf16 panel: the same 16 rows as bf16 weights scale * q + offset. For 16-value group j it holds
// eight 64-byte vectors whose 4-byte lane r is values 2p and 2p + 1 of the group in row r
// (kBf16PanelGroupElems bf16 values per group), the operand layout of vdpbf16ps.
constexpr int64_t kBf16PanelGroupElems = 16 * kPanelRows;

// One activation row: its two planes, d per 32 values and d * sum(128 * hi + lo) per 16 and per 32.
struct ActRef {
  const int8_t* hi;
  const int8_t* lo;
  const float* d;
  const float* sum16;
  const float* sum32;
  template <int S>
  float sum(int64_t span) const { return S == 2 ? sum32[span] : sum16[span]; }
};

// Block decoding helpers (quant_stage.cpp): 16 bytes of nibbles to 32 int8 values (low nibbles first);
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

// AVX-512: a panel's 16 rows are one vector's 16 int32 lanes. Vnni: vpdpbusd, else
// vpmaddubsw + vpmaddwd (the same exact int32 sums either way).
template <bool Vnni>
struct Int8Panel {
  // Panels x activation rows per register tile: 3 x 4 int32 and float accumulators, three weight
  // vectors and a broadcast fit the 32 vector registers (5-10% faster than 2 x 4 or 2 x 6 at 32
  // and 512 rows; 1 x 8 runs at less than half the speed).
  static constexpr int kTilePanels = 3;
  static constexpr int kTileCols = 4;

  static __m512i dot(__m512i acc, __m512i u, __m512i s) {
    if constexpr (Vnni) return _mm512_dpbusd_epi32(acc, u, s);
    else return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
  }
  static __m512i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  // out[(r * C + c) * 16 + lane] = f of panel r's row `lane` and activation row c.

  // Full panels of Q4_0, Q4_1 and Q8_0 staged straight from their blocks (rows at row_bytes apart):
  // the same panel, byte for byte, as stage_rows followed by the transpose in quant_matmul.cpp.
  static constexpr bool stages(QFormat f) { return f == QFormat::kQ4_0 || f == QFormat::kQ4_1 || f == QFormat::kQ8_0; }
  // 16 rows' 16-byte runs at `at` (row r at at + r * row_bytes) -> four vectors, vector v's lane r
  // holding dword v of row r.
  static void transpose16x4(const uint8_t* at, int64_t row_bytes, __m512i out[4]) {
    const __m512i by_dword = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i t[4];
    for (int g = 0; g < 4; ++g) {
      const uint8_t* r0 = at + 4 * g * row_bytes;
      __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0)));
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + row_bytes)), 1);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 2 * row_bytes)), 2);
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 3 * row_bytes)), 3);
      t[g] = _mm512_permutexvar_epi32(by_dword, v);  // 128-bit lane v: dword v of the four rows
    }
    const __m512i lo01 = _mm512_shuffle_i32x4(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i lo23 = _mm512_shuffle_i32x4(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i hi01 = _mm512_shuffle_i32x4(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i hi23 = _mm512_shuffle_i32x4(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2));
    out[0] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
    out[1] = _mm512_shuffle_i32x4(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
    out[2] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    out[3] = _mm512_shuffle_i32x4(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
  }
  template <QFormat F>
  static void stage_blocks(const uint8_t* rows, const uint8_t* next, int64_t row_bytes, int64_t blocks, int8_t* q, float* scale,
                           float* offset) {
    constexpr int kBytes = qformat_info(static_cast<int>(F)).block_bytes;
    constexpr int kHeader = F == QFormat::kQ4_1 ? 4 : 2;  // d (and Q4_1's min) as halves
    const __m512i row_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int>(row_bytes)));
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* at = rows + b * kBytes;
      if (next != nullptr)
        for (int r = 0; r < kPanelRows; ++r) __builtin_prefetch(next + r * row_bytes + b * kBytes);
      const __m512i header = _mm512_i32gather_epi32(row_at, at, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
      __m512 o;
      if constexpr (F == QFormat::kQ4_1) o = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16)));
      else if constexpr (F == QFormat::kQ4_0) o = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
      else o = _mm512_setzero_ps();
      for (int g = 0; g < 2; ++g) {
        _mm512_storeu_ps(scale + (2 * b + g) * 16, d);
        _mm512_storeu_ps(offset + (2 * b + g) * 16, o);
      }
      __m512i v[4];
      int8_t* dst = q + 2 * b * kPanelGroupBytes;
      if constexpr (F == QFormat::kQ8_0) {
        for (int g = 0; g < 2; ++g) {
          transpose16x4(at + kHeader + 16 * g, row_bytes, v);
          for (int i = 0; i < 4; ++i) _mm512_storeu_si512(dst + g * kPanelGroupBytes + 64 * i, v[i]);
        }
      } else {
        transpose16x4(at + kHeader, row_bytes, v);
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int i = 0; i < 4; ++i) {
          _mm512_storeu_si512(dst + 64 * i, _mm512_and_si512(v[i], mask));
          _mm512_storeu_si512(dst + kPanelGroupBytes + 64 * i, _mm512_and_si512(_mm512_srli_epi16(v[i], 4), mask));
        }
      }
    }
  }
  template <int R, int C, bool Signed, int S>
  static void tile(const PanelRef* w, const ActRef* x, int64_t groups, float* out) {
    __m512 f[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) f[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < groups; j += S) {
      __m512i acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
      for (int plane = 0; plane < 2; ++plane) {
        if (plane == 1)
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) acc[r][c] = _mm512_slli_epi32(acc[r][c], 7);
        for (int v = 0; v < 4 * S; ++v) {
          __m512i wq[R];
          __mmask64 neg[R];
          for (int r = 0; r < R; ++r) {
            wq[r] = _mm512_loadu_si512(w[r].q + j * kPanelGroupBytes + v * 64);
            if constexpr (Signed) {
              neg[r] = _mm512_movepi8_mask(wq[r]);
              wq[r] = _mm512_abs_epi8(wq[r]);
            }
          }
          for (int c = 0; c < C; ++c) {
            const __m512i b = broadcast4((plane == 0 ? x[c].hi : x[c].lo) + 16 * j + 4 * v);
            for (int r = 0; r < R; ++r) {
              if constexpr (Signed) acc[r][c] = dot(acc[r][c], wq[r], _mm512_mask_sub_epi8(b, neg[r], _mm512_setzero_si512(), b));
              else acc[r][c] = dot(acc[r][c], wq[r], b);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 scale = _mm512_loadu_ps(w[r].scale + 16 * j), offset = _mm512_loadu_ps(w[r].offset + 16 * j);
        for (int c = 0; c < C; ++c) {
          f[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_mul_ps(scale, _mm512_set1_ps(x[c].d[j / 2])), f[r][c]);
          if constexpr (!Signed) f[r][c] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[c].template sum<S>(j / S)), f[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r * C + c) * 16, f[r][c]);
  }

  // Few activation rows (decode): a whole panel of Q4_0, Q4_1 or Q8_0 read straight from its
  // blocks, no staging. Vector g holds 16 bytes of rows g, g + 4, g + 8 and g + 12 in its four
  // 128-bit lanes and meets activation values as they lie; reduce4 then sums each 128-bit lane into
  // one lane per row. The span sums are the same exact int32 values as tile()'s and the float chain
  // the same, so a row gets the same bits whichever of the two computes it.
  static constexpr int kStreamCols = 8;
  static constexpr bool streams(QFormat f) { return stages(f); }
  static __m512i load_rows4(const uint8_t* p, int64_t stride) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * stride)), 2);
    return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 3 * stride)), 3);
  }
  static __m512i broadcast16(const int8_t* p) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Lane r: the first 4 bytes at row r (rows row_bytes apart), a block's header. Four row loads
  // and three unpacks cost a third less than a 16-lane gather.
  static __m512i headers16(const uint8_t* at, int64_t row_bytes) {
    __m512i a[4];
    for (int g = 0; g < 4; ++g) a[g] = load_rows4(at + g * row_bytes, 4 * row_bytes);
    return _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpacklo_epi32(a[2], a[3]));
  }
  // Lane 4L + g: the sum of the four int32 lanes in 128-bit lane L of a[g].
  static __m512i reduce4(const __m512i a[4]) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
  }
  // Per-lane partial sums of 128 * (u0 . h0 + u1 . h1) + (u0 . l0 + u1 . l1): u unsigned bytes,
  // the others activation bytes. Without VNNI the 16-bit pair sums of one plane are added before
  // widening, which stays exact while u < 64 (the unsigned formats).
  static __m512i span_dot(__m512i u0, __m512i u1, __m512i h0, __m512i h1, __m512i l0, __m512i l1) {
    if constexpr (Vnni) {
      const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, h0), u1, h1);
      return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(hi, 7), u0, l0), u1, l1);
    } else {
      const __m512i hi = _mm512_add_epi16(_mm512_maddubs_epi16(u0, h0), _mm512_maddubs_epi16(u1, h1));
      const __m512i lo = _mm512_add_epi16(_mm512_maddubs_epi16(u0, l0), _mm512_maddubs_epi16(u1, l1));
      return _mm512_add_epi32(_mm512_madd_epi16(hi, _mm512_set1_epi16(128)), _mm512_madd_epi16(lo, _mm512_set1_epi16(1)));
    }
  }
  // out[c * 16 + r] = f of panel row r (rows at `rows`, row_bytes apart) and activation row c.
  // Prefetches [pf, pf_end) meanwhile, pf_step bytes per block.
  template <QFormat F, int C>
  static void stream(const uint8_t* rows, int64_t row_bytes, int64_t blocks, const ActRef* x, const uint8_t* pf,
                     const uint8_t* pf_end, int64_t pf_step, float* out) {
    constexpr int kBytes = qformat_info(static_cast<int>(F)).block_bytes;
    constexpr int kHeader = F == QFormat::kQ4_1 ? 4 : 2;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 f[C];
    for (int c = 0; c < C; ++c) f[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, pf += pf_step) {
      for (const uint8_t* p = pf; p < pf + pf_step && p < pf_end; p += 64) __builtin_prefetch(p);
      const uint8_t* at = rows + b * kBytes;
      const __m512i header = headers16(at, row_bytes);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header));
      __m512i u0[4], u1[4];
      for (int g = 0; g < 4; ++g) {
        const uint8_t* q = at + kHeader + g * row_bytes;
        if constexpr (F == QFormat::kQ8_0) {
          u0[g] = load_rows4(q, 4 * row_bytes);
          u1[g] = load_rows4(q + 16, 4 * row_bytes);
        } else {
          const __m512i v = load_rows4(q, 4 * row_bytes);
          u0[g] = _mm512_and_si512(v, nibble);
          u1[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        }
      }
      if constexpr (F == QFormat::kQ8_0) {
        // Signed values: as |q| against activations carrying q's sign (exact, as tile() does).
        for (int c = 0; c < C; ++c) {
          const int8_t* h = x[c].hi + 32 * b;
          const int8_t* l = x[c].lo + 32 * b;
          const __m512i h0 = broadcast16(h), h1 = broadcast16(h + 16), l0 = broadcast16(l), l1 = broadcast16(l + 16);
          __m512i acc[4];
          for (int g = 0; g < 4; ++g) {
            const __mmask64 n0 = _mm512_movepi8_mask(u0[g]), n1 = _mm512_movepi8_mask(u1[g]);
            const __m512i a0 = _mm512_abs_epi8(u0[g]), a1 = _mm512_abs_epi8(u1[g]);
            const __m512i z = _mm512_setzero_si512();
            const __m512i sh0 = _mm512_mask_sub_epi8(h0, n0, z, h0), sh1 = _mm512_mask_sub_epi8(h1, n1, z, h1);
            const __m512i sl0 = _mm512_mask_sub_epi8(l0, n0, z, l0), sl1 = _mm512_mask_sub_epi8(l1, n1, z, l1);
            // |q| may be 128: each byte product's pair sums are widened on their own (dot).
            acc[g] = dot(dot(_mm512_slli_epi32(dot(dot(z, a0, sh0), a1, sh1), 7), a0, sl0), a1, sl1);
          }
          f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce4(acc)), _mm512_mul_ps(d, _mm512_set1_ps(x[c].d[b])), f[c]);
        }
      } else {
        __m512 o;
        if constexpr (F == QFormat::kQ4_1) o = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header, 16)));
        else o = _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
        for (int c = 0; c < C; ++c) {
          const int8_t* h = x[c].hi + 32 * b;
          const int8_t* l = x[c].lo + 32 * b;
          const __m512i h0 = broadcast16(h), h1 = broadcast16(h + 16), l0 = broadcast16(l), l1 = broadcast16(l + 16);
          __m512i acc[4];
          for (int g = 0; g < 4; ++g) acc[g] = span_dot(u0[g], u1[g], h0, h1, l0, l1);
          f[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(reduce4(acc)), _mm512_mul_ps(d, _mm512_set1_ps(x[c].d[b])), f[c]);
          f[c] = _mm512_fmadd_ps(o, _mm512_set1_ps(x[c].sum32[b]), f[c]);
        }
      }
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + c * 16, f[c]);
  }
};

// sum of 128 * hi[i] + lo[i] over 16 values, exactly (|sum| < 2^19).
inline int32_t plane_sum16(const int8_t* hi, const int8_t* lo) {
  const __m512i h = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)));
  const __m512i l = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
}

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

// AVX2: a panel's 16 rows are two vectors of 8 int32 lanes (rows 0-7, 8-15).
template <bool Vnni>
struct Int8Panel {
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = 2;  // 16 vector registers

  static __m256i dot(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static __m256i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }

  // See the AVX-512 variant: rows 0-7 and 8-15 are transposed as two halves.
  static constexpr bool stages(QFormat f) { return f == QFormat::kQ4_0 || f == QFormat::kQ4_1 || f == QFormat::kQ8_0; }
  // 8 rows' 16-byte runs -> four vectors, vector v's lane r holding dword v of row r.
  static void transpose8x4(const uint8_t* at, int64_t row_bytes, __m256i out[4]) {
    const __m256i by_dword = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i t[4];
    for (int p = 0; p < 4; ++p) {
      const uint8_t* r0 = at + 2 * p * row_bytes;
      const __m256i v = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + row_bytes)),
                                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0)));
      t[p] = _mm256_permutevar8x32_epi32(v, by_dword);  // qword v: dword v of the two rows
    }
    const __m256i lo01 = _mm256_unpacklo_epi64(t[0], t[1]), hi01 = _mm256_unpackhi_epi64(t[0], t[1]);
    const __m256i lo23 = _mm256_unpacklo_epi64(t[2], t[3]), hi23 = _mm256_unpackhi_epi64(t[2], t[3]);
    out[0] = _mm256_permute2x128_si256(lo01, lo23, 0x20);
    out[1] = _mm256_permute2x128_si256(hi01, hi23, 0x20);
    out[2] = _mm256_permute2x128_si256(lo01, lo23, 0x31);
    out[3] = _mm256_permute2x128_si256(hi01, hi23, 0x31);
  }
  template <QFormat F>
  static void stage_blocks(const uint8_t* rows, const uint8_t* next, int64_t row_bytes, int64_t blocks, int8_t* q, float* scale,
                           float* offset) {
    constexpr int kBytes = qformat_info(static_cast<int>(F)).block_bytes;
    constexpr int kHeader = F == QFormat::kQ4_1 ? 4 : 2;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* at = rows + b * kBytes;
      if (next != nullptr)
        for (int r = 0; r < kPanelRows; ++r) __builtin_prefetch(next + r * row_bytes + b * kBytes);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* half = at + 8 * h * row_bytes;
        alignas(32) float d[8], o[8];
        for (int r = 0; r < 8; ++r) {
          d[r] = half_to_float(half + r * row_bytes);
          if constexpr (F == QFormat::kQ4_1) o[r] = half_to_float(half + r * row_bytes + 2);
          else if constexpr (F == QFormat::kQ4_0) o[r] = -8.f * d[r];
          else o[r] = 0.f;
        }
        for (int g = 0; g < 2; ++g) {
          std::memcpy(scale + (2 * b + g) * 16 + 8 * h, d, sizeof d);
          std::memcpy(offset + (2 * b + g) * 16 + 8 * h, o, sizeof o);
        }
        __m256i v[4];
        int8_t* dst = q + 2 * b * kPanelGroupBytes + 32 * h;
        if constexpr (F == QFormat::kQ8_0) {
          for (int g = 0; g < 2; ++g) {
            transpose8x4(half + kHeader + 16 * g, row_bytes, v);
            for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + g * kPanelGroupBytes + 64 * i), v[i]);
          }
        } else {
          transpose8x4(half + kHeader, row_bytes, v);
          const __m256i mask = _mm256_set1_epi8(0x0F);
          for (int i = 0; i < 4; ++i) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * i), _mm256_and_si256(v[i], mask));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + kPanelGroupBytes + 64 * i),
                                _mm256_and_si256(_mm256_srli_epi16(v[i], 4), mask));
          }
        }
      }
    }
  }
  template <int R, int C, bool Signed, int S>
  static void tile(const PanelRef* w, const ActRef* x, int64_t groups, float* out) {
    __m256 f[R][C][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) f[r][c][0] = f[r][c][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < groups; j += S) {
      __m256i acc[R][C][2];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_si256();
      for (int plane = 0; plane < 2; ++plane) {
        if (plane == 1)
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c)
              for (int h = 0; h < 2; ++h) acc[r][c][h] = _mm256_slli_epi32(acc[r][c][h], 7);
        // Unrolled in full: GCC's default keeps this AVX2 loop rolled, 1.5x slower at 512 rows.
#pragma GCC unroll 8
        for (int v = 0; v < 4 * S; ++v) {
          __m256i wq[R][2];
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h)
              wq[r][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[r].q + j * kPanelGroupBytes + v * 64 + 32 * h));
          for (int c = 0; c < C; ++c) {
            const __m256i b = broadcast4((plane == 0 ? x[c].hi : x[c].lo) + 16 * j + 4 * v);
            for (int r = 0; r < R; ++r)
              for (int h = 0; h < 2; ++h) {
                if constexpr (Signed) acc[r][c][h] = dot(acc[r][c][h], _mm256_abs_epi8(wq[r][h]), _mm256_sign_epi8(b, wq[r][h]));
                else acc[r][c][h] = dot(acc[r][c][h], wq[r][h], b);
              }
          }
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) {
          const __m256 scale = _mm256_loadu_ps(w[r].scale + 16 * j + 8 * h), offset = _mm256_loadu_ps(w[r].offset + 16 * j + 8 * h);
          for (int c = 0; c < C; ++c) {
            f[r][c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c][h]), _mm256_mul_ps(scale, _mm256_set1_ps(x[c].d[j / 2])), f[r][c][h]);
            if constexpr (!Signed) f[r][c][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x[c].template sum<S>(j / S)), f[r][c][h]);
          }
        }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (r * C + c) * 16 + 8 * h, f[r][c][h]);
  }

  // Few activation rows, panels read straight from their blocks: see the AVX-512 variant. Each half
  // of the panel (rows 8h to 8h + 7) is four vectors, vector g holding rows 8h + g and 8h + 4 + g.
  static constexpr int kStreamCols = 8;
  static constexpr bool streams(QFormat f) { return stages(f); }
  static __m256i load_rows2(const uint8_t* p, int64_t stride) {
    return _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + stride)),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static __m256i broadcast16(const int8_t* p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // Lane r: the first 4 bytes at row r (rows row_bytes apart), a block's header.
  static __m256i headers8(const uint8_t* at, int64_t row_bytes) {
    __m256i a[4];
    for (int g = 0; g < 4; ++g) a[g] = load_rows2(at + g * row_bytes, 4 * row_bytes);
    return _mm256_unpacklo_epi64(_mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpacklo_epi32(a[2], a[3]));
  }
  static __m256i reduce4(const __m256i a[4]) {
    const __m256i t0 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[0], a[1]), _mm256_unpackhi_epi32(a[0], a[1]));
    const __m256i t1 = _mm256_add_epi32(_mm256_unpacklo_epi32(a[2], a[3]), _mm256_unpackhi_epi32(a[2], a[3]));
    return _mm256_add_epi32(_mm256_unpacklo_epi64(t0, t1), _mm256_unpackhi_epi64(t0, t1));
  }
  // The half-precision values in the low 16 bits of each int32 lane, as floats.
  static __m256 halves_to_float(__m256i v) {
    const __m256i low = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1)));
  }
  static __m256i span_dot(__m256i u0, __m256i u1, __m256i h0, __m256i h1, __m256i l0, __m256i l1) {
    const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(u0, h0), _mm256_maddubs_epi16(u1, h1));
    const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(u0, l0), _mm256_maddubs_epi16(u1, l1));
    return _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(128)), _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
  }
  template <QFormat F, int C>
  static void stream(const uint8_t* rows, int64_t row_bytes, int64_t blocks, const ActRef* x, const uint8_t* pf,
                     const uint8_t* pf_end, int64_t pf_step, float* out) {
    constexpr int kBytes = qformat_info(static_cast<int>(F)).block_bytes;
    constexpr int kHeader = F == QFormat::kQ4_1 ? 4 : 2;
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 f[C][2];
    for (int c = 0; c < C; ++c) f[c][0] = f[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, pf += pf_step) {
      for (const uint8_t* p = pf; p < pf + pf_step && p < pf_end; p += 64) __builtin_prefetch(p);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* at = rows + 8 * h * row_bytes + b * kBytes;
        const __m256i header = headers8(at, row_bytes);
        const __m256 d = halves_to_float(header);
        __m256i u0[4], u1[4];
        for (int g = 0; g < 4; ++g) {
          const uint8_t* q = at + kHeader + g * row_bytes;
          if constexpr (F == QFormat::kQ8_0) {
            u0[g] = load_rows2(q, 4 * row_bytes);
            u1[g] = load_rows2(q + 16, 4 * row_bytes);
          } else {
            const __m256i v = load_rows2(q, 4 * row_bytes);
            u0[g] = _mm256_and_si256(v, nibble);
            u1[g] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          }
        }
        if constexpr (F == QFormat::kQ8_0) {
          for (int c = 0; c < C; ++c) {
            const int8_t* hp = x[c].hi + 32 * b;
            const int8_t* lp = x[c].lo + 32 * b;
            const __m256i h0 = broadcast16(hp), h1 = broadcast16(hp + 16), l0 = broadcast16(lp), l1 = broadcast16(lp + 16);
            __m256i acc[4];
            for (int g = 0; g < 4; ++g) {
              const __m256i a0 = _mm256_abs_epi8(u0[g]), a1 = _mm256_abs_epi8(u1[g]), z = _mm256_setzero_si256();
              const __m256i hs = dot(dot(z, a0, _mm256_sign_epi8(h0, u0[g])), a1, _mm256_sign_epi8(h1, u1[g]));
              acc[g] = dot(dot(_mm256_slli_epi32(hs, 7), a0, _mm256_sign_epi8(l0, u0[g])), a1, _mm256_sign_epi8(l1, u1[g]));
            }
            f[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce4(acc)), _mm256_mul_ps(d, _mm256_set1_ps(x[c].d[b])), f[c][h]);
          }
        } else {
          __m256 o;
          if constexpr (F == QFormat::kQ4_1) o = halves_to_float(_mm256_srli_epi32(header, 16));
          else o = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
          for (int c = 0; c < C; ++c) {
            const int8_t* hp = x[c].hi + 32 * b;
            const int8_t* lp = x[c].lo + 32 * b;
            const __m256i h0 = broadcast16(hp), h1 = broadcast16(hp + 16), l0 = broadcast16(lp), l1 = broadcast16(lp + 16);
            __m256i acc[4];
            for (int g = 0; g < 4; ++g) acc[g] = span_dot(u0[g], u1[g], h0, h1, l0, l1);
            f[c][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce4(acc)), _mm256_mul_ps(d, _mm256_set1_ps(x[c].d[b])), f[c][h]);
            f[c][h] = _mm256_fmadd_ps(o, _mm256_set1_ps(x[c].sum32[b]), f[c][h]);
          }
        }
      }
    }
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + c * 16 + 8 * h, f[c][h]);
  }
};

inline int32_t plane_sum16(const int8_t* hi, const int8_t* lo) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi));
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lo));
  const __m256i v = _mm256_add_epi16(_mm256_slli_epi16(_mm256_cvtepi8_epi16(h), 7), _mm256_cvtepi8_epi16(l));
  __m256i s = _mm256_madd_epi16(v, _mm256_set1_epi16(1));  // 8 int32 pair sums; 128 * hi + lo fits int16
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
}

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
struct Int8Panel {
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = 2;


  static constexpr bool stages(QFormat) { return false; }  // scalar panels always go through stage_rows
  static constexpr int kStreamCols = 0;  // no streaming path: every row goes through panels
  template <QFormat F>
  static void stage_blocks(const uint8_t*, const uint8_t*, int64_t, int64_t, int8_t*, float*, float*) {}
  template <int R, int C, bool Signed, int S>
  static void tile(const PanelRef* w, const ActRef* x, int64_t groups, float* out) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int lane = 0; lane < kPanelRows; ++lane) {
          float f = 0.f;
          for (int64_t j = 0; j < groups; j += S) {
            int32_t hi = 0, lo = 0;
            for (int i = 0; i < 16 * S; ++i) {
              const int32_t q = w[r].q[j * kPanelGroupBytes + (i / 4) * 64 + lane * 4 + i % 4];
              hi += q * x[c].hi[16 * j + i];
              lo += q * x[c].lo[16 * j + i];
            }
            f = std::fma(static_cast<float>(hi * 128 + lo), w[r].scale[16 * j + lane] * x[c].d[j / 2], f);
            if constexpr (!Signed) f = std::fma(w[r].offset[16 * j + lane], x[c].template sum<S>(j / S), f);
          }
          out[(r * C + c) * 16 + lane] = f;
        }
  }
};

inline int32_t plane_sum16(const int8_t* hi, const int8_t* lo) {
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) s += 128 * hi[i] + lo[i];
  return s;
}

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

// The bf16 panel path without native bf16 dot products: the same bf16 weights, and per output
// element the same float32 sums of exact products, odd value of a pair first as vdpbf16ps adds them
// (denormals aside, which vdpbf16ps flushes). Scalar code for the variants that are never the fast
// choice for bf16 (qmatmul_bf16_native is false there).
struct Bf16PanelGeneric {
  static constexpr int kTilePanels = 1;
  static constexpr int kTileCols = 1;
  static void convert(const PanelRef& in, int64_t groups, bf16_t* out) {
    for (int64_t j = 0; j < groups; ++j)
      for (int v = 0; v < 4; ++v)
        for (int r = 0; r < kPanelRows; ++r)
          for (int b = 0; b < 4; ++b) {
            const float q = in.q[j * kPanelGroupBytes + 64 * v + 4 * r + b];
            out[j * kBf16PanelGroupElems + (2 * v + b / 2) * 32 + 2 * r + b % 2] =
                float_to_bf16(std::fma(q, in.scale[16 * j + r], in.offset[16 * j + r]));
          }
  }
  template <int R, int C>
  static void tile(const bf16_t* const* w, const bf16_t* const* x, int64_t pairs, float* out) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int lane = 0; lane < kPanelRows; ++lane) {
          float f = 0.f;
          for (int64_t p = 0; p < pairs; ++p) {
            const bf16_t* wp = w[r] + 32 * p + 2 * lane;
            f = std::fma(bf16_to_float(wp[1]), bf16_to_float(x[c][2 * p + 1]), f);
            f = std::fma(bf16_to_float(wp[0]), bf16_to_float(x[c][2 * p]), f);
          }
          out[(r * C + c) * 16 + lane] = f;
        }
  }
};

#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_BF16_DOT)
// vdpbf16ps over bf16 panels: each output element is one lane's float32 chain over the pairs in k
// order, whatever the tile or the number of activation rows.
struct Bf16Panel {
  // 4 panels x 6 activation rows: 24 accumulators, four weight vectors and a broadcast.
  static constexpr int kTilePanels = 4;
  static constexpr int kTileCols = 6;
  // An int8 panel (q holds signed values; unsigned formats stay below 64) to bf16 pairs, rounded as
  // float_to_bf16 rounds.
  static void convert(const PanelRef& in, int64_t groups, bf16_t* out) {
    static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512(kInterleave);
    for (int64_t j = 0; j < groups; ++j) {
      const __m512 scale = _mm512_loadu_ps(in.scale + 16 * j), offset = _mm512_loadu_ps(in.offset + 16 * j);
      bf16_t* dst = out + j * kBf16PanelGroupElems;
      for (int v = 0; v < 4; ++v) {
        const __m512i q = _mm512_loadu_si512(in.q + j * kPanelGroupBytes + 64 * v);
        __m512 f[4];
        f[0] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 24), 24));
        f[1] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 16), 24));
        f[2] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(q, 8), 24));
        f[3] = _mm512_cvtepi32_ps(_mm512_srai_epi32(q, 24));
        for (int h = 0; h < 2; ++h) {
          // cvtne2ps puts the first operand's 16 values in the upper half: lane r pairs value 2h
          // (lower half) with 2h + 1 (upper half) after the interleave.
          const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(f[2 * h + 1], scale, offset),
                                                           _mm512_fmadd_ps(f[2 * h], scale, offset));
          _mm512_storeu_si512(dst + (2 * v + h) * 32, _mm512_permutexvar_epi16(interleave, pair));
        }
      }
    }
  }
  template <int R, int C>
  static void tile(const bf16_t* const* w, const bf16_t* const* x, int64_t pairs, float* out) {
    __m512 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_si512(w[r] + 32 * p);
      for (int c = 0; c < C; ++c) {
        int32_t xv;
        std::memcpy(&xv, x[c] + 2 * p, 4);
        const __m512i b = _mm512_set1_epi32(xv);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)wv[r], (__m512bh)b);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (r * C + c) * 16, acc[r][c]);
  }
};
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
