// AMX tiles for the bf16 form of the quantized matmul (quant_matmul.cpp's run_bf16), for the int8
// form's rows from 32 on (AmxInt8Panel, run_amx_int8) and for prefill attention, where the CPU has
// AMX-BF16 and the kernel granted the tile state (cpu_has_amx_bf16). A bf16 panel (vec_int8.h)
// is already a tile's B operand: per pair of k values, 16 rows' two bf16 values, 64 bytes; 16 pairs
// (32 values of k) make one 16 x 64-byte tile. Activation rows are A tiles, 16 rows at one stride.
//
// tdpbf16ps sums a tile's 32 products per element in its own order and rounding (not vdpbf16ps's
// pair-by-pair chain), so an output element differs from vdpbf16ps's by float32 rounding. It is
// still reduced identically wherever it is computed: the same 32-value steps in k order into one
// float32 accumulator, whatever the tile's other rows or the thread split. Every bf16 row takes the
// tiles while they are in use, so a row's result never depends on the rest of the batch.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "cpu/vec_int8.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

#if defined(MINDIE_AMX)
// Asks for [at, end) into L2, `per_step` cache lines a step(): spread over a computation, rather than
// at once, which the core's few outstanding misses would mostly drop.
struct SpreadPrefetch {
  const uint8_t* at;
  const uint8_t* end;
  int64_t per_step;
  void step() {
    for (int64_t i = 0; i < per_step && at < end; ++i, at += 64) __builtin_prefetch(at, 0, 2);
  }
};

// One tile's shape in a configuration: rows, and bytes a row.
struct TileShape {
  int rows, bytes;
};

// The tile configuration (palette 1; shape(t) for tiles 0-7) loaded for the calling thread and the
// tiles released when done. It is per thread and other code (oneDNN) may change or release it, so
// each group of panels (each call of the attention) loads its own.
class TileSession {
 public:
  template <class Shape>
  explicit TileSession(Shape shape) {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;
    for (int t = 0; t < 8; ++t) {
      const TileShape s = shape(t);
      config[16 + 2 * t] = static_cast<uint8_t>(s.bytes);
      config[48 + t] = static_cast<uint8_t>(s.rows);
    }
    _tile_loadconfig(config);
  }
  ~TileSession() { _tile_release(); }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;
};

struct AmxBf16Panel {
  // Two panels x two blocks of 16 activation rows at a time: four accumulator tiles (0-3), two A
  // tiles (4, 5) and two B tiles (6, 7), AMX's eight. Up to kTilePanels staged together (run_bf16).
  static constexpr int kTilePanels = 16;
  // Rows are read 16 at a time at one stride: a tile's rows past the last activation row must be
  // readable (run_bf16 copies the last partial block into a zero-padded buffer).
  static constexpr int kRowBlock = 16;

