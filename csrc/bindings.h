// One registration function per kernel family; module.cpp calls them all.
#pragma once

#include "buffer.h"
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

// A GGUF block-quantized matrix over data [rows, row_bytes] uint8 with `cols` values per row.
kernels::cpu::QMatrix quantized_matrix(py::handle data, int ggml_type, int64_t cols, const char* name);

}  // namespace mindie::host
