// The prefill phase of paged attention on AMX tiles (vec_amx.h's AmxAttention), for a bfloat16 cache
// where the CPU has AMX-BF16: a tile of one sequence's queries, for one kv head, over every key they
// see, 128 key positions at a time. Scores and the probability-weighted values are tile products;
// the float32 queries and probabilities go in as bf16 hi and lo planes, so both products keep float32
// attention's precision (the cache's bf16 keys and values are exact), and the online softmax is the
// float path's. Key steps start at multiples of kKeyStep whatever the block size, and every product
// of a query row is that row's alone, so a row's result does not depend on the rows tiled with it or
// on where its prompt was cut into chunks.
#include <algorithm>
#include <cstdint>

#include "cpu/attention_common.h"
#include "cpu/dispatch.h"
#include "cpu/vec.h"
#include "cpu/vec_amx.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

#if defined(MINDIE_AMX)
namespace {

constexpr int kKeyStep = 128;            // key positions per softmax update
constexpr int kKeyChunk = 32;            // keys per value tile product (16 pairs)
constexpr int kTileRows = 16;
constexpr int64_t kTileValues = 16 * 32;  // bf16 values in one tile

template <typename Q>
class PrefillAmx : AttentionView<Q, bf16_t> {
  using Base = AttentionView<Q, bf16_t>;
  using Base::a_, Base::q_, Base::group_, Base::D_, Base::query_len, Base::key_row, Base::value_row,
      Base::store_output;

 public:
  explicit PrefillAmx(const Base& view) : Base(view) {}

  void prefill(const WorkItem& w) const {
    const AmxBf16Panel::Session session;
    const int G = group_, D = D_;
    const int rows = (w.end - w.begin) * G;
    const int rows16 = (rows + kTileRows - 1) / kTileRows * kTileRows;
    thread_local ScratchVector<float> floats;
    thread_local ScratchVector<bf16_t> halves;
    float* acc = sized(floats, static_cast<int64_t>(rows) * (D + 2) + kTileRows * (kKeyStep + D) + G * D);
    float* ml = acc + static_cast<int64_t>(rows) * D;
    float* s = ml + 2 * rows;         // [16][kKeyStep] scores, then probabilities
    float* o = s + kTileRows * kKeyStep;  // [16][D] one step's weighted values
    float* qf = o + kTileRows * D;    // [G][D] one token's scaled queries
    const int64_t key_tiles = (kKeyStep / 16) * (D / 32) * kTileValues;
    const int64_t value_tiles = (kKeyStep / kKeyChunk) * (D / 16) * kTileValues;
    bf16_t* qhi = sized(halves, 2 * static_cast<int64_t>(rows16) * D + 2 * kTileRows * kKeyStep + key_tiles + value_tiles);
    bf16_t* qlo = qhi + static_cast<int64_t>(rows16) * D;
    bf16_t* phi = qlo + static_cast<int64_t>(rows16) * D;
    bf16_t* plo = phi + kTileRows * kKeyStep;
    bf16_t* kt = plo + kTileRows * kKeyStep;
    bf16_t* vt = kt + key_tiles;
    OnlineSoftmax sm{ml, ml + rows, acc, D, a_.softcap};
    sm.init(rows);

    const int first_pos = a_.seq_lens[w.seq] - query_len(w.seq);  // position of query 0
    const int64_t token0 = a_.query_start_loc[w.seq] + w.begin;
    for (int i = w.begin; i < w.end; ++i) load_queries(qf, token0 + i - w.begin, w.kv_head, qhi, qlo, (i - w.begin) * G * D);
    std::fill(qhi + static_cast<int64_t>(rows) * D, qhi + static_cast<int64_t>(rows16) * D, bf16_t{});
    std::fill(qlo + static_cast<int64_t>(rows) * D, qlo + static_cast<int64_t>(rows16) * D, bf16_t{});

    // The keys row r sees: positions up to its query's.
    const auto last_key = [&](int r) { return first_pos + w.begin + r / G; };
    const int last_pos = last_key(rows - 1);
    for (int k0 = 0; k0 <= last_pos; k0 += kKeyStep) {
      const int n = std::min(kKeyStep, last_pos + 1 - k0);
      pack_step(w, k0, n, kt, vt);
      // Rows before the first that sees key k0 see none of this step.
      const int first_row = std::max(0, (k0 - first_pos - w.begin) * G);
      for (int r0 = first_row / kTileRows * kTileRows; r0 < rows; r0 += kTileRows) {
        const int r_end = std::min(rows, r0 + kTileRows);
        const int seen = std::min(n, last_key(r_end - 1) - k0 + 1);  // keys the block's last row sees
        const int chunks = (seen + kKeyChunk - 1) / kKeyChunk;
        const int width = chunks * kKeyChunk;
        for (int c = 0; c < chunks; ++c) {
          const bf16_t* kt0 = kt + 2 * c * (D / 32) * kTileValues;
          AmxAttention::scores(qhi + r0 * D, qlo + r0 * D, D, kt0, kt0 + (D / 32) * kTileValues, s + kKeyChunk * c,
                               kKeyStep);
        }
        for (int r = r0; r < r0 + kTileRows; ++r) {
          float* p = s + (r - r0) * kKeyStep;
          const int valid = r < r_end ? std::min(n, last_key(r) - k0 + 1) : 0;
          if (valid > 0) sm.update(r, p, valid);  // scores to probabilities, the row's acc rescaled
          std::fill(p + std::max(valid, 0), p + width, 0.f);
          AmxAttention::split_bf16(p, width, phi + (r - r0) * kKeyStep, plo + (r - r0) * kKeyStep);
        }
        AmxAttention::values(phi, plo, kKeyStep, vt, chunks, D, o);
        for (int r = r0; r < r_end; ++r)
          if (last_key(r) >= k0) add(acc + static_cast<int64_t>(r) * D, o + (r - r0) * D, D);
      }
    }
    for (int r = 0; r < rows; ++r)
      store_output(token0 + r / G, w.kv_head * G + r % G, acc + static_cast<int64_t>(r) * D,
                   sm.l[r] > 0.f ? 1.f / sm.l[r] : 0.f);
  }

