#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "cpu/dot_peak.h"
#include "cpu/quant.h"

namespace mindie::host {

namespace kc = kernels::cpu;

kc::QMatrix quantized_matrix(py::handle data_obj, int ggml_type, int64_t cols, const char* name, int64_t packed_rows) {
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
  const auto format = static_cast<kc::QFormat>(ggml_type);
  if (packed_rows < 0) return {data.ptr<uint8_t>(), data.size(0), cols, data.size(1), format};
  if (packed_rows < 1) fail(std::string(name) + ": a packed matrix has at least one row");
  data.expect_size(0, kc::packed_rows(packed_rows), "rows of the packed matrix (its rows rounded up to 16)");
  return {data.ptr<uint8_t>(), packed_rows, cols, data.size(1), format, true};
}

kc::QMatrix quantized_matrix(const py::tuple& spec, const char* name) {
  if (spec.size() != 5) fail(std::string(name) + ": a weight spec is (ggml_type, data, cols, rows, packed)");
  return quantized_matrix(spec[1], spec[0].cast<int>(), spec[2].cast<int64_t>(), name,
                          spec[4].cast<bool>() ? spec[3].cast<int64_t>() : -1);
}

namespace {

void dequantize(py::handle out_obj, py::handle data_obj, int ggml_type, bool packed) {
  Tensor out(out_obj, "out");
  out.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  const kc::QMatrix w = quantized_matrix(data_obj, ggml_type, out.size(1), "data", packed ? out.size(0) : -1);
  out.expect_size(0, w.rows, "rows of data");
  kc::DequantizeArgs args{w, 0, w.rows, out.ptr<float>(), out.stride(0), nullptr};
  py::gil_scoped_release nogil;
  kc::dequantize_rows(args);
}

void pack_panels(py::handle out_obj, py::handle data_obj, int ggml_type) {
  Tensor data(data_obj, "data"), out(out_obj, "out");
  data.expect(ElemType::kUInt8).expect_ndim(2);
  kc::QFormatInfo info;
  try {
    info = kc::qformat_info(ggml_type);
  } catch (const std::invalid_argument& e) {
    fail(std::string("data: ") + e.what());
  }
  if (data.size(1) % info.block_bytes != 0) fail("data: bytes per row must be a multiple of the format's block size");
  const kc::QMatrix w = quantized_matrix(data_obj, ggml_type, data.size(1) / info.block_bytes * info.block_elems, "data");
  out.expect(ElemType::kUInt8).expect_ndim(2).expect_contiguous().expect_size(0, kc::packed_rows(w.rows), "rows of data rounded up to 16")
      .expect_size(1, w.row_bytes, "bytes per row of data");
  py::gil_scoped_release nogil;
  kc::pack_panels(w, out.ptr<uint8_t>());
}

void quantize_activations(py::handle q_obj, py::handle d_obj, py::handle x_obj, int planes) {
  Tensor q(q_obj, "q"), d(d_obj, "d"), x(x_obj, "x");
  x.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  const int64_t m = x.size(0), k = x.size(1);
  if (k % 32 != 0) fail("x: in_features must be a multiple of 32");
  q.expect(ElemType::kInt8).expect_ndim(3).expect_contiguous().expect_size(0, m, "rows of x").expect_size(1, 2, "planes")
      .expect_size(2, k, "columns of x");
  d.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, m, "rows of x")
      .expect_size(1, k / 32, "blocks of x");
  if (planes != 1 && planes != 2) fail("planes must be 1 or 2, got " + std::to_string(planes));
  kc::QuantizeActivationsArgs args{x.ptr<float>(), m, k, x.stride(0), q.ptr<int8_t>(), d.ptr<float>(), planes};
  py::gil_scoped_release nogil;
  kc::quantize_activations(args);
}

// The weight, bias and output of a one-matrix qmatmul over m activation rows of k columns.
kc::QMatmulArgs one_target(py::handle out_obj, py::handle data_obj, int ggml_type, py::handle bias_obj, bool packed,
                           int64_t m, int64_t k, const char* x_name) {
  Tensor out(out_obj, "out");
  out.expect_ndim(2);
  const kc::QMatrix w = quantized_matrix(data_obj, ggml_type, k, "weight", packed ? out.size(1) : -1);
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

// Int8 activations xq [m, 2, k], xd [m, k / 32] into args (m, k and planes too). planes = 1 skips the
// lo plane, so it must be zeros (quantize_activations with planes=1): checked, since a lo plane
// skipped that is not would give other sums without a word.
void int8_activations(py::handle q_obj, py::handle d_obj, int planes, kc::QMatmulArgs& args) {
  Tensor q(q_obj, "xq"), d(d_obj, "xd");
  q.expect(ElemType::kInt8).expect_ndim(3).expect_contiguous().expect_size(1, 2, "planes");
  const int64_t m = q.size(0), k = q.size(2);
  d.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, m, "rows of xq")
      .expect_size(1, k / 32, "blocks of xq");
  if (planes != 1 && planes != 2) fail("planes must be 1 or 2, got " + std::to_string(planes));
  if (planes == 1)
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* lo = q.ptr<int8_t>() + (2 * r + 1) * k;
      if (std::any_of(lo, lo + k, [](int8_t v) { return v != 0; }))
        fail("xq: planes=1 takes activations quantized with planes=1, but row " + std::to_string(r) +
             "'s lo plane is not zeros");
    }
  args.xq = q.ptr<int8_t>();
  args.xd = d.ptr<float>();
  args.m = m;
  args.k = k;
  args.planes = planes;
}