  // Every tile 16 rows of 64 bytes.
  struct Session : TileSession {
    Session() : TileSession([](int) { return TileShape{16, 64}; }) {}
  };

  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, bf16_t* out) {
    Bf16Panel::stage_block<F>(panel, blocks, b, out);
  }

  // The 16 x 16 float32 sums of panels w[0..panels) (staged from pair p0 on) and one or two blocks of
  // 16 activation rows (x[0], x[16]: each the first of 16 rows `stride` bytes apart) over pairs
  // [p0, p1) of k: carried on from acc when `resume`, else from zero, into acc, whose tile for block i
  // and panel r starts at acc + i * block_floats + r * 256 (its rows 16 floats apart). Panels go two at
  // a time, so each block of activation rows is read once for every two panels, from the cache for
  // all but the first two.
  static void tile(const bf16_t* const* w, int panels, const bf16_t* const* x, bool two_blocks, int64_t p0, int64_t p1,
                   int64_t stride, bool resume, float* acc, int64_t block_floats) {
    for (int r = 0; r < panels; r += 2) {
      const bool two_panels = r + 1 < panels;
      float* at = acc + r * 256;
      if (two_blocks) {
        two_panels ? tile_2x2<2, true>(w + r, x, p0, p1, stride, resume, at, block_floats)
                   : tile_2x2<1, true>(w + r, x, p0, p1, stride, resume, at, block_floats);
      } else {
        two_panels ? tile_2x2<2, false>(w + r, x, p0, p1, stride, resume, at, block_floats)
                   : tile_2x2<1, false>(w + r, x, p0, p1, stride, resume, at, block_floats);
      }
    }
  }

 private:
  // R (1 or 2) panels against one or two blocks of 16 rows.
  template <int R, bool kTwoBlocks>
  static void tile_2x2(const bf16_t* const* w, const bf16_t* const* x, int64_t p0, int64_t p1, int64_t stride, bool resume,
                       float* acc, int64_t block_floats) {
    float* const c0 = acc;                      // block 0, panel 0
    float* const c1 = acc + block_floats;       // block 1, panel 0
    float* const c2 = acc + 256;                // block 0, panel 1
    float* const c3 = acc + block_floats + 256; // block 1, panel 1
    if (resume) {
      _tile_loadd(0, c0, 64);
      if constexpr (kTwoBlocks) _tile_loadd(1, c1, 64);
      if constexpr (R == 2) _tile_loadd(2, c2, 64);
      if constexpr (R == 2 && kTwoBlocks) _tile_loadd(3, c3, 64);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t p = p0; p < p1; p += 16) {
      _tile_loadd(4, x[0] + 2 * p, stride);
      _tile_loadd(6, w[0] + 32 * (p - p0), 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (kTwoBlocks) {
        _tile_loadd(5, x[16] + 2 * p, stride);
        _tile_dpbf16ps(1, 5, 6);
      }
      if constexpr (R == 2) {
        _tile_loadd(7, w[1] + 32 * (p - p0), 64);
        _tile_dpbf16ps(2, 4, 7);
        if constexpr (kTwoBlocks) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, 64);
    if constexpr (kTwoBlocks) _tile_stored(1, c1, 64);
    if constexpr (R == 2) _tile_stored(2, c2, 64);
    if constexpr (R == 2 && kTwoBlocks) _tile_stored(3, c3, 64);
  }
};

// The int8 rows' exact span sums on AMX-BF16 tiles (quant_matmul.cpp's run_amx_int8), for rows from
// 32 on and unsigned q over 32-value spans (amx_int8_rows: every format but Q8_0 and Q6_K). Each
// product is an integer: q (0 to 31) against 128 * hi and against lo, all exact in bf16, so each
// product is exact in float32, and so is every partial sum while the span's sum of |q| * |128 * hi +
// lo| stays below 2^24: at most 32 * 31 * (127 * 128 + 64) = 16.19e6 over a 32-value span.
// In whatever order the tile adds them, its float32 accumulator then ends at exactly the int32 sum s
// of the other paths, so the float chain after it (Int8Panel::add_span's) gives the same bits. Two
// tile products a span (the hi and lo planes into one accumulator) and one store of the sums, where
// AMX-INT8 would take two of each (one a plane: 128 * hi is not a byte).
struct AmxInt8Panel : Int8Panel<true> {
  static constexpr int kTilePanels = 4;
  static constexpr int kRowBlock = 16;
  using Weight = bf16_t;

  // Tiles 0 and 1: A, 16 activation rows' 128 * hi and lo over one span (16 * S values); tiles 2 and
  // 3: B, two panels' values over the span (8 * S pairs); tiles 4-7: the sums of even spans (4, 6) and
  // odd ones (5, 7), one tile a panel.
  struct Session : TileSession {
    explicit Session(int span_values)
        : TileSession([&](int t) {
            return t < 2 ? TileShape{16, 2 * span_values} : TileShape{t < 4 ? span_values / 2 : 16, 64};
          }) {}
  };

  // Block b of a packed panel staged in the wide layout (WidePanel's), each q (0 to 31: Q8_0 and Q6_K
  // never come here, see quant_matmul.cpp's amx_int8_rows) as bf16, looked up a byte at a time:
  // vpshufb takes 16 entries, so 5-bit q take two lookups and a blend. Vector u[v] holds values
  // 4v..4v+3 of each row (lane r: row r), pairs (4v, 4v + 1) and (4v + 2, 4v + 3) go out. Four
  // shuffles and two lookups a vector where widening to int16 and vpermt2w took ten (a third of
  // the 32-row tile's time in the staging).
  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, bf16_t* q, float* scale, float* offset) {
    constexpr bool kFiveBits = F == QFormat::kQ5_0 || F == QFormat::kQ5_1 || F == QFormat::kQ5_K;
    const __m512i lo0 = _mm512_broadcast_i32x4(byte_table(0, 0)), hi0 = _mm512_broadcast_i32x4(byte_table(0, 1));
    const __m512i lo1 = _mm512_broadcast_i32x4(byte_table(16, 0)), hi1 = _mm512_broadcast_i32x4(byte_table(16, 1));
    stage_block_with<Lanes, F>(panel, blocks, b, scale, offset, [&](const __m512i* u, int) __attribute__((always_inline)) {
      for (int v = 0; v < 8; ++v) {
        __m512i l = _mm512_shuffle_epi8(lo0, u[v]), h = _mm512_shuffle_epi8(hi0, u[v]);
        if constexpr (kFiveBits) {
          const __mmask64 high = _mm512_test_epi8_mask(u[v], _mm512_set1_epi8(16));
          l = _mm512_mask_shuffle_epi8(l, high, lo1, u[v]);
          h = _mm512_mask_shuffle_epi8(h, high, hi1, u[v]);
        }
        // Per 128-bit lane (rows 4i..4i + 3): unpacklo holds rows 4i and 4i + 1 as four bf16 each,
        // unpackhi rows 4i + 2 and 4i + 3; the even and odd dwords of the two are the two pairs.
        const __m512 a = _mm512_castsi512_ps(_mm512_unpacklo_epi8(l, h));
        const __m512 c = _mm512_castsi512_ps(_mm512_unpackhi_epi8(l, h));
        bf16_t* dst = q + wide_pairs_at(b, v);
        _mm512_storeu_ps(dst, _mm512_shuffle_ps(a, c, 0x88));
        _mm512_storeu_ps(dst + 32, _mm512_shuffle_ps(a, c, 0xDD));
      }
    });
  }

  // An activation row's planes as the A tiles take them: bf16 of 128 * hi and of lo (k values each).
  static void widen(const int8_t* hi, const int8_t* lo, int64_t k, bf16_t* hi_out, bf16_t* lo_out) {
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 h = _mm512_cvtepi32_ps(_mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i))), 7));
      const __m512 l = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + i))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi_out + i), (__m256i)_mm512_cvtneps_pbh(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo_out + i), (__m256i)_mm512_cvtneps_pbh(l));
    }
  }

  // out[(r * cols + c) * 16 + lane] = f of panel r's row `lane` and activation row c < cols, for R
  // (1 or 2) panels and the 16 rows x[0..16) (all readable: their d and sums), whose widened planes
  // start at a_hi and a_lo, rows `stride` bytes apart. Two panels share the A tiles, and their tile
  // products alternate, each waiting less on the one before into the same accumulator (10-20% faster
  // than one at a time); the second panel's float sums live in memory, the first's in registers.
  template <int R, int S>
  static void tile(const StagedPanel<bf16_t>* w, const ActRef* x, const bf16_t* a_hi, const bf16_t* a_lo, int64_t stride,
                   int64_t groups, int cols, float* out, SpreadPrefetch& prefetch) {
    alignas(64) float sums[2][R][16 * 16];  // [span parity][panel]
    alignas(64) float second[16 * 16] = {};
    __m512 f[16];
    for (__m512& v : f) v = _mm512_setzero_ps();
    products<R, S, 0>(w, a_hi, a_lo, stride, 0, sums[0]);
    for (int64_t j = 0; j < groups; j += S) {
      // The next span's tile products run while this one's sums go through the float chain.
      const bool odd = (j / S) % 2 != 0;
      if (j + S < groups) odd ? products<R, S, 0>(w, a_hi, a_lo, stride, j + S, sums[0])
                              : products<R, S, 1>(w, a_hi, a_lo, stride, j + S, sums[1]);
      prefetch.step();
      for (int r = 0; r < R; ++r) {
        const float* s = sums[odd ? 1 : 0][r];
        const __m512 scale = _mm512_loadu_ps(w[r].scale + 16 * j), offset = _mm512_loadu_ps(w[r].offset + 16 * j);
        for (int c = 0; c < 16; ++c) {
          __m512 g = r == 0 ? f[c] : _mm512_load_ps(second + 16 * c);
          g = _mm512_fmadd_ps(_mm512_load_ps(s + 16 * c), _mm512_mul_ps(scale, _mm512_set1_ps(x[c].d[j / 2])), g);
          g = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[c].template sum<S>(j / S)), g);
          if (r == 0) f[c] = g;
          else _mm512_store_ps(second + 16 * c, g);
        }
      }
    }
    for (int c = 0; c < cols; ++c) _mm512_storeu_ps(out + c * 16, f[c]);
    if constexpr (R == 2) std::memcpy(out + cols * 16, second, sizeof(float) * 16 * cols);
  }

 private:
  // bf16 of a small integer (exact: every integer below 256 is a bf16), at compile time.
  static constexpr uint16_t small_bf16(int i) {
    int e = 0;
    while ((2 << e) <= i) ++e;
    const uint32_t bits = i == 0 ? 0u : (static_cast<uint32_t>(127 + e) << 23) | ((static_cast<uint32_t>(i) << (23 - e)) & 0x7FFFFFu);
    return static_cast<uint16_t>(bits >> 16);
  }
  // Byte `byte` (0: low, 1: high) of bf16(first + i) for i = 0..15: a vpshufb table.
  static __m128i byte_table(int first, int byte) {
    static constexpr auto kTables = [] {
      std::array<std::array<uint8_t, 16>, 4> t{};
      for (int k = 0; k < 4; ++k)
        for (int i = 0; i < 16; ++i) t[k][i] = static_cast<uint8_t>(small_bf16(16 * (k / 2) + i) >> (8 * (k % 2)));
      return t;
    }();
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(kTables[2 * (first / 16) + byte].data()));
  }

  // Span j's sums of R panels, through the accumulator tiles of span parity P, into sums[r]. (GCC's
  // tile intrinsics take tile numbers as literals: hence each spelled out.)
  template <int R, int S, int P>
  static void products(const StagedPanel<bf16_t>* w, const bf16_t* a_hi, const bf16_t* a_lo, int64_t stride, int64_t j,
                       float (*sums)[16 * 16]) {
    _tile_loadd(0, a_hi + 16 * j, stride);
    _tile_loadd(1, a_lo + 16 * j, stride);
    _tile_loadd(2, w[0].q + j * kPanelGroupValues, 64);
    if constexpr (R == 2) _tile_loadd(3, w[1].q + j * kPanelGroupValues, 64);
#define MINDIE_AMX_SPAN(C0, C1)                      \
  _tile_zero(C0);                                    \
  if constexpr (R == 2) _tile_zero(C1);              \
  _tile_dpbf16ps(C0, 0, 2);                          \
  if constexpr (R == 2) _tile_dpbf16ps(C1, 0, 3);    \
  _tile_dpbf16ps(C0, 1, 2);                          \
  if constexpr (R == 2) _tile_dpbf16ps(C1, 1, 3);    \
  _tile_stored(C0, sums[0], 64);                     \
  if constexpr (R == 2) _tile_stored(C1, sums[R - 1], 64);
    if constexpr (P == 0) {
      MINDIE_AMX_SPAN(4, 6)
    } else {
      MINDIE_AMX_SPAN(5, 7)
    }
#undef MINDIE_AMX_SPAN
  }
};

