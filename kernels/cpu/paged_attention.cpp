// Paged attention's work building, parallel run and dtype dispatch; the phases themselves are in
// attention_decode.cpp and attention_prefill.cpp.
#include "cpu/paged_attention.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu/attention_common.h"
#include "cpu/parallel.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

constexpr int kQueryTile = 32;        // prefill queries per work item
constexpr int kAmxQueryTile = 128;    // the same on AMX tiles, which repack the keys and values per item
constexpr int kMinPartition = 256;    // smallest decode split worth its merge

template <typename Q, typename KV>
class Attention : AttentionView<Q, KV> {
  using Base = AttentionView<Q, KV>;
  using Base::a_, Base::D_, Base::query_len;

 public:
  explicit Attention(const PagedAttentionArgs& a) : Base(a) {}

  void run() {
    build_work();
    workspace_.assign(static_cast<size_t>(num_parts_) * a_.num_heads * (D_ + 2), 0.f);
    parallel_for(static_cast<int64_t>(work_.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const WorkItem& w = work_[i];
        if (w.part >= 0 || query_len(w.seq) == 1) decode_range<Q, KV>(*this, w, workspace_.data());
        else prefill_tile<Q, KV>(*this, w);
      }
    });
    if (!merges_.empty()) {
      parallel_for(static_cast<int64_t>(merges_.size()) * a_.num_heads, 4, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i)
          merge_splits<Q, KV>(*this, merges_[i / a_.num_heads], static_cast<int>(i % a_.num_heads),
                              workspace_.data());
      });
    }
  }

 private:
  void build_work() {
    int64_t decode_rows = 0;
    for (int64_t s = 0; s < a_.num_seqs; ++s) decode_rows += query_len(s) == 1;
    int partition = a_.partition_size;
    if (partition <= 0) {
      // Split long decode contexts only when the batch alone cannot keep every thread busy.
      const int64_t want = 4LL * get_num_threads();
      const int64_t have = decode_rows;
      int64_t longest = 0;
      for (int64_t s = 0; s < a_.num_seqs; ++s)
        if (query_len(s) == 1) longest = std::max<int64_t>(longest, a_.seq_lens[s] - first_key(s));
      partition = static_cast<int>(longest + 1);
      if (have > 0 && have < want) {
        const int64_t splits = (want + have - 1) / have;
        partition = static_cast<int>(std::max<int64_t>(kMinPartition, (longest + splits - 1) / splits));
      }
    }
    partition = std::max(partition, 1);
    for (int64_t s = 0; s < a_.num_seqs; ++s) {
      const int q_len = query_len(s);
      const int ctx = a_.seq_lens[s];
      if (q_len == 0 || ctx == 0) continue;
      if (q_len == 1) {
        const int lo = first_key(s);  // a sliding window's blocks before it are never read
        const int parts = (ctx - lo + partition - 1) / partition;
        if (parts > 1) merges_.push_back({static_cast<int32_t>(s), num_parts_, parts});
        for (int p = 0; p < parts; ++p) {
          const int64_t slot = parts > 1 ? num_parts_ + p : -1;
          work_.push_back({static_cast<int32_t>(s), 0, a_.kv_heads, lo + p * partition,
                           std::min(ctx, lo + (p + 1) * partition), slot});
        }
        if (parts > 1) num_parts_ += parts;
      } else {
        const int tile = query_tile();
        for (int i0 = 0; i0 < q_len; i0 += tile)
          for (int h = 0; h < a_.kv_heads; ++h)
            work_.push_back({static_cast<int32_t>(s), h, h + 1, i0, std::min(q_len, i0 + tile), -1});
      }
    }
    split_decode_over_heads();
    // Longest work first, so the dynamic schedule does not end on one straggler.
    std::stable_sort(work_.begin(), work_.end(), [&](const WorkItem& x, const WorkItem& y) {
      return cost(x) > cost(y);
    });
  }

  // If the items leave a thread idle (a batch of one or two short contexts), each decode item is
  // split over kv head ranges too. That is exact (a head's sums do not change), so it may depend on
  // the batch where key ranges may not; key ranges come first because each reads whole cache rows,
  // where a head range reads a slice of every row. A batch-1 step otherwise runs its attention on
  // one thread while the others wait, and fall asleep before the next projection.
  void split_decode_over_heads() {
    const int64_t threads = get_num_threads(), items = static_cast<int64_t>(work_.size());
    if (items == 0 || items >= threads) return;
    const int groups = static_cast<int>(std::min<int64_t>(a_.kv_heads, (threads + items - 1) / items));
    std::vector<WorkItem> split;
    for (const WorkItem& w : work_) {
      if (w.part < 0 && query_len(w.seq) > 1) {
        split.push_back(w);
        continue;
      }
      for (int g = 0; g < groups; ++g)
        split.push_back({w.seq, g * a_.kv_heads / groups, (g + 1) * a_.kv_heads / groups, w.begin, w.end, w.part});
    }
    work_ = std::move(split);
  }

  // The first key a decode query (the sequence's last position) sees.
  int first_key(int64_t s) const { return a_.window > 0 ? std::max(0, a_.seq_lens[s] - a_.window) : 0; }

  int query_tile() const {
#if defined(MINDIE_AMX)
    if constexpr (std::is_same_v<KV, bf16_t>)
      if (a_.window == 0 && prefill_on_amx(D_)) return kAmxQueryTile;
#endif
    return kQueryTile;
  }

  int64_t cost(const WorkItem& w) const {
    if (w.part >= 0 || query_len(w.seq) == 1) return static_cast<int64_t>(w.end - w.begin) * (w.kv_head_end - w.kv_head);
    const int64_t last_pos = a_.seq_lens[w.seq] - query_len(w.seq) + w.end;
    return (a_.window > 0 ? std::min<int64_t>(last_pos, a_.window) : last_pos) * (w.end - w.begin);
  }

  std::vector<WorkItem> work_;
  std::vector<Merge> merges_;
  int64_t num_parts_ = 0;
  std::vector<float> workspace_;
};

}  // namespace

void paged_attention(const PagedAttentionArgs& a) {
  const bool q32 = a.q_dtype == DType::kFloat32, kv32 = a.kv_dtype == DType::kFloat32;
  if (q32 && kv32) Attention<float, float>(a).run();
  else if (q32) Attention<float, bf16_t>(a).run();
  else if (kv32) Attention<bf16_t, float>(a).run();
  else Attention<bf16_t, bf16_t>(a).run();
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
