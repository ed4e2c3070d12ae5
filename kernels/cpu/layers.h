// Small per-token layers of a Llama-family step, fused so one pass over the activations does the
// work of several torch ops (at small batch a decode step is dominated by per-op overhead).
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)), row by row (Hugging Face LlamaRMSNorm
// order: the normalised row is rounded to the activation dtype before the weight multiplies).
// With `residual` set: first residual = x + residual (stored), then the norm of that sum.
struct RmsNormArgs {
  void* out;            // [rows, hidden]; may alias x
  const void* x;        // [rows, hidden], row stride below
  void* residual;       // [rows, hidden] or nullptr
  const void* weight;   // [hidden]
  int64_t rows;
  int64_t hidden;
  int64_t x_stride, out_stride, residual_stride;  // elements between rows
  float eps;
  DType dtype;          // of x, out and residual
  DType weight_dtype;
};

// Qwen3's q_norm / k_norm: every head of every token normalised in place as rms_norm does a row
// (no residual), all heads sharing one weight [head_dim].
struct HeadRmsNormArgs {
  void* x;              // [tokens, heads, head_dim]: heads contiguous within a token
  const void* weight;   // [head_dim]
  int64_t tokens;
  int heads, head_dim;
  int64_t token_stride;  // elements between tokens
  float eps;
  DType dtype;           // of x
  DType weight_dtype;
};

// Rotates query and key rows in place by their token's position. cos_sin_cache is
// [max_position, rot_dim] float32: cos in the first rot_dim/2 columns, sin in the rest.
// NeoX layout (Hugging Face rotate_half): pairs (i, i + rot_dim/2). Llama/GPT-J layout
// (interleaved, GGUF's llama.cpp convention): pairs (2i, 2i + 1). Only the first rot_dim
// dimensions of each head rotate.
struct RotaryArgs {
  const int64_t* positions;  // [tokens], validated < max_position
  void* query;               // [tokens, q_heads, head_dim]
  void* key;                 // [tokens, k_heads, head_dim]
  const float* cos_sin;
  int64_t tokens;
  int q_heads, k_heads, head_dim, rot_dim;
  int64_t q_stride, k_stride;  // elements between tokens
  bool neox;
  DType dtype;
};

// out[t, i] = silu(x[t, i]) * x[t, inter + i]; gelu_tanh_and_mul (Gemma's GeGLU) takes the same
// arguments with gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) on the gate.
struct SiluMulArgs {
  void* out;       // [tokens, inter]
  const void* x;   // [tokens, 2 * inter]
  int64_t tokens, inter;
  int64_t x_stride, out_stride;
  DType dtype;
};

void rms_norm(const RmsNormArgs& args);
void head_rms_norm(const HeadRmsNormArgs& args);
void rotary_embedding(const RotaryArgs& args);
void silu_and_mul(const SiluMulArgs& args);
void gelu_tanh_and_mul(const SiluMulArgs& args);

#define MINDIE_LAYER_KERNELS(X)                                                                       \
  X(rms_norm, RmsNormArgs) X(head_rms_norm, HeadRmsNormArgs) X(rotary_embedding, RotaryArgs) \
  X(silu_and_mul, SiluMulArgs) X(gelu_tanh_and_mul, SiluMulArgs)

}  // namespace mindie::kernels::cpu