void qmatmul(py::handle out_obj, py::handle q_obj, py::handle d_obj, py::handle data_obj, int ggml_type,
             py::handle bias_obj, bool packed, int planes) {
  kc::QMatmulArgs x{};
  int8_activations(q_obj, d_obj, planes, x);
  kc::QMatmulArgs args = one_target(out_obj, data_obj, ggml_type, bias_obj, packed, x.m, x.k, "xq");
  args.xq = x.xq;
  args.xd = x.xd;
  args.planes = x.planes;
  py::gil_scoped_release nogil;
  kc::qmatmul(args);
}

// Up to kMaxQMatmulTargets matrices that share one input, in one call (their rows split over the
// threads as one range), as the forward step projects q/k/v and gate/up.
kc::QMatmulArgs group_args(const py::list& outs, py::handle q_obj, py::handle d_obj, const py::list& weights,
                           int planes) {
  kc::QMatmulArgs args{};
  int8_activations(q_obj, d_obj, planes, args);
  const auto n = static_cast<int64_t>(weights.size());
  if (n < 1 || n > kc::kMaxQMatmulTargets)
    fail("weights: 1 to " + std::to_string(kc::kMaxQMatmulTargets) + " matrices, got " + std::to_string(n));
  if (static_cast<int64_t>(outs.size()) != n) fail("outs: one output per weight");
  for (int64_t j = 0; j < n; ++j) {
    const kc::QMatrix w = quantized_matrix(py::reinterpret_borrow<py::tuple>(weights[j]), "weights");
    if (w.cols != args.k) fail("weights: every matrix needs as many columns as xq");
    Tensor out(outs[j], "outs");
    out.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1).expect_size(0, args.m, "rows of xq")
        .expect_size(1, w.rows, "rows of its weight");
    args.targets[j] = {w, nullptr, out.ptr<float>(), out.stride(0)};
  }
  args.num_targets = static_cast<int>(n);
  return args;
}

void qmatmul_group(const py::list& outs, py::handle q_obj, py::handle d_obj, const py::list& weights, int planes) {
  const kc::QMatmulArgs args = group_args(outs, q_obj, d_obj, weights, planes);
  py::gil_scoped_release nogil;
  kc::qmatmul(args);
}

// Independent qmatmul_group calls, each (outs, xq, xd, weights), in one (the routed experts of a step).
void qmatmul_batch(const py::list& calls, int planes) {
  const auto n = static_cast<int64_t>(calls.size());
  if (n > kc::kMaxQMatmulBatch) fail("calls: at most " + std::to_string(kc::kMaxQMatmulBatch) + ", got " + std::to_string(n));
  std::vector<kc::QMatmulArgs> args;
  for (const py::handle call : calls) {
    const auto t = py::reinterpret_borrow<py::tuple>(call);
    if (t.size() != 4) fail("calls: each a tuple (outs, xq, xd, weights)");
    args.push_back(group_args(t[0].cast<py::list>(), t[1], t[2], t[3].cast<py::list>(), planes));
  }
  py::gil_scoped_release nogil;
  kc::qmatmul_batch({args.data(), static_cast<int>(n)});
}

