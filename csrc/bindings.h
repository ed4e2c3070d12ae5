// One registration function per kernel family; module.cpp calls them all.
#pragma once

#include "buffer.h"
#include "cpu/layers.h"
#include "cpu/quant.h"

namespace mindie::host {

void bind_cache(py::module_& m);
void bind_attention(py::module_& m);
void bind_sampling(py::module_& m);
void bind_beam(py::module_& m);
void bind_layers(py::module_& m);
void bind_linear(py::module_& m);
void bind_token_mask(py::module_& m);
void bind_quant(py::module_& m);
void bind_forward(py::module_& m);
void bind_moe(py::module_& m);
void bind_encoder(py::module_& m);

// A GGUF block-quantized matrix over data [rows, row_bytes] uint8 with `cols` values per row; or,
// with packed_rows >= 0, a matrix of packed_rows rows packed in panels (pack_panels), whose data is
// [packed_rows rounded up to 16, row_bytes].
kernels::cpu::QMatrix quantized_matrix(py::handle data, int ggml_type, int64_t cols, const char* name,
                                       int64_t packed_rows = -1);
// The same from a weight spec (ggml_type, data, cols, rows, packed), as QuantizedWeight.spec() gives it.
kernels::cpu::QMatrix quantized_matrix(const py::tuple& spec, const char* name);

// A row norm's operands, checked: x and out [rows, hidden] of one dtype, weight [hidden], eps > 0, and
// residual (None or [rows, hidden] of x's dtype). rms_norm's, and layer_norm's without its bias.
kernels::cpu::RmsNormArgs norm_rows_args(py::handle out_obj, py::handle x_obj, py::handle weight_obj, double eps,
                                         py::handle residual_obj);

}  // namespace mindie::host
