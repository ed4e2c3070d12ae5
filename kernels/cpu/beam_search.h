// One step of beam search for G groups (requests) of W beams, with the semantics of Hugging Face
// transformers' BeamSearchScorer.process and BeamHypotheses.add / is_done.
//
// For each group not yet done: the candidate scores are s[w, t] = logprobs[g*W + w, t] +
// beam_scores[g*W + w] (float32); the top K = max(2, 1 + num_eos) * W of the W*V candidates are
// selected (ties: lower w * V + t first; a partial selection, never a sort of W*V). Walking them in
// rank order: a candidate whose token is an EOS id is offered to the group's finished hypotheses
// only if its rank is < W, with score s / cur_len ** length_penalty (float64); the others fill the
// W next beams (parent row, token, s) until W are filled. Then the group is done if it already was
// or if BeamHypotheses.is_done(best s of the step, cur_len) holds. A group done on entry gets
// padding: token = pad_token, parent = g * W, score 0, and offers nothing.
//
// The finished hypotheses of a group are W slots (scores, insertion order, count) kept by the
// caller and updated here exactly like BeamHypotheses.add: a hypothesis enters when fewer than W
// are kept or when its score is > the worst kept score; the evicted one is the lowest score, the
// oldest among equals (the order HF's list keeps). The caller stores the token sequence of every
// accepted candidate in the slot it was given.
#pragma once

#include <cstdint>

namespace mindie::kernels::cpu {

enum class EarlyStopping : int { kFalse = 0, kTrue = 1, kNever = 2 };

// All arrays are validated by the host (shapes, eos ids in [0, vocab), vocab >= max(2, 1 + num_eos)).
struct BeamSearchArgs {
  const float* logprobs;        // [G * W, vocab_size], row stride below (already log_softmax'ed)
  int64_t logprobs_row_stride;  // elements
  const float* beam_scores;     // [G * W] cumulative log-probabilities of the current beams
  int64_t num_groups;           // G
  int64_t beam_width;           // W
  int64_t vocab_size;           // V
  const int64_t* eos_ids;       // [num_eos]
  int64_t num_eos;
  int64_t pad_token;
  int64_t cur_len;              // generated length including the token chosen now (>= 1)
  int64_t max_len;              // generated-length limit (early_stopping = never, length_penalty > 0)
  double length_penalty;
  EarlyStopping early_stopping;

  // Finished-hypotheses state, read and updated in place.
  double* hyp_scores;   // [G, W] normalised scores of the kept hypotheses (slots < num_hyps)
  int64_t* hyp_order;   // [G, W] insertion order of each slot (larger = newer)
  int64_t* num_hyps;    // [G] in [0, W]
  double* worst_score;  // [G] HF's worst_score (1e9 while empty)
  int32_t* done;        // [G] 0 / 1

  // Outputs, [G, W] each.
  int64_t* next_parents;  // global row index of the parent beam
  int64_t* next_tokens;
  float* next_scores;     // cumulative log-probability of the new beam
  int64_t* fin_parents;   // finished candidates of this step in rank order; -1 past fin_count
  int64_t* fin_tokens;
  float* fin_logprobs;    // cumulative log-probability (unnormalised)
  double* fin_scores;     // s / cur_len ** length_penalty
  int64_t* fin_slots;     // slot it was stored in, -1 if add() rejected it
  int64_t* fin_count;     // [G]
};

void beam_search_step(const BeamSearchArgs& args);

#define MINDIE_BEAM_SEARCH_KERNELS(X) X(beam_search_step, BeamSearchArgs)

}  // namespace mindie::kernels::cpu
