// What the phases of paged attention share (internal to its per-ISA sources): the work unit, the online
// softmax, the arguments typed for one (query, cache) dtype pair, and each phase's entry points.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/paged_attention.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

// One unit of parallel work. Decode: every head of one sequence over a range of its keys, so each
// cache block is read as one contiguous stream. Prefill: one kv head of one sequence over a tile
// of its queries. `part` >= 0 marks a decode split whose partial result goes to the workspace.
struct WorkItem {
  int32_t seq;
  int32_t kv_head;      // prefill: the item's kv head; decode: its first kv head
  int32_t kv_head_end;  // decode: one past its last kv head
  int32_t begin;  // decode: first key position; prefill: first query index within the sequence
  int32_t end;
  int64_t part;   // decode split slot in the workspace, or -1
};

// A decode context split over num_parts consecutive workspace slots from first_part.
struct Merge {
  int32_t seq;
  int64_t first_part;
  int32_t num_parts;
};

// Running softmax state of `rows` query rows: max m, sum l and unnormalised output acc[rows][D].
struct OnlineSoftmax {
  float* m;
  float* l;
  float* acc;
  int head_dim;
  float softcap = 0.f;  // PagedAttentionArgs::softcap

  void init(int rows) {
    std::fill(m, m + rows, -INFINITY);
    std::fill(l, l + rows, 0.f);
    std::fill(acc, acc + static_cast<int64_t>(rows) * head_dim, 0.f);
  }
  // Turns scores s[0..n) of row r into probabilities relative to the new running max and rescales
  // the row's accumulator. Returns false when every score is masked (-inf): nothing to add.
  bool update(int r, float* s, int n) {
    const float m_old = m[r];
    if (!update_scores(r, s, n)) return false;
    if (m_old != m[r]) {
      float* a = acc + static_cast<int64_t>(r) * head_dim;
      load_scaled(a, a, m_old == -INFINITY ? 0.f : std::exp(m_old - m[r]), head_dim);
    }
    return true;
  }
  // The same without touching acc, for callers that keep the accumulator elsewhere.
  bool update_scores(int r, float* s, int n) {
    if (softcap > 0.f)  // masked scores stay -inf
      for (int i = 0; i < n; ++i)
        if (s[i] != -INFINITY) s[i] = softcap * std::tanh(s[i] / softcap);
    const float bm = row_max(s, n);
    if (bm == -INFINITY) return false;
    const float m_new = std::max(m[r], bm);
    const float alpha = m[r] == -INFINITY ? 0.f : std::exp(m[r] - m_new);
    l[r] = l[r] * alpha + exp_sub_sum(s, m_new, n);
    m[r] = m_new;
    return true;
  }
};

struct Scratch {
  std::vector<float> buf;
  float* get(size_t n) {
    if (buf.size() < n) buf.resize(n);
    return buf.data();
  }
};

// The arguments typed for one (query, cache) dtype pair; the work builder and each phase derive from it.
template <typename Q, typename KV>
class AttentionView {
 public:
  explicit AttentionView(const PagedAttentionArgs& a)
      : a_(a),
        q_(static_cast<const Q*>(a.query)),
        kc_(static_cast<const KV*>(a.key_cache)),
        vc_(static_cast<const KV*>(a.value_cache)),
        out_(static_cast<Q*>(a.out)),
        group_(a.num_heads / a.kv_heads),
        D_(a.head_dim),
        row_(static_cast<int64_t>(a.kv_heads) * a.head_dim) {}

  int head_dim() const { return D_; }
  int window() const { return a_.window; }

 protected:
  int query_len(int64_t s) const { return a_.query_start_loc[s + 1] - a_.query_start_loc[s]; }

  const KV* key_row(int64_t s, int pos, int kv_head) const {
    const int64_t block = a_.block_tables[s * a_.block_table_stride + pos / a_.block_size];
    return kc_ + (block * a_.block_size + pos % a_.block_size) * row_ + static_cast<int64_t>(kv_head) * D_;
  }
  const KV* value_row(int64_t s, int pos, int kv_head) const {
    const int64_t block = a_.block_tables[s * a_.block_table_stride + pos / a_.block_size];
    return vc_ + (block * a_.block_size + pos % a_.block_size) * row_ + static_cast<int64_t>(kv_head) * D_;
  }

  void store_output(int64_t token, int head, const float* acc, float inv_l) const {
    store_scaled(out_ + token * a_.out_token_stride + static_cast<int64_t>(head) * D_, acc, inv_l, D_);
  }

  const PagedAttentionArgs& a_;
  const Q* q_;
  const KV* kc_;
  const KV* vc_;
  Q* out_;
  const int group_;
  const int D_;
  const int64_t row_;
};

// The phases, each defined in its own source and instantiated there for the four dtype pairs that
// paged_attention() dispatches to.
// Decode (attention_decode.cpp). A split (w.part >= 0) leaves, per head, its running max, sum and
// unnormalised output in workspace slot w.part (num_heads * (head_dim + 2) floats a slot) for merge_splits.
template <typename Q, typename KV>
void decode_range(const AttentionView<Q, KV>& view, const WorkItem& w, float* workspace);
template <typename Q, typename KV>
void merge_splits(const AttentionView<Q, KV>& view, const Merge& mg, int head, const float* workspace);
// Prefill (attention_prefill.cpp; on AMX tiles, for a bf16 cache where prefill_on_amx says so,
// attention_prefill_amx.cpp).
template <typename Q, typename KV>
void prefill_tile(const AttentionView<Q, KV>& view, const WorkItem& w);
#if defined(MINDIE_AMX)
bool prefill_on_amx(int head_dim);
template <typename Q>
void prefill_tile_amx(const AttentionView<Q, bf16_t>& view, const WorkItem& w);
#endif

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
