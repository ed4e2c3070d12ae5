// Integer matmul over block-quantized weights (see quant.h). Work is split over the threads as
// contiguous ranges of 4-row weight tiles. With many activation rows each tile is staged once into L1
// and applied to every activation row, Int8Dot::kTileCols at a time; with few (decode), staging would
// cost more than the dot products, so formats that Int8Dot decodes in registers are read straight
// from their blocks. Both give the same weight registers, and the result of an output element depends
// only on its weight row and activation row: the path, tile shape and thread split decide where it is
// computed, never how.
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
// Up to this many activation rows, decoding the blocks once per 2 rows beats staging them once.
constexpr int64_t kDecodeMaxRows = 4;
constexpr int64_t kPrefetchTiles = 2;

struct Staged {
  std::vector<int8_t> q;
  std::vector<float> scale, offset;
  void resize(int64_t k) {
    q.resize(kTileRows * k);
    scale.resize(kTileRows * k / 16);
    offset.resize(kTileRows * k / 16);
  }
};

// Weight registers of a tile's row r for the step at value i, from the staged tile...
template <class D, bool Signed>
struct StagedRows {
  const Staged& w;
  int64_t k;
  typename D::W load(int r, int64_t i, int n) const {
    return D::template load_w<Signed>(w.q.data() + r * k + i, w.scale.data() + r * (k / 16) + i / 16,
                                      w.offset.data() + r * (k / 16) + i / 16, n);
  }
};

// ...or decoded from the matrix's own blocks.
template <class D, QFormat F>
struct RawRows {
  static constexpr int64_t kBlockBytes = qformat_info(static_cast<int>(F)).block_bytes;  // 32 values
  const QMatrix& w;
  int64_t row0;
  typename D::W load(int r, int64_t i, int n) const {
    const uint8_t* row = w.data + (row0 + r) * w.row_bytes;
    // The same bytes kPrefetchTiles tiles on: four rows read side by side are four streams that the
    // hardware prefetcher picks up late, at every matrix start and again and again in small ones.
    __builtin_prefetch(row + kPrefetchTiles * kTileRows * w.row_bytes + (i / 32) * kBlockBytes);
    return D::template decode_w<F>(row, i, n);
  }
};

// Output rows [row0, row0 + rows) of target t for activation rows [c0, c0 + C).
template <class D, int C, bool Signed, class Rows>
void tile(const Rows& w, const QMatmulArgs& a, const QMatmulTarget& t, int64_t row0, int rows, int64_t c0) {
  const int64_t k = a.k;
  typename D::Acc acc[kTileRows][C];
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = D::zero();
  for (int64_t i = 0; i < k; i += D::kValues) {
    const int n = static_cast<int>(std::min<int64_t>(D::kValues, k - i));
    typename D::X x[C];
    for (int c = 0; c < C; ++c)
      x[c] = D::load_x(a.xq + (c0 + c) * 2 * k + i, a.xq + (c0 + c) * 2 * k + k + i, a.xd + (c0 + c) * (k / 32) + i / 32,
                       !Signed, n);
    for (int r = 0; r < kTileRows; ++r) {
      if (r >= rows) break;  // the matrix's last tile
      const typename D::W wv = w.load(r, i, n);
      for (int c = 0; c < C; ++c) D::template accumulate<Signed>(acc[r][c], wv, x[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    float* out = t.out + (c0 + c) * t.out_stride + row0;
    for (int r = 0; r < rows; ++r) out[r] = D::reduce(acc[r][c]) + (t.bias != nullptr ? t.bias[row0 + r] : 0.f);
  }
}

template <class D, bool Signed, class Rows>
void apply_tile(const Rows& w, const QMatmulArgs& a, const QMatmulTarget& t, int64_t row0, int rows) {
  int64_t c0 = 0;
  for (; c0 + D::kTileCols <= a.m; c0 += D::kTileCols) tile<D, D::kTileCols, Signed>(w, a, t, row0, rows, c0);
  for (; c0 < a.m; ++c0) tile<D, 1, Signed>(w, a, t, row0, rows, c0);
}

template <class D>
void apply_raw_tile(const QMatmulArgs& a, const QMatmulTarget& t, int64_t row0, int rows) {
  if constexpr (D::decodes(QFormat::kQ4_0)) {
    switch (t.w.format) {
      case QFormat::kQ4_0: return apply_tile<D, false>(RawRows<D, QFormat::kQ4_0>{t.w, row0}, a, t, row0, rows);
      case QFormat::kQ4_1: return apply_tile<D, false>(RawRows<D, QFormat::kQ4_1>{t.w, row0}, a, t, row0, rows);
      case QFormat::kQ8_0: return apply_tile<D, true>(RawRows<D, QFormat::kQ8_0>{t.w, row0}, a, t, row0, rows);
      default: break;
    }
  }
}

template <class D>
void run(const QMatmulArgs& a) {
  // Tiles of every target, back to back: target j owns tiles [first[j], first[j + 1]).
  int64_t first[kMaxQMatmulTargets + 1] = {0};
  bool signed_q[kMaxQMatmulTargets] = {}, raw[kMaxQMatmulTargets] = {};
  for (int j = 0; j < a.num_targets; ++j) {
    first[j + 1] = first[j] + (a.targets[j].w.rows + kTileRows - 1) / kTileRows;
    signed_q[j] = qformat_info(static_cast<int>(a.targets[j].w.format)).signed_q;
    raw[j] = a.m <= kDecodeMaxRows && D::decodes(a.targets[j].w.format);
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
        if (raw[j]) {
          apply_raw_tile<D>(a, t, row0, rows);
          continue;
        }
        stage_rows({t.w, row0, rows, staged.q.data(), staged.scale.data(), staged.offset.data()});
        if (signed_q[j]) apply_tile<D, true>(StagedRows<D, true>{staged, a.k}, a, t, row0, rows);
        else apply_tile<D, false>(StagedRows<D, false>{staged, a.k}, a, t, row0, rows);
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
