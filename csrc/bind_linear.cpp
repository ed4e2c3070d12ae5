#include "bindings.h"
#include "cpu/linear.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

void linear(py::handle out_obj, py::handle x_obj, py::handle weight_obj, py::handle bias_obj) {
  Tensor out(out_obj, "out"), x(x_obj, "x"), weight(weight_obj, "weight");
  x.expect_ndim(2).expect_inner_contiguous(1);
  const DType x_dtype = x.float_dtype();
  weight.expect_ndim(2).expect_contiguous().expect_size(1, x.size(1), "in_features of x");
  const DType w_dtype = weight.float_dtype();
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  out.expect_ndim(2).expect_size(0, m, "rows of x").expect_size(1, n, "out_features of weight").expect_inner_contiguous(1);
  if (out.float_dtype() != x_dtype) fail("out: dtype must match x");
  const void* bias = nullptr;
  if (!bias_obj.is_none()) {
    Tensor b(bias_obj, "bias");
    b.expect_ndim(1).expect_contiguous().expect_size(0, n, "out_features of weight");
    if (b.float_dtype() != w_dtype) fail("bias: dtype must match weight");
    bias = b.data();
  }
  if (k < 1) fail("x: in_features must be >= 1");
  kc::LinearArgs args{out.data(), x.data(), weight.data(), bias, m, n, k, x.stride(0), out.stride(0), x_dtype, w_dtype};
  py::gil_scoped_release nogil;
  kc::linear(args);
}

}  // namespace

void bind_linear(py::module_& m) {
  m.def("linear", &linear, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        "out [m, n] = x [m, k] @ weight[n, k]^T (+ bias [n]); for few rows (decode at small batch), "
        "where it streams the weight once at memory speed.");
}

}  // namespace mindie::host
