// One forward step of a Llama-family decoder in C++: embedding, then per layer RMSNorm, q/k/v,
// the per-head q/k RMSNorm where the model has one (Qwen3), rotary, KV-cache write, paged
// attention, o, residual, gate/up, SiLU, down, and the final norm and lm_head for the rows whose
// logits are wanted. One call per step, so a small decode batch is not dominated by ~10 us of
// Python per op. Activations and the residual stream are float32; the projections are the matmul
// of quant.h (or `linear` for a dense weight). A generated token's row enters it as int8 planes
// (memory-bound at decode batches, where integer dot products are cheapest and most exact). A
// prompt token's row, where compute dominates, enters as bfloat16 when bf16_prompts is set and the
// CPU has native bf16 dot products (qmatmul_bf16_native), else as int8 too; the lm_head takes every
// row as int8. Which form a row takes depends only on that row (its position against its prompt's
// length), never on the rest of the batch. Int8 rows are quantized with activation_planes planes
// (two, or one as llama.cpp: faster wherever products dominate, about 8 bits instead of 15).
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
  // Qwen3: RMSNorm weights [head_dim] for every q / k head, applied after the projection and
  // before rotary; nullptr when the model has none.
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  // A mixture-of-experts MLP (Qwen3-MoE, Mixtral) in place of gate/up/down: the router
  // [experts, hidden] and per expert its gate and up [expert_intermediate, hidden] and down
  // [hidden, expert_intermediate], each a matrix of its own, so that a step reads only the bytes of
  // the experts its rows are routed to. Empty for a dense MLP.
  WeightMatrix router{};
  std::vector<WeightMatrix> expert_gate, expert_up, expert_down;
  // Gemma 3's sandwich norms: RMSNorm on the attention output and on the MLP output before each
  // residual add; nullptr when the model has none.
  const float* post_attn_norm = nullptr;
  const float* post_ffn_norm = nullptr;
  int window = 0;                  // sliding-window layer (PagedAttentionArgs::window); 0: global
  const float* cos_sin = nullptr;  // this layer's rotary table, as LlamaShape::cos_sin; nullptr: that one
};

struct LlamaShape {
  int64_t hidden, intermediate, vocab;
  int heads, kv_heads, head_dim;
  float eps, attn_scale;
  const float* cos_sin;  // [max_position, rotary_dim]: cos then sin (rotate_half layout)
  int rotary_dim;        // the first rotary_dim dimensions of each q/k head rotate (Phi-3: partial rotary)
  int64_t max_position;
  int block_size;
  DType kv_dtype;
  bool bf16_prompts;
  int activation_planes = 2;  // the int8 rows' planes (QuantizeActivationsArgs::planes)
  // MoE layers: each row runs its experts_per_tok most probable experts, their weights renormalised
  // to sum to 1 when norm_topk_prob is set (moe.h)
  int64_t expert_intermediate = 0;
  int experts_per_tok = 0;
  bool norm_topk_prob = true;
  bool gelu = false;           // the gate's activation: gelu_tanh (GeGLU), else silu
  float embed_scale = 1.f;     // token embeddings times this (Gemma: sqrt(hidden))
  float attn_softcap = 0.f;    // PagedAttentionArgs::softcap
  float final_softcap = 0.f;   // logits -> cap * tanh(logits / cap); 0: off
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
  const int32_t* prompt_lens;  // [num_seqs]: rows at positions below are prompt tokens; nullptr: none are
  // Media (vision-language models; all optional): rows whose embedding is replaced by a row of
  // media_embeds [num_media_rows, hidden] float32 (an image's encoder output at its tokens), and
  // rope_rows [tokens, rotary_dim] float32, each row's own rotary cos/sin (multimodal positions) in
  // place of the table row at its position.
  const int64_t* media_rows = nullptr;
  const float* media_embeds = nullptr;
  int64_t num_media_rows = 0;
  const float* rope_rows = nullptr;
};

class LlamaForward {
 public:
  LlamaForward(const LlamaShape& shape, std::vector<LlamaLayerWeights> layers, WeightMatrix embed,
               WeightMatrix lm_head, const float* final_norm);
  // Per layer K and V caches [num_blocks, block_size, kv_heads, head_dim] of shape.kv_dtype.
  void set_kv_caches(std::vector<void*> keys, std::vector<void*> values);
  // Inputs are validated by the caller (ids < vocab, positions < max_position, slots and tables in range).
  void run(const LlamaBatch& batch);
  // Per layer, the experts (ascending ids) the last step ran: a check that a step reads only the
  // routed experts. Empty lists for dense layers.
  std::vector<std::vector<int32_t>> last_step_experts();

 private:
  struct Target {
    const WeightMatrix* w;
    const float* bias;
    float* out;
    int64_t out_stride;
  };
  // The rows of a project() call by the form their activations take; both lists are filled only
  // when the call mixes the two (else all_bf16 says which one it is).
  struct RowForms {
    bool all_bf16 = false;
    std::vector<int32_t> bf16, int8;
  };
  void split_rows(const LlamaBatch& b);  // into token_forms_
  void project(const float* x, int64_t m, int64_t k, const RowForms& forms, std::initializer_list<Target> targets);
  void qmatmul_rows(QMatmulArgs q, const float* x, int64_t k, const std::vector<int32_t>* rows, bool bf16);
  void embed_rows(const LlamaBatch& b);
  // Layer li's MoE MLP over x [T, hidden] into out [T, hidden]: the router, top-k, then per expert
  // its rows gathered through gate/up -> SiLU * up -> down, and the weighted sum back per row.
  void moe_mlp(size_t li, const float* x, int64_t T, float* out);
  // The routed experts of a layer whose rows are all int8 (decode) and whose experts are quantized:
  // their rows stacked, then gate/up and down in qmatmul_batch calls of experts with one row count
  // (one call each at batch 1, where every expert has the row), y [T * K, hidden] filled by slot.
  void routed_experts_batched(const LlamaLayerWeights& L, const float* x, float* y);

  LlamaShape shape_;
  std::vector<LlamaLayerWeights> layers_;
  WeightMatrix embed_, lm_head_;
  const float* final_norm_;
  std::vector<void*> key_caches_, value_caches_;
  std::mutex mu_;  // one step at a time: the scratch below is shared
  ScratchVector<float> hidden_, residual_, x_, qkv_, attn_, gate_up_, act_, final_x_, final_res_;
  ScratchVector<int8_t> xq_;
  ScratchVector<float> xd_, gathered_;
  ScratchVector<bf16_t> xb_;
  RowForms token_forms_;
  ScratchVector<int32_t> ids_;
  ScratchVector<int64_t> row_index_;  // 0..tokens-1: the rotary positions into rope_rows
  ScratchVector<float> router_logits_, route_weights_, expert_x_, expert_gate_up_, expert_act_, expert_y_, routed_y_;
  ScratchVector<int32_t> route_ids_;
  std::vector<std::vector<int32_t>> expert_rows_, expert_slots_;  // per expert: its rows, and their (row, j) slots
  std::vector<std::vector<int32_t>> last_experts_;
};

}  // namespace mindie::kernels::cpu