void qmatmul_bf16(py::handle out_obj, py::handle x_obj, py::handle data_obj, int ggml_type, py::handle bias_obj,
                  bool packed) {
  Tensor x(x_obj, "x");
  x.expect(ElemType::kBFloat16).expect_ndim(2).expect_contiguous();
  kc::QMatmulArgs args = one_target(out_obj, data_obj, ggml_type, bias_obj, packed, x.size(0), x.size(1), "x");
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

// Products (multiply-adds) per second of `instruction` on `threads` pool threads: the best of three
// runs of about `seconds` / 3 each, the iteration count calibrated on a short first run.
double dot_peak(const std::string& instruction, int threads, double seconds) {
  kc::DotInstr instr;
  if (instruction == "vpdpbusd") instr = kc::DotInstr::kVpdpbusd;
  else if (instruction == "vpmaddubsw") instr = kc::DotInstr::kVpmaddubsw;
  else if (instruction == "vdpbf16ps") instr = kc::DotInstr::kVdpbf16ps;
  else if (instruction == "tdpbf16ps") instr = kc::DotInstr::kTdpbf16ps;
  else if (instruction == "vpmaddwd") instr = kc::DotInstr::kVpmaddwd;
  else if (instruction == "vpdpwssd") instr = kc::DotInstr::kVpdpwssd;
  else fail("instruction: expected 'vpdpbusd', 'vpmaddubsw', 'vpmaddwd', 'vpdpwssd', 'vdpbf16ps' or 'tdpbf16ps', got '" +
            instruction + "'");
  if (threads < 1) fail("threads must be >= 1");
  py::gil_scoped_release nogil;
  const auto timed = [&](int64_t iterations, int64_t* products) {
    const auto t0 = std::chrono::steady_clock::now();
    kc::dot_peak({instr, iterations, threads, products});
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  int64_t products = 0;
  int64_t iterations = 1 << 16;
  const double probe = timed(iterations, &products);
  if (products == 0) return 0.0;
  iterations = std::max<int64_t>(1, static_cast<int64_t>(iterations * seconds / 3 / std::max(probe, 1e-6)));
  double best = 0.0;
  for (int run = 0; run < 3; ++run) {
    products = 0;
    const double t = timed(iterations, &products);
    best = std::max(best, static_cast<double>(products) / t);
  }
  return best;
}

}  // namespace

void bind_quant(py::module_& m) {
  m.def("dequantize", &dequantize, py::arg("out"), py::arg("data"), py::arg("ggml_type"), py::arg("packed") = false,
        "out [rows, cols] float32 = the GGUF blocks data [rows, row_bytes] (uint8) of ggml type ggml_type; "
        "packed: data is packed in panels (pack_panels) and holds rows rounded up to 16.");
  m.def("pack_panels", &pack_panels, py::arg("out"), py::arg("data"), py::arg("ggml_type"),
        "out [rows rounded up to 16, row_bytes] uint8 = the Q4_0, Q4_1 or Q8_0 blocks data [rows, row_bytes] "
        "packed in panels of 16 rows, the layout the decode kernels read without shuffles.");
  m.def("quantize_activations", &quantize_activations, py::arg("q"), py::arg("d"), py::arg("x"), py::arg("planes") = 2,
        "Per row, blocks of 32: x [m, k] float32 ~= d [m, k/32] * (128 * q[:, 0] + q[:, 1]), q [m, 2, k] int8; "
        "planes=1: q[:, 1] all zeros (q[:, 0] rounds x to 127 steps of the block's largest magnitude).");
  m.def("qmatmul", &qmatmul, py::arg("out"), py::arg("xq"), py::arg("xd"), py::arg("weight"), py::arg("ggml_type"),
        py::arg("bias") = py::none(), py::arg("packed") = false, py::arg("planes") = 2,
        "out [m, n] float32 = dequant(xq, xd) @ W^T (+ bias) with int8 dot products; W the GGUF blocks "
        "[n, row_bytes] of ggml_type (packed: packed in panels, n rounded up to 16); planes=1 for xq "
        "quantized with planes=1 (its lo plane skipped: the same bits).");
  m.def("qmatmul_group", &qmatmul_group, py::arg("outs"), py::arg("xq"), py::arg("xd"), py::arg("weights"),
        py::arg("planes") = 2,
        "outs[j] [m, n_j] float32 = dequant(xq, xd) @ W_j^T for 1 to 4 weights (ggml_type, data, cols, rows, "
        "packed) that share the input, in one call whose threads split all their rows as one range.");
  m.def("qmatmul_batch", &qmatmul_batch, py::arg("calls"), py::arg("planes") = 2,
        "Up to 16 independent qmatmul_group calls, each a tuple (outs, xq, xd, weights), in one: the same "
        "results; calls of few int8 rows, all as many, against packed matrices run as one walk over their panels.");
  m.def("qmatmul_bf16", &qmatmul_bf16, py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("ggml_type"),
        py::arg("bias") = py::none(), py::arg("packed") = false,
        "out [m, n] float32 = x [m, k] bfloat16 @ bf16(W)^T (+ bias): W the GGUF blocks [n, row_bytes] of "
        "ggml_type, each value rounded to bfloat16; float32 sums of exact products, pair by pair in k order.");
  m.def("round_to_bf16", &round_to_bf16, py::arg("out"), py::arg("x"),
        "out [m, k] bfloat16 = x [m, k] float32 rounded to nearest even.");
  m.def("qmatmul_bf16_native", &kc::qmatmul_bf16_native,
        "Whether the active kernel variant runs qmatmul_bf16 on native bf16 dot products (AVX512-BF16).");
  m.def("dot_peak", &dot_peak, py::arg("instruction"), py::arg("threads"), py::arg("seconds") = 0.6,
        "Multiply-adds per second of a register-only loop of 'vpdpbusd', 'vpmaddubsw', 'vpmaddwd', 'vpdpwssd', "
        "'vdpbf16ps' or 'tdpbf16ps' on `threads` kernel-pool threads (the active variant's form); 0.0 where "
        "the variant or CPU lacks it or the kernels are told not to use it (VNNI after set_vnni(False), AMX "
        "tiles after set_amx(False)).");
}

}  // namespace mindie::host
