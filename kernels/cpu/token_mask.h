// Grammar-constrained decoding: a packed bitmask per constrained row sets the logits of the tokens
// its grammar forbids to -inf, in place, before sampling. Constrained and free rows share a batch.
//
// Bitmask layout (llguidance's): mask m is mask_words int32 words; bit j of word w allows token
// 32 * w + j. Row r uses mask mask_index[r], or is left untouched when mask_index[r] == -1.
// Tokens at or beyond 32 * mask_words (logits wider than the mask) are forbidden; mask bits at or
// beyond vocab_size (a mask padded to whole words, or sized for a larger vocabulary) are ignored.
// Several rows may share one mask (n > 1 samples of one request).
#pragma once

#include <cstdint>

namespace mindie::kernels::cpu {

// All arrays are validated by the host: every mask_index in [-1, num_masks).
struct TokenMaskArgs {
  float* logits;               // [num_rows, vocab_size], row stride below, written in place
  int64_t logits_row_stride;   // elements
  int64_t num_rows;
  int64_t vocab_size;
  const int32_t* bitmask;      // [num_masks, mask_words], row stride below
  int64_t bitmask_row_stride;  // words
  int64_t mask_words;          // >= 1
  const int32_t* mask_index;   // [num_rows]
};

void apply_token_bitmask(const TokenMaskArgs& args);

#define MINDIE_TOKEN_MASK_KERNELS(X) X(apply_token_bitmask, TokenMaskArgs)

}  // namespace mindie::kernels::cpu