// The tile products of prefill attention (attention_prefill_amx.cpp), in the tile shape AmxBf16Panel's
// Session configures. A float32 operand goes in as two bf16 planes, hi = bf16(x) and lo = bf16(x - hi),
// whose exact products with a bf16 operand (the cache's keys and values) sum to x's within 2^-16:
// float32 attention's precision at two tile products each.
struct AmxAttention {
  // x ~= hi + lo, both bf16 (round to nearest even): hi rounds x, lo rounds what hi missed.
  static void split_bf16(const float* x, int n, bf16_t* hi, bf16_t* lo) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m256bh h = _mm512_cvtneps_pbh(v);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), (__m256i)h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
    }
    for (; i < n; ++i) {
      hi[i] = float_to_bf16(x[i]);
      lo[i] = float_to_bf16(x[i] - bf16_to_float(hi[i]));
    }
  }

  // The B tiles of 16 keys k[0..16) (D values each, D a multiple of 32; a null key is zeros), one per
  // 32 values of d: kt[c * 512 + 32 * p + 2 * key + e] = k[key][32 * c + 2 * p + e].
  static void pack_keys(const bf16_t* const* k, int D, bf16_t* kt) {
    for (int c = 0; c < D / 32; ++c) {
      // Row `key` of the 16 x 16 matrix of value pairs (4 bytes each) becomes its column.
      __m512i rows[16];
      for (int key = 0; key < 16; ++key)
        rows[key] = k[key] != nullptr ? _mm512_loadu_si512(k[key] + 32 * c) : _mm512_setzero_si512();
      transpose_16x16_epi32(rows);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kt + c * 512 + 32 * p, rows[p]);
    }
  }

  // The B tiles of 32 values v[0..32) (D values each, D a multiple of 16; a null value is zeros), one
  // per 16 values of d: vt[j * 512 + 32 * p + 2 * d + e] = v[2 * p + e][16 * j + d].
  static void pack_values(const bf16_t* const* v, int D, bf16_t* vt) {
    // Lane 2d takes the even row's d, lane 2d + 1 the odd row's (vpermt2w's second operand: 32 + d).
    alignas(64) static constexpr uint16_t kInterleave[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                             8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    const auto row = [&](int key, int j) {
      return v[key] != nullptr ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v[key] + 16 * j)))
                               : _mm512_setzero_si512();
    };
    for (int j = 0; j < D / 16; ++j)
      for (int p = 0; p < 16; ++p)
        _mm512_storeu_si512(vt + j * 512 + 32 * p, _mm512_permutex2var_epi16(row(2 * p, j), interleave, row(2 * p + 1, j)));
  }

  // s[r][0..32) (rows `s_stride` floats apart) = q[r] . k for the 16 query rows q (hi and lo planes;
  // rows D values apart) and the 32 keys of B tiles kt0 (keys 0-15) and kt1 (16-31), each D / 32 tiles
  // as pack_keys writes them.
  static void scores(const bf16_t* qhi, const bf16_t* qlo, int D, const bf16_t* kt0, const bf16_t* kt1, float* s,
                     int64_t s_stride) {
    const int64_t q_bytes = 2 * static_cast<int64_t>(D);
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(2, qhi + 32 * c, q_bytes);
      _tile_loadd(4, kt0 + 512 * c, 64);
      _tile_loadd(5, kt1 + 512 * c, 64);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 2, 5);
      _tile_loadd(3, qlo + 32 * c, q_bytes);
      _tile_dpbf16ps(0, 3, 4);
      _tile_dpbf16ps(1, 3, 5);
    }
    _tile_stored(0, s, 4 * s_stride);
    _tile_stored(1, s + 16, 4 * s_stride);
  }

  // o[r][0..D) (rows D floats apart) = p[r] . v over `chunks` of 32 keys for the 16 rows of p (hi and lo
  // planes, rows p_stride values apart), v as pack_values writes a chunk (D / 16 tiles a chunk, chunks
  // back to back): four d tiles at a time, each an independent accumulator.
  static void values(const bf16_t* phi, const bf16_t* plo, int64_t p_stride, const bf16_t* vt, int chunks, int D,
                     float* o) {
    for (int j0 = 0; j0 < D / 16; j0 += 4) {
      switch (std::min(4, D / 16 - j0)) {
        case 4: values_tiles<4>(phi, plo, p_stride, vt, chunks, D, j0, o); break;
        case 3: values_tiles<3>(phi, plo, p_stride, vt, chunks, D, j0, o); break;
        case 2: values_tiles<2>(phi, plo, p_stride, vt, chunks, D, j0, o); break;
        default: values_tiles<1>(phi, plo, p_stride, vt, chunks, D, j0, o); break;
      }
    }
  }

 private:
  template <int N>
  static void values_tiles(const bf16_t* phi, const bf16_t* plo, int64_t p_stride, const bf16_t* vt, int chunks, int D,
                           int j0, float* o) {
    const int64_t p_bytes = 2 * p_stride;
    _tile_zero(0);
    if constexpr (N > 1) _tile_zero(1);
    if constexpr (N > 2) _tile_zero(2);
    if constexpr (N > 3) _tile_zero(3);
    for (int k = 0; k < chunks; ++k) {
      _tile_loadd(4, phi + 32 * k, p_bytes);
      _tile_loadd(5, plo + 32 * k, p_bytes);
      const bf16_t* b = vt + (static_cast<int64_t>(k) * (D / 16) + j0) * 512;
      _tile_loadd(6, b, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(0, 5, 6);
      if constexpr (N > 1) {
        _tile_loadd(7, b + 512, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(1, 5, 7);
      }
      if constexpr (N > 2) {
        _tile_loadd(6, b + 1024, 64);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
      }
      if constexpr (N > 3) {
        _tile_loadd(7, b + 1536, 64);
        _tile_dpbf16ps(3, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t o_bytes = 4 * static_cast<int64_t>(D);
    _tile_stored(0, o + 16 * j0, o_bytes);
    if constexpr (N > 1) _tile_stored(1, o + 16 * (j0 + 1), o_bytes);
    if constexpr (N > 2) _tile_stored(2, o + 16 * (j0 + 2), o_bytes);
    if constexpr (N > 3) _tile_stored(3, o + 16 * (j0 + 3), o_bytes);
  }

  // rows[i] lane j <- rows[j] lane i, for 16 vectors of 16 32-bit lanes.
  static void transpose_16x16_epi32(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
      r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
      r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
      r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
      r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 16; i += 8)
      for (int j = 0; j < 4; ++j) {
        t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + 4 + j], 0x88);
        t[i + 4 + j] = _mm512_shuffle_i32x4(r[i + j], r[i + 4 + j], 0xDD);
      }
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
      r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xDD);
    }
  }
};
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
