// Integer matmul over block-quantized weights (see quant.h). Work is split over the threads as
// contiguous ranges of 4-row weight tiles; each tile is staged once into L1 and applied to every
// activation row, up to 4 at a time. The result of an output element depends only on its weight row
// and activation row: the tile shape and thread split decide where it is computed, never how.
#include <algorithm>
#include <vector>

#include "cpu/dispatch.h"
#include "cpu/parallel.h"
#include "cpu/quant.h"
#include "cpu/vec_int8.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

constexpr int kTileRows = 4;
// 4 x 2 accumulators and two activation steps stay in the 32 vector registers of AVX-512; a 4 x 4
// tile spills them to the stack.
constexpr int kTileCols = 2;

struct Staged {
  std::vector<int8_t> q;
  std::vector<float> scale, offset;
  void resize(int64_t k) {
    q.resize(kTileRows * k);
    scale.resize(kTileRows * k / 16);
    offset.resize(kTileRows * k / 32);
  }
};

// Output rows [row0, row0 + rows) of target t for activation rows [c0, c0 + C).
template <class D, int C, bool HasOffset>
void tile(const Staged& w, const QMatmulArgs& a, const QMatmulTarget& t, int64_t row0, int rows, int64_t c0) {
  const int64_t k = a.k;
  typename D::Acc acc[kTileRows][C];
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = D::zero();
  for (int64_t i = 0; i < k; i += D::kValues) {
    const int n = static_cast<int>(std::min<int64_t>(D::kValues, k - i));
    typename D::X x[C];
    for (int c = 0; c < C; ++c)
      x[c] = D::load_x(a.xq + (c0 + c) * 2 * k + i, a.xq + (c0 + c) * 2 * k + k + i, a.xd + (c0 + c) * (k / 32) + i / 32,
                       HasOffset, n);
    for (int r = 0; r < kTileRows; ++r) {
      const typename D::W wv =
          D::load_w(w.q.data() + r * k + i, w.scale.data() + r * (k / 16) + i / 16, w.offset.data() + r * (k / 32) + i / 32, n);
      for (int c = 0; c < C; ++c) D::template accumulate<HasOffset>(acc[r][c], wv, x[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    float* out = t.out + (c0 + c) * t.out_stride + row0;
    for (int r = 0; r < rows; ++r) out[r] = D::reduce(acc[r][c]) + (t.bias != nullptr ? t.bias[row0 + r] : 0.f);
  }
}

template <class D, bool HasOffset>
void apply_tile(const Staged& w, const QMatmulArgs& a, const QMatmulTarget& t, int64_t row0, int rows) {
  int64_t c0 = 0;
  for (; c0 + kTileCols <= a.m; c0 += kTileCols) tile<D, kTileCols, HasOffset>(w, a, t, row0, rows, c0);
  if (c0 < a.m) tile<D, 1, HasOffset>(w, a, t, row0, rows, c0);
}

template <class D>
void run(const QMatmulArgs& a) {
  // Tiles of every target, back to back: target j owns tiles [first[j], first[j + 1]).
  int64_t first[kMaxQMatmulTargets + 1] = {0};
  bool has_offset[kMaxQMatmulTargets] = {};
  for (int j = 0; j < a.num_targets; ++j) {
    first[j + 1] = first[j] + (a.targets[j].w.rows + kTileRows - 1) / kTileRows;
    has_offset[j] = qformat_info(static_cast<int>(a.targets[j].w.format)).has_offset;
  }
  const int64_t tiles = first[a.num_targets];
  const int64_t threads = std::min<int64_t>(get_num_threads(), tiles);
  const int64_t per = (tiles + threads - 1) / threads;
  parallel_for(threads, 1, [&](int64_t tb, int64_t te) {
    Staged staged;
    staged.resize(a.k);
    for (int64_t th = tb; th < te; ++th) {
      for (int64_t ti = th * per; ti < std::min(tiles, (th + 1) * per); ++ti) {
        int j = 0;
        while (ti >= first[j + 1]) ++j;
        const QMatmulTarget& t = a.targets[j];
        const int64_t row0 = (ti - first[j]) * kTileRows;
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, t.w.rows - row0));
        stage_rows({t.w, row0, rows, staged.q.data(), staged.scale.data(), staged.offset.data()});
        if (rows < kTileRows) {  // the missing rows contribute zeros that are never stored
          std::fill(staged.q.begin() + rows * a.k, staged.q.end(), 0);
          std::fill(staged.scale.begin() + rows * a.k / 16, staged.scale.end(), 0.f);
          std::fill(staged.offset.begin() + rows * a.k / 32, staged.offset.end(), 0.f);
        }
        if (has_offset[j]) apply_tile<D, true>(staged, a, t, row0, rows);
        else apply_tile<D, false>(staged, a, t, row0, rows);
      }
    }
  });
}

}  // namespace

void quantize_activations(const QuantizeActivationsArgs& a) {
  const int64_t blocks = a.k / 32;
  parallel_for(a.m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        a.d[r * blocks + b] =
            quantize_block32(a.x + r * a.x_stride + 32 * b, a.q + r * 2 * a.k + 32 * b, a.q + r * 2 * a.k + a.k + 32 * b);
  });
}

void qmatmul(const QMatmulArgs& a) {
#if defined(MINDIE_ISA_AVX512) && defined(MINDIE_VNNI)
  if (cpu_has_avx512_vnni()) return run<Int8Dot<true>>(a);
#endif
  run<Int8Dot<false>>(a);
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
