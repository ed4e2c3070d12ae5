#include "bindings.h"
#include "cpu/moe.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

void moe_route(py::handle weights_obj, py::handle experts_obj, py::handle logits_obj, bool normalize) {
  Tensor weights(weights_obj, "weights"), experts(experts_obj, "experts"), logits(logits_obj, "logits");
  logits.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  const int64_t tokens = logits.size(0), num_experts = logits.size(1);
  weights.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, tokens, "tokens");
  const int64_t k = weights.size(1);
  experts.expect(ElemType::kInt32).expect_ndim(2).expect_contiguous().expect_size(0, tokens, "tokens")
      .expect_size(1, k, "k");
  if (k < 1 || k > num_experts) fail("k must be in [1, number of experts]");
  kc::MoeRouteArgs args{logits.ptr<float>(), tokens, static_cast<int>(num_experts), static_cast<int>(k),
                        logits.stride(0), normalize, weights.ptr<float>(), experts.ptr<int32_t>()};
  py::gil_scoped_release nogil;
  kc::moe_route(args);
}

void moe_combine(py::handle out_obj, py::handle y_obj, py::handle weights_obj, py::handle experts_obj) {
  Tensor out(out_obj, "out"), y(y_obj, "y"), weights(weights_obj, "weights"), experts(experts_obj, "experts");
  weights.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous();
  const int64_t tokens = weights.size(0), k = weights.size(1);
  experts.expect(ElemType::kInt32).expect_ndim(2).expect_contiguous().expect_size(0, tokens, "tokens")
      .expect_size(1, k, "k");
  y.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, tokens * k, "tokens * k");
  const int64_t hidden = y.size(1);
  out.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1).expect_size(0, tokens, "tokens")
      .expect_size(1, hidden, "hidden");
  kc::MoeCombineArgs args{y.ptr<float>(), weights.ptr<float>(), experts.ptr<int32_t>(), tokens, static_cast<int>(k),
                          hidden, out.ptr<float>(), out.stride(0)};
  py::gil_scoped_release nogil;
  kc::moe_combine(args);
}

}  // namespace

void bind_moe(py::module_& m) {
  m.def("moe_route", &moe_route, py::arg("weights"), py::arg("experts"), py::arg("logits"), py::arg("normalize"),
        "Top-k routing: per row of logits [tokens, experts] float32, softmax, the k = weights.shape[1] largest "
        "probabilities (largest first) into weights [tokens, k] float32 and their expert ids into experts "
        "[tokens, k] int32, renormalised to sum to 1 with normalize.");
  m.def("moe_combine", &moe_combine, py::arg("out"), py::arg("y"), py::arg("weights"), py::arg("experts"),
        "out[t] = sum_j weights[t, j] * y[t * k + j], the terms added in ascending expert id.");
}

}  // namespace mindie::host
