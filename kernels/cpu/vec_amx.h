// AMX tiles for the bf16 form of the quantized matmul (quant_matmul.cpp's run_bf16), where the CPU
// has AMX-BF16 and the kernel granted the tile state (cpu_has_amx_bf16). A bf16 panel (vec_int8.h)
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
#include <cstdint>
#include <cstring>

#include "cpu/vec_int8.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

#if defined(MINDIE_AMX)
struct AmxBf16Panel {
  // Two panels x two blocks of 16 activation rows at a time: four accumulator tiles (0-3), two A
  // tiles (4, 5) and two B tiles (6, 7), AMX's eight. Up to kTilePanels staged together (run_bf16).
  static constexpr int kTilePanels = 16;
  static constexpr int kTileCols = 32;
  // Rows are read 16 at a time at one stride: a tile's rows past the last activation row must be
  // readable (run_bf16 copies the last partial block into a zero-padded buffer).
  static constexpr int kRowBlock = 16;

  // The tile configuration is per thread and other code (oneDNN) may change or release it, so each
  // group of panels loads it and releases the tiles when done.
  struct Session {
    Session() {
      alignas(64) uint8_t config[64] = {};
      config[0] = 1;  // palette 1
      for (int t = 0; t < 8; ++t) {
        config[16 + 2 * t] = 64;  // bytes per row
        config[48 + t] = 16;      // rows
      }
      _tile_loadconfig(config);
    }
    ~Session() { _tile_release(); }
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
  };

  template <QFormat F>
  static void stage_block(const uint8_t* panel, int64_t blocks, int64_t b, bf16_t* out) {
    Bf16Panel::stage_block<F>(panel, blocks, b, out);
  }

  // out[(r * cols + c) * 16 + lane] for panels w[0..panels) and activation rows x[0..cols); x[16 * i]
  // starts a block of 16 rows `pairs * 4` bytes apart. Panels go two at a time, so each block of
  // activation rows is read once for every two panels, from the cache for all but the first two.
  static void tile(const bf16_t* const* w, int panels, const bf16_t* const* x, int cols, int64_t pairs, float* out) {
    for (int r = 0; r < panels; r += 2) {
      const bool two_panels = r + 1 < panels;
      float* at = out + r * cols * 16;
      if (cols > 16) {
        two_panels ? tile_2x2<2, true>(w + r, x, pairs, cols, at) : tile_2x2<1, true>(w + r, x, pairs, cols, at);
      } else {
        two_panels ? tile_2x2<2, false>(w + r, x, pairs, cols, at) : tile_2x2<1, false>(w + r, x, pairs, cols, at);
      }
    }
  }

 private:
  // R (1 or 2) panels against one or two blocks of 16 rows, of which `cols` are kept.
  template <int R, bool kTwoBlocks>
  static void tile_2x2(const bf16_t* const* w, const bf16_t* const* x, int64_t pairs, int cols, float* out) {
    const int64_t stride = pairs * 4;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < pairs; p += 16) {
      _tile_loadd(4, x[0] + 2 * p, stride);
      _tile_loadd(6, w[0] + 32 * p, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (kTwoBlocks) {
        _tile_loadd(5, x[16] + 2 * p, stride);
        _tile_dpbf16ps(1, 5, 6);
      }
      if constexpr (R == 2) {
        _tile_loadd(7, w[1] + 32 * p, 64);
        _tile_dpbf16ps(2, 4, 7);
        if constexpr (kTwoBlocks) _tile_dpbf16ps(3, 5, 7);
      }
    }
    if (cols % 16 == 0) {
      // Each block's 16 rows are contiguous in out: store in place.
      _tile_stored(0, out, 64);
      if constexpr (kTwoBlocks) _tile_stored(1, out + 16 * 16, 64);
      if constexpr (R == 2) {
        _tile_stored(2, out + cols * 16, 64);
        if constexpr (kTwoBlocks) _tile_stored(3, out + cols * 16 + 16 * 16, 64);
      }
      return;
    }
    alignas(64) float acc[4][16 * 16];
    _tile_stored(0, acc[0], 64);
    if constexpr (kTwoBlocks) _tile_stored(1, acc[1], 64);
    if constexpr (R == 2) {
      _tile_stored(2, acc[2], 64);
      if constexpr (kTwoBlocks) _tile_stored(3, acc[3], 64);
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < cols; ++c) std::memcpy(out + (r * cols + c) * 16, acc[2 * r + c / 16] + (c % 16) * 16, 64);
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
