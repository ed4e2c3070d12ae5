// y = x W^T (+ b) for a few rows of x: the decode step's projections at small batch, where torch's
// GEMM runs far below memory bandwidth. The weight streams once per call; every row of x is
// applied to each weight row while it is in L1.
#pragma once

#include <cstdint>

#include "cpu/types.h"

namespace mindie::kernels::cpu {

struct LinearArgs {
  void* out;           // [m, n], dtype of x, row stride out_stride
  const void* x;       // [m, k], row stride x_stride
  const void* weight;  // [n, k], contiguous
  const void* bias;    // [n] or nullptr, dtype of weight
  int64_t m, n, k;
  int64_t x_stride, out_stride;
  DType x_dtype;
  DType w_dtype;
};

void linear(const LinearArgs& args);

#define MINDIE_LINEAR_KERNELS(X) X(linear, LinearArgs)

}  // namespace mindie::kernels::cpu
