// One registration function per kernel family; module.cpp calls them all.
#pragma once

#include "buffer.h"

namespace mindie::host {

void bind_cache(py::module_& m);
void bind_attention(py::module_& m);
void bind_sampling(py::module_& m);
void bind_beam(py::module_& m);
void bind_layers(py::module_& m);
void bind_linear(py::module_& m);
void bind_token_mask(py::module_& m);

}  // namespace mindie::host
