#include <stdexcept>

#include "bindings.h"
#include "cpu/quant.h"

namespace mindie::host {

namespace kc = kernels::cpu;

kc::QMatrix quantized_matrix(py::handle data_obj, int ggml_type, int64_t cols, const char* name) {
  Tensor data(data_obj, name);
  kc::QFormatInfo info;
  try {
    info = kc::qformat_info(ggml_type);
  } catch (const std::invalid_argument& e) {
    fail(std::string(name) + ": " + e.what());
  }
  data.expect(ElemType::kUInt8).expect_ndim(2).expect_contiguous();
  if (cols < 1 || cols % info.block_elems != 0)
    fail(std::string(name) + ": columns must be a positive multiple of " + std::to_string(info.block_elems) +
         " for this format, got " + std::to_string(cols));
  data.expect_size(1, cols / info.block_elems * info.block_bytes, "bytes per row of the format");
  return {data.ptr<uint8_t>(), data.size(0), cols, data.size(1), static_cast<kc::QFormat>(ggml_type)};
}

namespace {

void dequantize(py::handle out_obj, py::handle data_obj, int ggml_type) {
  Tensor out(out_obj, "out");
  out.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  const kc::QMatrix w = quantized_matrix(data_obj, ggml_type, out.size(1), "data");
  out.expect_size(0, w.rows, "rows of data");
  kc::DequantizeArgs args{w, 0, w.rows, out.ptr<float>(), out.stride(0), nullptr};
  py::gil_scoped_release nogil;
  kc::dequantize_rows(args);
}

void quantize_activations(py::handle q_obj, py::handle d_obj, py::handle x_obj) {
  Tensor q(q_obj, "q"), d(d_obj, "d"), x(x_obj, "x");
  x.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  const int64_t m = x.size(0), k = x.size(1);
  if (k % 32 != 0) fail("x: in_features must be a multiple of 32");
  q.expect(ElemType::kInt8).expect_ndim(3).expect_contiguous().expect_size(0, m, "rows of x").expect_size(1, 2, "planes")
      .expect_size(2, k, "columns of x");
  d.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, m, "rows of x")
      .expect_size(1, k / 32, "blocks of x");
  kc::QuantizeActivationsArgs args{x.ptr<float>(), m, k, x.stride(0), q.ptr<int8_t>(), d.ptr<float>()};
  py::gil_scoped_release nogil;
  kc::quantize_activations(args);
}

// The weight, bias and output of a one-matrix qmatmul over m activation rows of k columns.
kc::QMatmulArgs one_target(py::handle out_obj, py::handle data_obj, int ggml_type, py::handle bias_obj, int64_t m,
                           int64_t k, const char* x_name) {
  Tensor out(out_obj, "out");
  const kc::QMatrix w = quantized_matrix(data_obj, ggml_type, k, "weight");
  const std::string rows_of_x = std::string("rows of ") + x_name;
  out.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1).expect_size(0, m, rows_of_x.c_str())
      .expect_size(1, w.rows, "rows of weight");
  const float* bias = nullptr;
  if (!bias_obj.is_none()) {
    Tensor b(bias_obj, "bias");
    b.expect(ElemType::kFloat32).expect_ndim(1).expect_contiguous().expect_size(0, w.rows, "rows of weight");
    bias = b.ptr<float>();
  }
  kc::QMatmulArgs args{};
  args.targets[0] = {w, bias, out.ptr<float>(), out.stride(0)};
  args.num_targets = 1;
  args.m = m;
  args.k = k;
  return args;
}

void qmatmul(py::handle out_obj, py::handle q_obj, py::handle d_obj, py::handle data_obj, int ggml_type,
             py::handle bias_obj) {
  Tensor q(q_obj, "xq"), d(d_obj, "xd");
  q.expect(ElemType::kInt8).expect_ndim(3).expect_contiguous().expect_size(1, 2, "planes");
  const int64_t m = q.size(0), k = q.size(2);
  d.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, m, "rows of xq")
      .expect_size(1, k / 32, "blocks of xq");
  kc::QMatmulArgs args = one_target(out_obj, data_obj, ggml_type, bias_obj, m, k, "xq");
  args.xq = q.ptr<int8_t>();
  args.xd = d.ptr<float>();
  py::gil_scoped_release nogil;
  kc::qmatmul(args);
}

void qmatmul_bf16(py::handle out_obj, py::handle x_obj, py::handle data_obj, int ggml_type, py::handle bias_obj) {
  Tensor x(x_obj, "x");
  x.expect(ElemType::kBFloat16).expect_ndim(2).expect_contiguous();
  kc::QMatmulArgs args = one_target(out_obj, data_obj, ggml_type, bias_obj, x.size(0), x.size(1), "x");
  args.xb = x.ptr<kc::bf16_t>();
  py::gil_scoped_release nogil;
  kc::qmatmul(args);
}

void round_to_bf16(py::handle out_obj, py::handle x_obj) {
  Tensor out(out_obj, "out"), x(x_obj, "x");
  x.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  out.expect(ElemType::kBFloat16).expect_ndim(2).expect_contiguous().expect_size(0, x.size(0), "rows of x")
      .expect_size(1, x.size(1), "columns of x");
  kc::RoundToBf16Args args{x.ptr<float>(), x.size(0), x.size(1), x.stride(0), out.ptr<kc::bf16_t>()};
  py::gil_scoped_release nogil;
  kc::round_to_bf16(args);
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def("dequantize", &dequantize, py::arg("out"), py::arg("data"), py::arg("ggml_type"),
        "out [rows, cols] float32 = the GGUF blocks data [rows, row_bytes] (uint8) of ggml type ggml_type.");
  m.def("quantize_activations", &quantize_activations, py::arg("q"), py::arg("d"), py::arg("x"),
        "Per row, blocks of 32: x [m, k] float32 ~= d [m, k/32] * (128 * q[:, 0] + q[:, 1]), q [m, 2, k] int8.");
  m.def("qmatmul", &qmatmul, py::arg("out"), py::arg("xq"), py::arg("xd"), py::arg("weight"), py::arg("ggml_type"),
        py::arg("bias") = py::none(),
        "out [m, n] float32 = dequant(xq, xd) @ W^T (+ bias) with int8 dot products; W the GGUF blocks "
        "[n, row_bytes] of ggml_type.");
  m.def("qmatmul_bf16", &qmatmul_bf16, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("ggml_type"),
        py::arg("bias") = py::none(),
        "out [m, n] float32 = x [m, k] bfloat16 @ bf16(W)^T (+ bias): W the GGUF blocks [n, row_bytes] of "
        "ggml_type, each value rounded to bfloat16; float32 sums of exact products, pair by pair in k order.");
  m.def("round_to_bf16", &round_to_bf16, py::arg("out"), py::arg("x"),
        "out [m, k] bfloat16 = x [m, k] float32 rounded to nearest even.");
  m.def("qmatmul_bf16_native", &kc::qmatmul_bf16_native,
        "Whether the active kernel variant runs qmatmul_bf16 on native bf16 dot products (AVX512-BF16).");
}

}  // namespace mindie::host
