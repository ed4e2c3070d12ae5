#include <cmath>

#include "bindings.h"
#include "cpu/layers.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

// [rows, hidden] with dense rows; returns the row stride.
int64_t check_rows(const Tensor& t, int64_t rows, int64_t hidden) {
  t.expect_ndim(2).expect_size(0, rows, "rows").expect_size(1, hidden, "hidden size").expect_inner_contiguous(1);
  return t.stride(0);
}

}  // namespace

kc::RmsNormArgs norm_rows_args(py::handle out_obj, py::handle x_obj, py::handle weight_obj, double eps,
                               py::handle residual_obj) {
  Tensor out(out_obj, "out"), x(x_obj, "x"), weight(weight_obj, "weight");
  x.expect_ndim(2).expect_inner_contiguous(1);
  const int64_t rows = x.size(0), hidden = x.size(1);
  const DType dtype = x.float_dtype();
  weight.expect_ndim(1).expect_contiguous().expect_size(0, hidden, "hidden size of x");
  const DType wdtype = weight.float_dtype();
  const int64_t out_stride = check_rows(out, rows, hidden);
  if (out.float_dtype() != dtype) fail("out: dtype must match x");
  void* residual_ptr = nullptr;
  int64_t residual_stride = 0;
  if (!residual_obj.is_none()) {
    Tensor residual(residual_obj, "residual");
    residual_stride = check_rows(residual, rows, hidden);
    if (residual.float_dtype() != dtype) fail("residual: dtype must match x");
    residual_ptr = residual.data();
  }
  if (!(eps > 0) || !std::isfinite(eps)) fail("eps must be a finite positive number");
  return kc::RmsNormArgs{out.data(), x.data(), residual_ptr, weight.data(), rows, hidden, x.stride(0),
                         out_stride, residual_stride, static_cast<float>(eps), dtype, wdtype};
}

namespace {

void rms_norm(py::handle out_obj, py::handle x_obj, py::handle weight_obj, double eps, py::handle residual_obj) {
  const kc::RmsNormArgs args = norm_rows_args(out_obj, x_obj, weight_obj, eps, residual_obj);
  py::gil_scoped_release nogil;
  kc::rms_norm(args);
}

void head_rms_norm(py::handle x_obj, py::handle weight_obj, double eps) {
  Tensor x(x_obj, "x"), weight(weight_obj, "weight");
  x.expect_ndim(3).expect_inner_contiguous(2);
  const int64_t head_dim = x.size(2);
  weight.expect_ndim(1).expect_contiguous().expect_size(0, head_dim, "head_dim of x");
  if (!(eps > 0) || !std::isfinite(eps)) fail("eps must be a finite positive number");
  kc::HeadRmsNormArgs args{x.data(), weight.data(), x.size(0), static_cast<int>(x.size(1)),
                           static_cast<int>(head_dim), x.stride(0), static_cast<float>(eps), x.float_dtype(),
                           weight.float_dtype()};
  py::gil_scoped_release nogil;
  kc::head_rms_norm(args);
}

void rotary_embedding(py::handle positions_obj, py::handle query_obj, py::handle key_obj,
                      py::handle cos_sin_obj, bool neox) {
  Tensor positions(positions_obj, "positions"), query(query_obj, "query"), key(key_obj, "key");
  Tensor cos_sin(cos_sin_obj, "cos_sin_cache");
  query.expect_ndim(3).expect_inner_contiguous(2);
  const int64_t tokens = query.size(0), head_dim = query.size(2);
  key.expect_ndim(3).expect_inner_contiguous(2).expect_size(0, tokens, "tokens of query")
      .expect_size(2, head_dim, "head_dim of query");
  const DType dtype = query.float_dtype();
  if (key.float_dtype() != dtype) fail("key: dtype must match query");
  cos_sin.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous();
  const int64_t max_pos = cos_sin.size(0), rot_dim = cos_sin.size(1);
  if (rot_dim < 2 || rot_dim % 2 != 0 || rot_dim > head_dim)
    fail("cos_sin_cache: rot_dim (dimension 1) must be even and in [2, head_dim=" + std::to_string(head_dim) +
         "], got " + std::to_string(rot_dim));
  positions.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, tokens, "tokens of query");
  const int64_t* pos = positions.ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    if (pos[t] < 0 || pos[t] >= max_pos)
      fail("positions[" + std::to_string(t) + "] = " + std::to_string(pos[t]) + " is out of range [0, " +
           std::to_string(max_pos) + ")");
  kc::RotaryArgs args{pos, query.data(), key.data(), cos_sin.ptr<float>(), tokens,
                      static_cast<int>(query.size(1)), static_cast<int>(key.size(1)),
                      static_cast<int>(head_dim), static_cast<int>(rot_dim), query.stride(0), key.stride(0),
                      neox, dtype};
  py::gil_scoped_release nogil;
  kc::rotary_embedding(args);
}

// silu_and_mul or gelu_tanh_and_mul: the gated activation over x's gate and up halves.
template <void (*Kernel)(const kc::SiluMulArgs&)>
void gated_and_mul(py::handle out_obj, py::handle x_obj) {
  Tensor out(out_obj, "out"), x(x_obj, "x");
  x.expect_ndim(2).expect_inner_contiguous(1);
  if (x.size(1) % 2 != 0) fail("x: the last dimension must be even (gate and up halves)");
  const int64_t tokens = x.size(0), inter = x.size(1) / 2;
  const int64_t out_stride = check_rows(out, tokens, inter);
  const DType dtype = x.float_dtype();
  if (out.float_dtype() != dtype) fail("out: dtype must match x");
  kc::SiluMulArgs args{out.data(), x.data(), tokens, inter, x.stride(0), out_stride, dtype};
  py::gil_scoped_release nogil;
  Kernel(args);
}

}  // namespace

void bind_layers(py::module_& m) {
  m.def("rms_norm", &rms_norm, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"),
        py::arg("residual") = py::none(),
        "out = weight * rmsnorm(x) over rows [rows, hidden]; with residual: residual += x first "
        "(stored in place) and the sum is normalised.");
  m.def("head_rms_norm", &head_rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        "Normalises each head of x [tokens, heads, head_dim] in place: weight [head_dim] * rmsnorm(head) "
        "(Qwen3's q_norm / k_norm).");
  m.def("rotary_embedding", &rotary_embedding, py::arg("positions"), py::arg("query"), py::arg("key"),
        py::arg("cos_sin_cache"), py::arg("neox") = true,
        "Rotates query [tokens, q_heads, head_dim] and key [tokens, k_heads, head_dim] in place; "
        "cos_sin_cache float32 [max_position, rot_dim] holds cos then sin.");
  m.def("silu_and_mul", &gated_and_mul<kc::silu_and_mul>, py::arg("out"), py::arg("x"),
        "out [tokens, inter] = silu(x[:, :inter]) * x[:, inter:].");
  m.def("gelu_tanh_and_mul", &gated_and_mul<kc::gelu_tanh_and_mul>, py::arg("out"), py::arg("x"),
        "out [tokens, inter] = gelu_tanh(x[:, :inter]) * x[:, inter:] (GeGLU, tanh-approximated GELU).");
}

}  // namespace mindie::host
