// Paged attention over block tables for a flattened batch of sequences, each with q_len >= 1 new
// query tokens whose K/V are already in the cache (write first, then attend). Query i of a
// sequence sits at position seq_len - q_len + i and attends causally to cache positions 0..pos,
// so decode (q_len = 1), prefill, chunked prefill and prefix-cache hits are one kernel; on a
// sliding-window layer only the last `window` of them.
// Grouped-query attention: query head qh reads kv head qh / (num_heads / kv_heads).
// Softmax is online (running max and sum) in float32; decode contexts may be split over several
// workers (partition_size tokens each) and merged, so a few long sequences still use every core.
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

struct PagedAttentionArgs {
  const void* query;        // [num_tokens, num_heads, head_dim], token stride below
  int64_t q_token_stride;   // elements
  const void* key_cache;    // [num_blocks, block_size, kv_heads, head_dim]
  const void* value_cache;  // same
  const int32_t* block_tables;  // [num_seqs, block_table_stride]; validated ids
  int64_t block_table_stride;
  const int32_t* query_start_loc;  // [num_seqs + 1], non-decreasing, starts at 0
  const int32_t* seq_lens;         // [num_seqs], >= q_len, covered by the block table
  void* out;                 // [num_tokens, num_heads, head_dim], dtype of query
  int64_t out_token_stride;  // elements
  int64_t num_seqs;
  int num_heads;
  int kv_heads;
  int head_dim;
  int block_size;
  float scale;
  int partition_size;  // tokens per split of a decode context; 0 chooses from the batch shape
  DType q_dtype;
  DType kv_dtype;
  // Sliding-window layers (Gemma 3, Mistral): a query at position p sees keys p - window + 1..p
  // (transformers' kv > q - window); 0: every earlier key. Keys outside it are never read.
  int window = 0;
  // Gemma 2's attention logit soft-capping: scaled scores become softcap * tanh(score / softcap)
  // before the softmax; 0: off.
  float softcap = 0.f;
};

void paged_attention(const PagedAttentionArgs& args);

#define MINDIE_ATTENTION_KERNELS(X) X(paged_attention, PagedAttentionArgs)

}  // namespace mindie::kernels::cpu
