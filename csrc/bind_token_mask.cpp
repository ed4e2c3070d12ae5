#include "bindings.h"
#include "cpu/token_mask.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

void apply_token_bitmask(py::handle logits_obj, py::handle bitmask_obj, py::handle mask_index_obj) {
  Tensor logits(logits_obj, "logits"), bitmask(bitmask_obj, "bitmask"), mask_index(mask_index_obj, "mask_index");
  logits.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  bitmask.expect(ElemType::kInt32).expect_ndim(2).expect_inner_contiguous(1);
  const int64_t num_masks = bitmask.size(0), words = bitmask.size(1);
  if (words < 1) fail("bitmask: needs at least one 32-bit word per mask, got shape " + shape_str(bitmask));
  mask_index.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous().expect_size(0, rows, "rows of logits");
  const int32_t* idx = mask_index.ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r)
    if (idx[r] < -1 || idx[r] >= num_masks)
      fail("mask_index[" + std::to_string(r) + "] = " + std::to_string(idx[r]) + " is out of range [-1, " +
           std::to_string(num_masks) + ") (-1 = unconstrained, else a row of bitmask)");
  kc::TokenMaskArgs args{logits.ptr<float>(), logits.stride(0), rows, vocab, bitmask.ptr<int32_t>(),
                         bitmask.stride(0), words, idx};
  if (rows == 0 || vocab == 0) return;
  py::gil_scoped_release nogil;
  kc::apply_token_bitmask(args);
}

}  // namespace

void bind_token_mask(py::module_& m) {
  m.def("apply_token_bitmask", &apply_token_bitmask, py::arg("logits"), py::arg("bitmask"), py::arg("mask_index"),
        "Sets to -inf, in place, the logits [rows, vocab] (float32) of the tokens a packed bitmask "
        "[num_masks, words] (int32; bit j of word w allows token 32 * w + j) forbids; row r uses "
        "mask mask_index[r] (int32 [rows]) or is left untouched when it is -1. Tokens beyond "
        "32 * words are forbidden; mask bits beyond vocab are ignored.");
}

}  // namespace mindie::host
