// Mixture-of-experts pieces of a decoder layer (Qwen3-MoE, Mixtral): top-k routing of each row over
// its router logits, and the weighted sum of the routed experts' outputs back into one row. The
// expert projections themselves are the ordinary matmuls (quant.h / linear.h), run on the rows
// routed to each expert.
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

// Per row: softmax over its router logits in float32, the k largest probabilities (largest first,
// a tie to the lower expert id), renormalised to sum to 1 when `normalize` is set, as transformers'
// Qwen3MoeTopKRouter / MixtralTopKRouter compute them.
struct MoeRouteArgs {
  const float* logits;  // [tokens, num_experts], row stride logits_stride
  int64_t tokens;
  int num_experts, k;
  int64_t logits_stride;
  bool normalize;
  float* weights;    // [tokens, k]
  int32_t* experts;  // [tokens, k]
};

// out[t] = sum over j of weights[t, j] * y[t * k + j], the k terms added in ascending expert id
// (transformers' order: it adds expert by expert into zeros). The order depends on the row's own
// routing only, so a row's sum never depends on the rest of the batch.
struct MoeCombineArgs {
  const float* y;  // [tokens * k, hidden]: row t * k + j is expert experts[t, j]'s output for row t
  const float* weights;
  const int32_t* experts;
  int64_t tokens;
  int k;
  int64_t hidden;
  float* out;  // [tokens, hidden], row stride out_stride
  int64_t out_stride;
};

void moe_route(const MoeRouteArgs& args);
void moe_combine(const MoeCombineArgs& args);

#define MINDIE_MOE_KERNELS(X) X(moe_route, MoeRouteArgs) X(moe_combine, MoeCombineArgs)

}  // namespace mindie::kernels::cpu
