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

#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_BF16_DOT) && defined(MINDIE_AMX)
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

  static void convert(const PanelRef& in, int64_t groups, bf16_t* out) { Bf16Panel::convert(in, groups, out); }

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
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