 private:
  // One token's G query rows, scaled, as bf16 hi and lo planes at row offset `at`.
  void load_queries(float* qf, int64_t token, int kv_head, bf16_t* hi, bf16_t* lo, int64_t at) const {
    const Q* q = q_ + token * a_.q_token_stride + static_cast<int64_t>(kv_head) * group_ * D_;
    load_scaled(qf, q, a_.scale, group_ * D_);
    AmxAttention::split_bf16(qf, group_ * D_, hi + at, lo + at);
  }

  // Keys and values of positions [k0, k0 + n) of the work's sequence and kv head as B tiles.
  void pack_step(const WorkItem& w, int k0, int n, bf16_t* kt, bf16_t* vt) const {
    const bf16_t* rows[kKeyChunk];
    for (int c = 0; c * kKeyChunk < n; ++c) {
      for (int j = 0; j < kKeyChunk; ++j) {
        const int pos = k0 + c * kKeyChunk + j;
        rows[j] = pos < k0 + n ? key_row(w.seq, pos, w.kv_head) : nullptr;
      }
      AmxAttention::pack_keys(rows, D_, kt + 2 * c * (D_ / 32) * kTileValues);
      AmxAttention::pack_keys(rows + 16, D_, kt + (2 * c + 1) * (D_ / 32) * kTileValues);
      for (int j = 0; j < kKeyChunk; ++j) rows[j] = rows[j] != nullptr ? value_row(w.seq, k0 + c * kKeyChunk + j, w.kv_head) : nullptr;
      AmxAttention::pack_values(rows, D_, vt + c * (D_ / 16) * kTileValues);
    }
  }

  static void add(float* acc, const float* x, int n) {
    constexpr int W = VecF::W;
    int i = 0;
    for (; i + W <= n; i += W) (VecF::load(acc + i) + VecF::load(x + i)).store(acc + i);
    for (; i < n; ++i) acc[i] += x[i];
  }
};

}  // namespace

bool prefill_on_amx(int head_dim) { return head_dim % 32 == 0 && use_amx_bf16(); }

template <typename Q>
void prefill_tile_amx(const AttentionView<Q, bf16_t>& view, const WorkItem& w) {
  PrefillAmx<Q>(view).prefill(w);
}

template void prefill_tile_amx(const AttentionView<float, bf16_t>&, const WorkItem&);
template void prefill_tile_amx(const AttentionView<bf16_t, bf16_t>&, const WorkItem&);
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
