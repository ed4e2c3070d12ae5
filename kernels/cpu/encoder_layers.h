// Per-token layers of the media encoders (SigLIP's): LayerNorm and the tanh GELU, one pass each over a
// GEMM's output where torch spends several ops (and dtype copies) on them.
// Every rounding to bfloat16 sits where the reference PyTorch module rounds; the math inside is float32.
#pragma once

#include <cstdint>

#include "cpu/layers.h"
#include "cpu/types.h"

namespace mindie::kernels::cpu {

// out = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias per row (nn.LayerNorm), h = x; with
// `residual` set: first residual = to_dtype(residual + x) (stored), then h = that sum. The operands
// are rms_norm's and a bias.
struct LayerNormArgs {
  RmsNormArgs norm;
  const void* bias;  // [hidden], dtype of norm.weight
};

// out = gelu(x, approximate='tanh') elementwise over rows (gelu_pytorch_tanh). The erf form stays
// torch's: its kernel ran twice as fast as one of ours.
struct GeluArgs {
  void* out;       // [rows, n]; may alias x
  const void* x;   // [rows, n]
  int64_t rows, n;
  int64_t x_stride, out_stride;
  DType dtype;
};

void layer_norm(const LayerNormArgs& args);
void gelu_tanh(const GeluArgs& args);

#define MINDIE_ENCODER_KERNELS(X) X(layer_norm, LayerNormArgs) X(gelu_tanh, GeluArgs)

}  // namespace mindie::kernels::cpu
