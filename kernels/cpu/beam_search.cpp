#include "cpu/beam_search.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/parallel.h"
#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {
namespace {

struct Cand {
  float s;       // cumulative log-probability, never NaN (a NaN reads as -inf)
  int64_t flat;  // w * V + t within the group
};
// Strict total order: higher score first, then the lower flat index (torch.topk-like, deterministic).
inline bool better(const Cand& a, const Cand& b) { return a.s > b.s || (a.s == b.s && a.flat < b.flat); }

// Max of x[i .. i + 4W); a NaN lane never wins (the second operand of VecF::max wins on NaN).
inline float chunk_max(const float* x) {
  constexpr int W = VecF::W;
  VecF m = VecF::set1(-INFINITY);
  for (int j = 0; j < 4; ++j) m = VecF::max(VecF::load(x + j * W), m);
  return m.reduce_max();
}

// The k best (lp[t] + bs, t) of one row into out[0..k), unordered. Bounded heap behind a SIMD
// threshold test: a chunk whose max + bs cannot beat the worst kept is skipped (float addition is
// monotone, so max(lp) + bs == max(lp + bs)).
void row_top_k(const float* lp, int64_t V, float bs, int64_t base, int k, Cand* out) {
  constexpr int C = 4 * VecF::W;
  auto val = [&](int64_t t) {
    const float s = lp[t] + bs;
    return s != s ? -INFINITY : s;
  };
  for (int j = 0; j < k; ++j) out[j] = {val(j), base + j};
  Cand* end = out + k;
  std::make_heap(out, end, better);  // front = worst
  float thr = out[0].s;
  auto offer = [&](int64_t t) {
    const float s = val(t);
    if (s > thr) {  // equal scores come later in index order: worse
      std::pop_heap(out, end, better);
      end[-1] = {s, base + t};
      std::push_heap(out, end, better);
      thr = out[0].s;
    }
  };
  int64_t t = k;
  for (; t < V && (t % C) != 0; ++t) offer(t);
  for (; t + C <= V; t += C) {
    if (!(chunk_max(lp + t) + bs > thr)) continue;
    for (int64_t j = t; j < t + C; ++j) offer(j);
  }
  for (; t < V; ++t) offer(t);
}

// BeamHypotheses.add on the slot representation; returns the slot or -1.
int64_t add_hypothesis(const BeamSearchArgs& a, int64_t g, double score) {
  const int64_t W = a.beam_width;
  double* sc = a.hyp_scores + g * W;
  int64_t* order = a.hyp_order + g * W;
  int64_t& n = a.num_hyps[g];
  double& worst = a.worst_score[g];
  if (!(n < W || score > worst)) return -1;
  int64_t next_order = 0;
  for (int64_t j = 0; j < n; ++j) next_order = std::max(next_order, order[j] + 1);
  if (n < W) {
    const int64_t slot = n++;
    sc[slot] = score;
    order[slot] = next_order;
    worst = std::min(score, worst);
    return slot;
  }
  // Full: the new one replaces the lowest score (the oldest among equals); worst = new minimum.
  int64_t victim = 0;
  for (int64_t j = 1; j < W; ++j)
    if (sc[j] < sc[victim] || (sc[j] == sc[victim] && order[j] < order[victim])) victim = j;
  sc[victim] = score;
  order[victim] = next_order;
  worst = sc[0];
  for (int64_t j = 1; j < W; ++j) worst = std::min(worst, sc[j]);
  return victim;
}

bool is_done(const BeamSearchArgs& a, int64_t g, double best_sum_logprobs) {
  if (a.num_hyps[g] < a.beam_width) return false;
  if (a.early_stopping == EarlyStopping::kTrue) return true;
  double len = static_cast<double>(a.cur_len);
  if (a.early_stopping == EarlyStopping::kNever && a.length_penalty > 0.0)
    len = static_cast<double>(a.max_len);
  const double highest_attainable = best_sum_logprobs / std::pow(len, a.length_penalty);
  return a.worst_score[g] >= highest_attainable;
}

}  // namespace

void beam_search_step(const BeamSearchArgs& a) {
  const int64_t G = a.num_groups, W = a.beam_width, V = a.vocab_size;
  const int64_t K = std::max<int64_t>(2, 1 + a.num_eos) * W;  // candidates per group
  const int64_t Kr = std::min(K, V);                            // per row
  std::vector<Cand> cand(static_cast<size_t>(G * W * Kr));

  // Every candidate of a group's top K is in its own row's top K: select per row, in parallel.
  parallel_for(G * W, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (a.done[r / W]) continue;
      row_top_k(a.logprobs + r * a.logprobs_row_stride, V, a.beam_scores[r], (r % W) * V,
                static_cast<int>(Kr), cand.data() + r * Kr);
    }
  });

  parallel_for(G, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      int64_t* np = a.next_parents + g * W;
      int64_t* nt = a.next_tokens + g * W;
      float* ns = a.next_scores + g * W;
      int64_t* fp = a.fin_parents + g * W;
      int64_t* ft = a.fin_tokens + g * W;
      float* fl = a.fin_logprobs + g * W;
      double* fs = a.fin_scores + g * W;
      int64_t* fslot = a.fin_slots + g * W;
      for (int64_t j = 0; j < W; ++j) {
        fp[j] = -1;
        ft[j] = -1;
        fl[j] = 0.f;
        fs[j] = 0.0;
        fslot[j] = -1;
      }
      a.fin_count[g] = 0;
      if (a.done[g]) {
        for (int64_t j = 0; j < W; ++j) {
          np[j] = g * W;
          nt[j] = a.pad_token;
          ns[j] = 0.f;
        }
        continue;
      }
      Cand* c = cand.data() + g * W * Kr;
      const int64_t n = W * Kr;
      const int64_t k = std::min(K, n);
      std::partial_sort(c, c + k, c + n, better);

      int64_t beam = 0, nfin = 0;
      const double denom = std::pow(static_cast<double>(a.cur_len), a.length_penalty);
      for (int64_t rank = 0; rank < k && beam < W; ++rank) {
        const int64_t w = c[rank].flat / V, t = c[rank].flat % V;
        const int64_t parent = g * W + w;
        bool eos = false;
        for (int64_t e = 0; e < a.num_eos; ++e) eos = eos || a.eos_ids[e] == t;
        if (eos) {
          if (rank >= W) continue;  // only EOS among the top W beams finish
          const double score = static_cast<double>(c[rank].s) / denom;
          fp[nfin] = parent;
          ft[nfin] = t;
          fl[nfin] = c[rank].s;
          fs[nfin] = score;
          fslot[nfin] = add_hypothesis(a, g, score);
          ++nfin;
        } else {
          np[beam] = parent;
          nt[beam] = t;
          ns[beam] = c[rank].s;
          ++beam;
        }
      }
      // The host guarantees >= W non-EOS candidates; keep the output defined regardless.
      for (; beam < W; ++beam) {
        np[beam] = g * W;
        nt[beam] = a.pad_token;
        ns[beam] = -INFINITY;
      }
      a.fin_count[g] = nfin;
      if (!a.done[g] && is_done(a, g, static_cast<double>(c[0].s))) a.done[g] = 1;
    }
  });
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
