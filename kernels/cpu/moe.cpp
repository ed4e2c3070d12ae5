#include "cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/vec.h"

namespace mindie::kernels::cpu {
namespace MINDIE_ISA_NS {

void moe_route(const MoeRouteArgs& a) {
  std::vector<float> probs(a.num_experts);
  std::vector<char> taken(a.num_experts);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const float* logits = a.logits + t * a.logits_stride;
    const float top = *std::max_element(logits, logits + a.num_experts);
    float sum = 0.f;
    for (int e = 0; e < a.num_experts; ++e) sum += probs[e] = std::exp(logits[e] - top);
    for (int e = 0; e < a.num_experts; ++e) probs[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    float* w = a.weights + t * a.k;
    int32_t* ids = a.experts + t * a.k;
    float picked = 0.f;
    // k passes of a selection: k and the expert count are small (8 of 128 at most in practice)
    for (int j = 0; j < a.k; ++j) {
      int best = -1;
      for (int e = 0; e < a.num_experts; ++e)
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      ids[j] = best;
      w[j] = probs[best];
      picked += probs[best];
    }
    if (a.normalize)
      for (int j = 0; j < a.k; ++j) w[j] /= picked;
  }
}

void moe_combine(const MoeCombineArgs& a) {
  constexpr int W = VecF::W;
  std::vector<int> order(a.k);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const int32_t* ids = a.experts + t * a.k;
    for (int j = 0; j < a.k; ++j) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int x, int y) { return ids[x] < ids[y]; });
    float* out = a.out + t * a.out_stride;
    int64_t i = 0;
    for (; i + W <= a.hidden; i += W) {
      VecF acc = VecF::zero();
      for (int j : order)
        acc = acc + VecF::set1(a.weights[t * a.k + j]) * VecF::load(a.y + (t * a.k + j) * a.hidden + i);
      acc.store(out + i);
    }
    for (; i < a.hidden; ++i) {
      float acc = 0.f;
      for (int j : order) acc += a.weights[t * a.k + j] * a.y[(t * a.k + j) * a.hidden + i];
      out[i] = acc;
    }
  }
}

}  // namespace MINDIE_ISA_NS
}  // namespace mindie::kernels::cpu
