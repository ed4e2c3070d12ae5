// Batched token sampling: every row of the logits has its own parameters, applied in this order.
//
//  1. Penalties, on a float32 copy of the row (the input is never written):
//     - repetition penalty rp (Hugging Face semantics) once per distinct token of prompt + output:
//       logit > 0 -> logit / rp, otherwise logit * rp;
//     - then presence and frequency penalties (OpenAI semantics) over the output tokens only:
//       logit -= presence * (count > 0) + frequency * count    (float32, no fused multiply-add).
//  2. Temperature: temperature == 0 means greedy, the argmax of the penalised logits (ties: lowest
//     index); otherwise z = logit / temperature (a true float32 division).
//  3. Candidates are ordered by descending z, ties by ascending token id. Weights are
//     w = exp(z - max z) in float32, summed in float64.
//     top-k (0 or -1 = off, k >= V = off) keeps the first k candidates; then top-p (1.0 = off)
//     keeps the shortest prefix of those whose weight reaches top_p * (weight of the top-k set):
//     candidate r stays iff the weight of the candidates before it is < top_p * that weight.
//  4. One uniform u in [0, 1) per row from Philox4x32-10 with key = seed (low, high 32 bits) and
//     counter = (step low, step high, 0, 0); u = (x0 >> 5) * 2^-27 + (x1 >> 6) * 2^-53, 53 bits.
//     The token is the first kept candidate whose cumulative weight exceeds u * (kept weight).
//     The draw depends only on (seed, step, the row's logits and parameters): never on the batch
//     size or the row's position. Unseeded requests should pass a seed drawn once per request.
//
// Log-probabilities are those of the RAW input logits, log_softmax before penalties and temperature
// (what vLLM v1 returns by default): logprob[b] = log_softmax(logits[b])[token[b]], and the top-N
// (0 <= N <= kMaxTopLogprobs) are the N largest raw logits (descending, ties by lowest id) with
// their log_softmax values. NaN logits are read as -inf and +inf as the largest finite float; -inf
// logits are allowed (a -inf token is never drawn unless every token of the row is -inf).
//
// Cost: no full sort of the vocabulary. top-k <= kSmallTopK (and the top-N logprobs) select the k
// best with a bound from SIMD chunk maxima (the k-th largest chunk max) and a partial sort of the
// few values above it; otherwise (top-p alone, plain sampling or a larger k) a 4096-bucket
// histogram over max z - z (count and float64 weight per bucket) locates the top-k, top-p and draw
// boundaries, and only the 1 to 3 buckets holding a boundary are gathered and sorted.
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

constexpr int kMaxTopLogprobs = 20;
constexpr int kSmallTopK = 256;

// All arrays are validated by the host: shapes, ranges, every token id in [0, vocab_size).
struct SampleArgs {
  const void* logits;          // [num_rows, vocab_size] of `dtype`, row stride below
  int64_t logits_row_stride;   // elements
  int64_t num_rows;
  int64_t vocab_size;          // 1 <= vocab_size < 2^31
  DType dtype;                 // float32 or bfloat16

  const float* temperature;         // [num_rows], finite, >= 0
  const int32_t* top_k;             // [num_rows], -1, 0 or >= 1
  const float* top_p;               // [num_rows], in (0, 1]
  const float* repetition_penalty;  // [num_rows], > 0; nullptr = all 1
  const float* presence_penalty;    // [num_rows], finite; nullptr = all 0
  const float* frequency_penalty;   // [num_rows], finite; nullptr = all 0
  const int64_t* seed;              // [num_rows]
  const int64_t* step;              // [num_rows], >= 0: tokens generated so far

  // CSR token lists; offsets [num_rows + 1] start at 0 and do not decrease; nullptr = empty.
  const int64_t* prompt_tokens;
  const int64_t* prompt_offsets;
  const int64_t* output_tokens;
  const int64_t* output_offsets;

  int64_t* out_tokens;       // [num_rows]
  float* out_logprobs;       // [num_rows]
  int num_top_logprobs;      // N in [0, kMaxTopLogprobs]
  float* out_top_logprobs;   // [num_rows, N] (unused when N == 0)
  int64_t* out_top_ids;      // [num_rows, N]
};

void sample(const SampleArgs& args);

#define MINDIE_SAMPLING_KERNELS(X) X(sample, SampleArgs)

}  // namespace mindie::kernels::cpu
