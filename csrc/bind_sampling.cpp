#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>

#include "bindings.h"
#include "cpu/sampling.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

std::string num(double v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

std::string at(const char* name, int64_t i) { return std::string(name) + "[" + std::to_string(i) + "]"; }

// A 1-D contiguous per-row array of `want` elements, or nullopt for None when allowed.
std::optional<Tensor> row_param(py::handle obj, const char* name, ElemType want, int64_t rows, bool optional) {
  if (obj.is_none()) {
    if (optional) return std::nullopt;
    throw py::type_error(std::string(name) + ": expected a tensor, got None");
  }
  Tensor t(obj, name);
  t.expect(want).expect_ndim(1).expect_contiguous().expect_size(0, rows, "batch size of logits");
  return t;
}

// CSR token lists: both None (no tokens) or tokens int64 [n] + offsets int64 [rows + 1].
void check_csr(const std::optional<Tensor>& tokens, const std::optional<Tensor>& offsets, const char* tname,
               const char* oname, int64_t rows, int64_t vocab) {
  if (tokens.has_value() != offsets.has_value())
    fail(std::string(tname) + " and " + oname + " must be given together (or both None)");
  if (!tokens) return;
  tokens->expect(ElemType::kInt64).expect_ndim(1).expect_contiguous();
  offsets->expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, rows + 1, "batch size + 1");
  const int64_t* o = offsets->ptr<int64_t>();
  const int64_t n = tokens->size(0);
  if (o[0] != 0) fail(std::string(oname) + "[0] must be 0, got " + std::to_string(o[0]));
  for (int64_t i = 0; i < rows; ++i)
    if (o[i + 1] < o[i])
      fail(std::string(oname) + " must not decrease (at index " + std::to_string(i + 1) + ")");
  if (o[rows] != n)
    fail(at(oname, rows) + " = " + std::to_string(o[rows]) + " must equal the number of " + tname + " (" +
         std::to_string(n) + ")");
  const int64_t* t = tokens->ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    if (t[i] < 0 || t[i] >= vocab)
      fail(at(tname, i) + " = " + std::to_string(t[i]) + " is out of range [0, " + std::to_string(vocab) +
           ") (vocab_size)");
}

