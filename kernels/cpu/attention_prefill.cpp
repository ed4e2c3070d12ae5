// The prefill phase of paged attention: a tile of one sequence's queries, for one kv head, over every
// key they see (causal mask), a cache block at a time.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/attention_common.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

// Prefill register tiles: query rows scored and accumulated together, and head-dimension vectors per
// accumulator row (4 rows x 4 vectors of scores or values fit AVX-512's registers, 2 x 4 AVX2's).
constexpr int kRowTile = VecF::W >= 16 ? 4 : 2;
constexpr int kAccVectors = 4;

template <typename Q, typename KV>
class Prefill : AttentionView<Q, KV> {
  using Base = AttentionView<Q, KV>;
  using Base::a_, Base::q_, Base::group_, Base::D_, Base::row_, Base::query_len, Base::key_row, Base::value_row,
      Base::store_output;

 public:
  explicit Prefill(const Base& view) : Base(view) {}

  // A tile of queries [w.begin, w.end) of one sequence: per key block, the block is converted once
  // to float32 (K transposed so scores vectorise over keys without horizontal sums), then every
  // query row of the tile is scored, masked causally, and accumulated.
  void prefill(const WorkItem& w) const {
    constexpr int W = VecF::W;
    thread_local Scratch scratch;
    const int G = group_, BS = a_.block_size;
    const int NP = (BS + W - 1) / W * W;  // padded keys per block
    const int rows = (w.end - w.begin) * G;
    float* qf = scratch.get(static_cast<size_t>(rows) * (2 * D_ + NP + 2) + static_cast<size_t>(D_) * NP * 2);
    float* acc = qf + rows * D_;
    float* s = acc + rows * D_;   // [rows][NP]
    float* ml = s + static_cast<int64_t>(rows) * NP;
    float* kt = ml + 2 * rows;    // [D][NP]
    float* vf = kt + static_cast<int64_t>(D_) * NP;  // [BS][D]
    OnlineSoftmax sm{ml, ml + rows, acc, D_, a_.softcap};
    sm.init(rows);
    const int q_len = query_len(w.seq);
    const int first_pos = a_.seq_lens[w.seq] - q_len;  // position of query 0
    const int64_t token0 = a_.query_start_loc[w.seq] + w.begin;
    for (int i = w.begin; i < w.end; ++i) load_queries(qf + (i - w.begin) * G * D_, token0 + i - w.begin, w.kv_head);
    const int last_pos = first_pos + w.end - 1;
    // The first key a row sees: 0, or on a sliding-window layer its position - window + 1. Blocks
    // before the tile's first row's window are skipped.
    const auto first_key = [&](int r) { return a_.window > 0 ? first_pos + w.begin + r / G - a_.window + 1 : 0; };
    for (int b0 = std::max(0, first_key(0)) / BS * BS; b0 <= last_pos; b0 += BS) {
      const int n = std::min(BS, last_pos + 1 - b0);
      transpose_block(kt, NP, key_row(w.seq, b0, w.kv_head), n);
      const KV* v = value_row(w.seq, b0, w.kv_head);
      for (int t = 0; t < n; ++t, v += row_) load_scaled(vf + t * D_, v, 1.f, D_);
      // Queries before this block's first key see none of it. Rows (query i, head g) go kRowTile at
      // a time over the keys the tile's last row sees; a row's keys past its own position score
      // -inf, which the softmax turns into probabilities of exactly 0, so every row is computed as
      // it would be alone (its result never depends on the rows tiled with it).
      const int r_end = (w.end - w.begin) * G;
      for (int r0 = (std::max(w.begin, b0 - first_pos) - w.begin) * G; r0 < r_end; r0 += kRowTile) {
        const int rt = std::min(kRowTile, r_end - r0);
        const auto valid = [&](int r) { return std::min(n, first_pos + w.begin + r / G - b0 + 1); };
        const int vmax = valid(r0 + rt - 1);
        float* sr = s + static_cast<int64_t>(r0) * NP;
        score_rows(rt, sr, qf + r0 * D_, kt, NP, vmax);
        for (int r = r0; r < r0 + rt; ++r) {
          float* row = s + static_cast<int64_t>(r) * NP;
          std::fill(row + valid(r), row + vmax, -INFINITY);
          std::fill(row, row + std::clamp(first_key(r) - b0, 0, vmax), -INFINITY);
          // A row whose window starts past this block sees none of it: probabilities 0.
          if (!sm.update(r, row, vmax)) std::fill(row, row + vmax, 0.f);
        }
        accumulate_rows(rt, acc + r0 * D_, sr, NP, vf, vmax);
      }
    }
    for (int i = w.begin; i < w.end; ++i)
      for (int g = 0; g < G; ++g) {
        const int r = (i - w.begin) * G + g;
        store_output(token0 + i - w.begin, w.kv_head * G + g, acc + r * D_, sm.l[r] > 0.f ? 1.f / sm.l[r] : 0.f);
      }
  }

