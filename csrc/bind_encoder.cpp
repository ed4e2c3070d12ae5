#include "bindings.h"
#include "cpu/encoder_layers.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

// [rows, cols] of `dtype` with dense rows; returns the row stride.
int64_t check_rows(const Tensor& t, int64_t rows, int64_t cols, DType dtype) {
  t.expect_ndim(2).expect_size(0, rows, "rows of x").expect_size(1, cols, "columns of x").expect_inner_contiguous(1);
  if (t.float_dtype() != dtype) fail(t.name() + ": dtype must match x");
  return t.stride(0);
}

void layer_norm(py::handle out_obj, py::handle x_obj, py::handle weight_obj, py::handle bias_obj, double eps,
                py::handle residual_obj) {
  const kc::RmsNormArgs norm = norm_rows_args(out_obj, x_obj, weight_obj, eps, residual_obj);
  Tensor bias(bias_obj, "bias");
  bias.expect_ndim(1).expect_contiguous().expect_size(0, norm.hidden, "hidden size of x");
  if (bias.float_dtype() != norm.weight_dtype) fail("bias: dtype must match weight");
  const kc::LayerNormArgs args{norm, bias.data()};
  py::gil_scoped_release nogil;
  kc::layer_norm(args);
}

void gelu_tanh(py::handle out_obj, py::handle x_obj) {
  Tensor out(out_obj, "out"), x(x_obj, "x");
  x.expect_ndim(2).expect_inner_contiguous(1);
  const DType dtype = x.float_dtype();
  const int64_t out_stride = check_rows(out, x.size(0), x.size(1), dtype);
  kc::GeluArgs args{out.data(), x.data(), x.size(0), x.size(1), x.stride(0), out_stride, dtype};
  py::gil_scoped_release nogil;
  kc::gelu_tanh(args);
}

}  // namespace

void bind_encoder(py::module_& m) {
  m.def("layer_norm", &layer_norm, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"), py::arg("residual") = py::none(),
        "out = layer_norm(x) * weight + bias over rows [rows, hidden]; with residual: residual += x first "
        "(stored in place, in its dtype) and the sum is normalised. out may be x.");
  m.def("gelu_tanh", &gelu_tanh, py::arg("out"), py::arg("x"),
        "out = gelu(x, approximate='tanh') over [rows, n]; out may be x.");
}

}  // namespace mindie::host
