// Paged KV-cache writes and whole-block copies.
// Cache layout: [num_blocks, block_size, kv_heads, head_dim], one tensor for K and one for V.
// A token's slot is block_id * block_size + offset; a negative slot means "skip this token"
// (padding), as in vLLM.
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

struct KVWriteArgs {
  const void* key;    // [num_tokens, kv_heads, head_dim], heads contiguous, token stride below
  const void* value;  // same shape as key
  int64_t key_token_stride;    // elements between consecutive tokens of `key`
  int64_t value_token_stride;  // elements between consecutive tokens of `value`
  void* key_cache;
  void* value_cache;
  const int64_t* slot_mapping;  // [num_tokens]; validated: < num_blocks * block_size
  int64_t num_tokens;
  int block_size;
  int kv_heads;
  int head_dim;
  DType src_dtype;
  DType cache_dtype;
};

// Copies whole blocks src_cache[pairs[2i]] -> dst_cache[pairs[2i+1]]. src and dst may be the same
// tensor (copy-on-write fork) or different ones (swap to a host pool, export for another server).
struct BlockCopyArgs {
  const void* src;
  void* dst;
  const int64_t* pairs;  // [num_pairs, 2]; validated against both caches' block counts
  int64_t num_pairs;
  int64_t block_bytes;
};

void reshape_and_cache(const KVWriteArgs& args);
void copy_blocks(const BlockCopyArgs& args);

#define MINDIE_KV_CACHE_KERNELS(X) X(reshape_and_cache, KVWriteArgs) X(copy_blocks, BlockCopyArgs)

}  // namespace mindie::kernels::cpu