 private:
  // Loads the group's query rows of token `t` as float32, pre-multiplied by the softmax scale.
  void load_queries(float* qf, int64_t token, int kv_head) const {
    const Q* q = q_ + token * a_.q_token_stride + static_cast<int64_t>(kv_head) * group_ * D_;
    load_scaled(qf, q, a_.scale, group_ * D_);
  }

  // acc[r] += sum_t p[r][t] * vf[t] for rt rows (p rows NP apart), kAccVectors of the head dimension
  // at a time held in registers: each value vector loaded serves every row.
  void accumulate_rows(int rt, float* acc, const float* p, int NP, const float* vf, int valid) const {
    constexpr int W = VecF::W;
    if (D_ % (kAccVectors * W) != 0) {
      for (int r = 0; r < rt; ++r)
        for (int t = 0; t < valid; ++t) axpy(acc + r * D_, p[r * NP + t], vf + t * D_, D_);
      return;
    }
    with_rows(rt, [&](auto rows) { accumulate_rows_fixed<decltype(rows)::value>(acc, p, NP, vf, valid); });
  }

  // f(std::integral_constant<int, rt>) for a row tile of rt = 1..4 rows.
  template <typename F>
  static void with_rows(int rt, F&& f) {
    static_assert(kRowTile <= 4, "with_rows instantiates tiles of up to 4 rows");
    switch (rt) {
      case 4: return f(std::integral_constant<int, 4>{});
      case 3: return f(std::integral_constant<int, 3>{});
      case 2: return f(std::integral_constant<int, 2>{});
      default: return f(std::integral_constant<int, 1>{});
    }
  }

  template <int RT>
  void accumulate_rows_fixed(float* acc, const float* p, int NP, const float* vf, int valid) const {
    constexpr int W = VecF::W;
    for (int j0 = 0; j0 < D_; j0 += kAccVectors * W) {
      VecF a[RT][kAccVectors];
      for (int r = 0; r < RT; ++r)
        for (int j = 0; j < kAccVectors; ++j) a[r][j] = VecF::load(acc + r * D_ + j0 + j * W);
      for (int t = 0; t < valid; ++t) {
        VecF v[kAccVectors];
        for (int j = 0; j < kAccVectors; ++j) v[j] = VecF::load(vf + t * D_ + j0 + j * W);
        for (int r = 0; r < RT; ++r) {
          const VecF pt = VecF::set1(p[r * NP + t]);
          for (int j = 0; j < kAccVectors; ++j) a[r][j] = VecF::fma(pt, v[j], a[r][j]);
        }
      }
      for (int r = 0; r < RT; ++r)
        for (int j = 0; j < kAccVectors; ++j) a[r][j].store(acc + r * D_ + j0 + j * W);
    }
  }

