// One forward step of a Llama-family decoder in C++: embedding, then per layer RMSNorm, q/k/v,
// rotary, KV-cache write, paged attention, o, residual, gate/up, SiLU, down, and the final norm and
// lm_head for the rows whose logits are wanted. One call per step, so a small decode batch is not
// dominated by ~10 us of Python per op. Activations and the residual stream are float32; the
// projections are the integer matmul of quant.h (or `linear` for a dense weight).
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "cpu/quant.h"
#include "cpu/types.h"

namespace mindie::kernels::cpu {

// A projection weight [rows, cols]: block-quantized, or dense float32 / bfloat16 (row-major).
struct WeightMatrix {
  bool quantized = false;
  QMatrix q{};
  const void* dense = nullptr;
  DType dense_dtype = DType::kFloat32;
  int64_t rows = 0, cols = 0;
};

struct LlamaLayerWeights {
  const float* input_norm;
  const float* post_norm;
  WeightMatrix q, k, v, o, gate, up, down;
  const float* q_bias;  // nullptr when the model has no q/k/v biases
  const float* k_bias;
  const float* v_bias;
};

struct LlamaShape {
  int64_t hidden, intermediate, vocab;
  int heads, kv_heads, head_dim;
  float eps, attn_scale;
  const float* cos_sin;  // [max_position, head_dim]: cos then sin (rotate_half layout)
  int64_t max_position;
  int block_size;
  DType kv_dtype;
};

// One step's flattened batch, as AttentionMetadata describes it (mindie/model/llama.py).
struct LlamaBatch {
  const int64_t* input_ids;
  int64_t tokens;
  const int64_t* positions;
  const int64_t* slot_mapping;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t num_seqs;
  const int64_t* logits_indices;
  int64_t num_logits;
  float* logits;  // [num_logits, vocab]
};

class LlamaForward {
 public:
  LlamaForward(const LlamaShape& shape, std::vector<LlamaLayerWeights> layers, WeightMatrix embed,
               WeightMatrix lm_head, const float* final_norm);
  // Per layer K and V caches [num_blocks, block_size, kv_heads, head_dim] of shape.kv_dtype.
  void set_kv_caches(std::vector<void*> keys, std::vector<void*> values);
  // Inputs are validated by the caller (ids < vocab, positions < max_position, slots and tables in range).
  void run(const LlamaBatch& batch);

 private:
  struct Target {
    const WeightMatrix* w;
    const float* bias;
    float* out;
    int64_t out_stride;
  };
  void project(const float* x, int64_t m, int64_t k, std::initializer_list<Target> targets);
  void embed_rows(const LlamaBatch& b);

  LlamaShape shape_;
  std::vector<LlamaLayerWeights> layers_;
  WeightMatrix embed_, lm_head_;
  const float* final_norm_;
  std::vector<void*> key_caches_, value_caches_;
  std::mutex mu_;  // one step at a time: the scratch below is shared
  std::vector<float> hidden_, residual_, x_, qkv_, attn_, gate_up_, act_, final_x_, final_res_;
  std::vector<int8_t> xq_;
  std::vector<float> xd_;
  std::vector<int32_t> ids_;
};

}  // namespace mindie::kernels::cpu