void sample(py::handle out_tokens_obj, py::handle out_logprobs_obj, py::handle out_top_logprobs_obj,
            py::handle out_top_ids_obj, py::handle logits_obj, py::handle temperature_obj, py::handle top_k_obj,
            py::handle top_p_obj, py::handle seed_obj, py::handle step_obj, py::handle rep_obj,
            py::handle presence_obj, py::handle frequency_obj, py::handle prompt_tokens_obj,
            py::handle prompt_offsets_obj, py::handle output_tokens_obj, py::handle output_offsets_obj,
            int64_t num_logprobs) {
  Tensor logits(logits_obj, "logits");
  logits.expect_ndim(2).expect_inner_contiguous(1);
  const DType dtype = logits.float_dtype();
  const int64_t B = logits.size(0), V = logits.size(1);
  if (V < 1 || V > std::numeric_limits<int32_t>::max())
    fail("logits: vocab_size (dimension 1) must be in [1, 2^31), got shape " + shape_str(logits));

  auto temperature = row_param(temperature_obj, "temperature", ElemType::kFloat32, B, false);
  auto top_k = row_param(top_k_obj, "top_k", ElemType::kInt32, B, false);
  auto top_p = row_param(top_p_obj, "top_p", ElemType::kFloat32, B, false);
  auto seed = row_param(seed_obj, "seed", ElemType::kInt64, B, false);
  auto step = row_param(step_obj, "step", ElemType::kInt64, B, false);
  auto rep = row_param(rep_obj, "repetition_penalty", ElemType::kFloat32, B, true);
  auto presence = row_param(presence_obj, "presence_penalty", ElemType::kFloat32, B, true);
  auto frequency = row_param(frequency_obj, "frequency_penalty", ElemType::kFloat32, B, true);
  std::optional<Tensor> prompt_tokens, prompt_offsets, output_tokens, output_offsets;
  if (!prompt_tokens_obj.is_none()) prompt_tokens.emplace(prompt_tokens_obj, "prompt_tokens");
  if (!prompt_offsets_obj.is_none()) prompt_offsets.emplace(prompt_offsets_obj, "prompt_offsets");
  if (!output_tokens_obj.is_none()) output_tokens.emplace(output_tokens_obj, "output_tokens");
  if (!output_offsets_obj.is_none()) output_offsets.emplace(output_offsets_obj, "output_offsets");
  check_csr(prompt_tokens, prompt_offsets, "prompt_tokens", "prompt_offsets", B, V);
  check_csr(output_tokens, output_offsets, "output_tokens", "output_offsets", B, V);

  const float* tp = temperature->ptr<float>();
  const int32_t* tk = top_k->ptr<int32_t>();
  const float* pp = top_p->ptr<float>();
  const int64_t* st = step->ptr<int64_t>();
  for (int64_t i = 0; i < B; ++i) {
    if (!(tp[i] >= 0.f && tp[i] <= FLT_MAX))
      fail(at("temperature", i) + " = " + num(tp[i]) + " must be finite and >= 0 (0 = greedy)");
    if (tk[i] < -1)
      fail(at("top_k", i) + " = " + std::to_string(tk[i]) + " must be -1 or 0 (off) or >= 1");
    if (!(pp[i] > 0.f && pp[i] <= 1.f))
      fail(at("top_p", i) + " = " + num(pp[i]) + " is out of range (0, 1] (1 = off)");
    if (st[i] < 0) fail(at("step", i) + " = " + std::to_string(st[i]) + " must be >= 0");
  }
  if (rep) {
    const float* r = rep->ptr<float>();
    for (int64_t i = 0; i < B; ++i)
      if (!(r[i] > 0.f && r[i] <= FLT_MAX))
        fail(at("repetition_penalty", i) + " = " + num(r[i]) + " must be finite and > 0 (1 = off)");
  }
  for (auto* pen : {&presence, &frequency}) {
    if (!*pen) continue;
    const float* r = (*pen)->ptr<float>();
    for (int64_t i = 0; i < B; ++i)
      if (!std::isfinite(r[i])) fail(at((*pen)->name().c_str(), i) + " = " + num(r[i]) + " must be finite");
  }

  const int64_t max_n = std::min<int64_t>(kc::kMaxTopLogprobs, V);
  if (num_logprobs < 0 || num_logprobs > max_n)
    fail("num_logprobs = " + std::to_string(num_logprobs) + " is out of range [0, " + std::to_string(max_n) +
         "] (at most " + std::to_string(kc::kMaxTopLogprobs) + " and at most vocab_size)");
  Tensor out_tokens(out_tokens_obj, "out_tokens"), out_logprobs(out_logprobs_obj, "out_logprobs");
  Tensor out_top_logprobs(out_top_logprobs_obj, "out_top_logprobs"), out_top_ids(out_top_ids_obj, "out_top_ids");
  out_tokens.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, B, "batch size");
  out_logprobs.expect(ElemType::kFloat32).expect_ndim(1).expect_contiguous().expect_size(0, B, "batch size");
  out_top_logprobs.expect(ElemType::kFloat32).expect_ndim(2);
  out_top_logprobs.expect_size(0, B, "batch size").expect_size(1, num_logprobs, "num_logprobs");
  out_top_ids.expect(ElemType::kInt64).expect_ndim(2);
  out_top_ids.expect_size(0, B, "batch size").expect_size(1, num_logprobs, "num_logprobs");
  out_top_logprobs.expect_contiguous();
  out_top_ids.expect_contiguous();

  auto data_or_null = [](const std::optional<Tensor>& t) -> const void* { return t ? t->data() : nullptr; };
  kc::SampleArgs args{};
  args.logits = logits.data();
  args.logits_row_stride = logits.stride(0);
  args.num_rows = B;
  args.vocab_size = V;
  args.dtype = dtype;
  args.temperature = tp;
  args.top_k = tk;
  args.top_p = pp;
  args.repetition_penalty = static_cast<const float*>(data_or_null(rep));
  args.presence_penalty = static_cast<const float*>(data_or_null(presence));
  args.frequency_penalty = static_cast<const float*>(data_or_null(frequency));
  args.seed = seed->ptr<int64_t>();
  args.step = st;
  args.prompt_tokens = static_cast<const int64_t*>(data_or_null(prompt_tokens));
  args.prompt_offsets = static_cast<const int64_t*>(data_or_null(prompt_offsets));
  args.output_tokens = static_cast<const int64_t*>(data_or_null(output_tokens));
  args.output_offsets = static_cast<const int64_t*>(data_or_null(output_offsets));
  args.out_tokens = out_tokens.ptr<int64_t>();
  args.out_logprobs = out_logprobs.ptr<float>();
  args.num_top_logprobs = static_cast<int>(num_logprobs);
  args.out_top_logprobs = out_top_logprobs.ptr<float>();
  args.out_top_ids = out_top_ids.ptr<int64_t>();
  if (B == 0) return;
  py::gil_scoped_release nogil;
  kc::sample(args);
}

}  // namespace

void bind_sampling(py::module_& m) {
  m.attr("MAX_TOP_LOGPROBS") = kc::kMaxTopLogprobs;
  m.def("sample", &sample, py::arg("out_tokens"), py::arg("out_logprobs"), py::arg("out_top_logprobs"),
        py::arg("out_top_ids"), py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"),
        py::arg("seed"), py::arg("step"), py::arg("repetition_penalty").none(true),
        py::arg("presence_penalty").none(true), py::arg("frequency_penalty").none(true),
        py::arg("prompt_tokens").none(true), py::arg("prompt_offsets").none(true),
        py::arg("output_tokens").none(true), py::arg("output_offsets").none(true), py::arg("num_logprobs"),
        "Samples one token per row of logits [B, V] (float32/bfloat16) with per-row temperature "
        "(float32, 0 = greedy), top_k (int32, -1/0 = off), top_p (float32 in (0, 1]), seed and step "
        "(int64; Philox4x32-10 keyed by seed, counter = step), optional repetition/presence/frequency "
        "penalties (float32 [B] or None) over CSR token lists (int64 tokens + int64 offsets [B + 1]). "
        "Writes out_tokens int64 [B], out_logprobs float32 [B] and the top num_logprobs (<= 20) "
        "log-probabilities/ids [B, num_logprobs], all of the RAW logits (log_softmax before penalties "
        "and temperature).");
}

}  // namespace mindie::host