  // kt[d][t] = float(k[t][d]) for t < n; zero for the padding up to NP. Whole W x W squares go
  // through registers (VecF::transpose_square); element by element, the transpose was about half of
  // a prompt's attention time (Llama-3.2-3B's 24/8 heads of 128 over a 2048-token prompt on a
  // 2-core Zen 5: 163 -> 81 ms a layer). The remainders go element by element.
  void transpose_block(float* kt, int NP, const KV* k, int n) const {
    constexpr int W = VecF::W;
    const int tw = n / W * W, dw = D_ / W * W;  // keys and head dims moved as whole squares
    for (int t0 = 0; t0 < tw; t0 += W)
      for (int d0 = 0; d0 < dw; d0 += W) {
        VecF r[W];
        for (int i = 0; i < W; ++i) r[i] = VecF::load(k + static_cast<int64_t>(t0 + i) * row_ + d0);
        VecF::transpose_square(r);
        for (int j = 0; j < W; ++j) r[j].store(kt + static_cast<int64_t>(d0 + j) * NP + t0);
      }
    for (int t = 0; t < n; ++t) {
      const KV* kr = k + static_cast<int64_t>(t) * row_;
      for (int d = t < tw ? dw : 0; d < D_; ++d) kt[d * NP + t] = to_float(kr[d]);
    }
    for (int d = 0; d < D_; ++d) std::fill(kt + d * NP + n, kt + (d + 1) * NP, 0.f);
  }

  static float to_float(float x) { return x; }
  static float to_float(bf16_t x) { return bf16_to_float(x); }

  // s[r][t] = q[r] . k_t for rt rows (s rows NP apart, q rows D apart) and t < valid, rounded up to
  // whole vectors of keys, up to 4 vectors at a time: each key vector loaded serves every row.
  void score_rows(int rt, float* s, const float* q, const float* kt, int NP, int valid) const {
    with_rows(rt, [&](auto rows) { score_rows_fixed<decltype(rows)::value>(s, q, kt, NP, valid); });
  }

  template <int RT>
  void score_rows_fixed(float* s, const float* q, const float* kt, int NP, int valid) const {
    constexpr int W = VecF::W;
    const int nv = (valid + W - 1) / W;
    int c = 0;
    for (; c + 4 <= nv; c += 4) score_chunk<RT, 4>(s, q, kt, NP, c * W);
    switch (nv - c) {
      case 3: score_chunk<RT, 3>(s, q, kt, NP, c * W); break;
      case 2: score_chunk<RT, 2>(s, q, kt, NP, c * W); break;
      case 1: score_chunk<RT, 1>(s, q, kt, NP, c * W); break;
      default: break;
    }
  }

  template <int RT, int NV>
  void score_chunk(float* s, const float* q, const float* kt, int NP, int t0) const {
    constexpr int W = VecF::W;
    VecF acc[RT][NV];
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j] = VecF::zero();
    for (int d = 0; d < D_; ++d) {
      const float* row = kt + static_cast<int64_t>(d) * NP + t0;
      VecF k[NV];
      for (int j = 0; j < NV; ++j) k[j] = VecF::load(row + j * W);
      for (int r = 0; r < RT; ++r) {
        const VecF qd = VecF::set1(q[r * D_ + d]);
        for (int j = 0; j < NV; ++j) acc[r][j] = VecF::fma(qd, k[j], acc[r][j]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < NV; ++j) acc[r][j].store(s + r * NP + t0 + j * W);
  }
};

}  // namespace

template <typename Q, typename KV>
void prefill_tile(const AttentionView<Q, KV>& view, const WorkItem& w) {
#if defined(MINDIE_AMX)
  // Sliding windows take the float32 tiles: the AMX tiles mask causally only.
  if constexpr (std::is_same_v<KV, bf16_t>)
    if (view.window() == 0 && prefill_on_amx(view.head_dim())) return prefill_tile_amx<Q>(view, w);
#endif
  Prefill<Q, KV>(view).prefill(w);
}

template void prefill_tile(const AttentionView<float, float>&, const WorkItem&);
template void prefill_tile(const AttentionView<float, bf16_t>&, const WorkItem&);
template void prefill_tile(const AttentionView<bf16_t, float>&, const WorkItem&);
template void prefill_tile(const AttentionView<bf16_t, bf16_t>&, const WorkItem&);

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
