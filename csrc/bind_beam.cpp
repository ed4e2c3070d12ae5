#include <algorithm>
#include <cmath>
#include <string>

#include "bindings.h"
#include "cpu/beam_search.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

const Tensor& grid(const Tensor& t, ElemType e, int64_t G, int64_t W) {
  t.expect(e).expect_ndim(2).expect_contiguous().expect_size(0, G, "num_groups").expect_size(1, W, "beam_width");
  return t;
}

kc::EarlyStopping parse_early_stopping(py::handle obj) {
  if (py::isinstance<py::bool_>(obj)) return obj.cast<bool>() ? kc::EarlyStopping::kTrue : kc::EarlyStopping::kFalse;
  if (py::isinstance<py::str>(obj) && obj.cast<std::string>() == "never") return kc::EarlyStopping::kNever;
  fail("early_stopping must be True, False or 'never', got " + std::string(py::repr(obj)));
}

void beam_search_step(py::handle logprobs_obj, py::handle beam_scores_obj, py::handle eos_obj, int64_t cur_len,
                      double length_penalty, py::handle early_stopping_obj, int64_t max_len,
                      int64_t pad_token_id, py::handle hyp_scores_obj, py::handle hyp_order_obj,
                      py::handle num_hyps_obj, py::handle worst_score_obj, py::handle done_obj,
                      py::handle next_parents_obj, py::handle next_tokens_obj, py::handle next_scores_obj,
                      py::handle fin_parents_obj, py::handle fin_tokens_obj, py::handle fin_logprobs_obj,
                      py::handle fin_scores_obj, py::handle fin_slots_obj, py::handle fin_count_obj) {
  Tensor hyp_scores(hyp_scores_obj, "hyp_scores");
  hyp_scores.expect_ndim(2).expect_contiguous();
  hyp_scores.expect(ElemType::kFloat64);
  const int64_t G = hyp_scores.size(0), W = hyp_scores.size(1);
  if (W < 1) fail("hyp_scores: beam_width (dimension 1) must be >= 1, got shape " + shape_str(hyp_scores));

  Tensor logprobs(logprobs_obj, "logprobs");
  logprobs.expect(ElemType::kFloat32).expect_ndim(2).expect_inner_contiguous(1);
  logprobs.expect_size(0, G * W, "num_groups * beam_width");
  const int64_t V = logprobs.size(1);
  Tensor beam_scores(beam_scores_obj, "beam_scores");
  beam_scores.expect(ElemType::kFloat32).expect_ndim(1).expect_contiguous();
  beam_scores.expect_size(0, G * W, "num_groups * beam_width");
  const float* bs = beam_scores.ptr<float>();
  for (int64_t i = 0; i < G * W; ++i)
    if (std::isnan(bs[i]) || bs[i] == INFINITY)
      fail("beam_scores[" + std::to_string(i) + "] must not be NaN or +inf (use -inf or -1e9 for an unused beam)");

  Tensor eos(eos_obj, "eos_token_ids");
  eos.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous();
  const int64_t num_eos = eos.size(0);
  const int64_t* e = eos.ptr<int64_t>();
  for (int64_t i = 0; i < num_eos; ++i)
    if (e[i] < 0 || e[i] >= V)
      fail("eos_token_ids[" + std::to_string(i) + "] = " + std::to_string(e[i]) + " is out of range [0, " +
           std::to_string(V) + ") (vocab_size)");
  const int64_t need = std::max<int64_t>(2, 1 + num_eos);
  if (V < need)
    fail("logprobs: vocab_size = " + std::to_string(V) + " must be >= max(2, 1 + len(eos_token_ids)) = " +
         std::to_string(need));

  if (cur_len < 1) fail("cur_len = " + std::to_string(cur_len) + " must be >= 1 (generated length incl. this token)");
  if (!std::isfinite(length_penalty)) fail("length_penalty must be finite");
  const kc::EarlyStopping es = parse_early_stopping(early_stopping_obj);
  if (es == kc::EarlyStopping::kNever && length_penalty > 0.0 && max_len < 1)
    fail("max_len = " + std::to_string(max_len) +
         " must be >= 1 when early_stopping = 'never' and length_penalty > 0");

  Tensor hyp_order(hyp_order_obj, "hyp_order"), num_hyps(num_hyps_obj, "num_hyps");
  Tensor worst_score(worst_score_obj, "worst_score"), done(done_obj, "done");
  grid(hyp_order, ElemType::kInt64, G, W);
  num_hyps.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, G, "num_groups");
  worst_score.expect_ndim(1).expect_contiguous().expect_size(0, G, "num_groups");
  worst_score.expect(ElemType::kFloat64);
  done.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous().expect_size(0, G, "num_groups");
  const int64_t* nh = num_hyps.ptr<int64_t>();
  const int32_t* dn = done.ptr<int32_t>();
  for (int64_t g = 0; g < G; ++g) {
    if (nh[g] < 0 || nh[g] > W)
      fail("num_hyps[" + std::to_string(g) + "] = " + std::to_string(nh[g]) + " is out of range [0, " +
           std::to_string(W) + "]");
    if (dn[g] != 0 && dn[g] != 1) fail("done[" + std::to_string(g) + "] must be 0 or 1");
  }

  Tensor next_parents(next_parents_obj, "next_parents"), next_tokens(next_tokens_obj, "next_tokens");
  Tensor next_scores(next_scores_obj, "next_scores"), fin_parents(fin_parents_obj, "fin_parents");
  Tensor fin_tokens(fin_tokens_obj, "fin_tokens"), fin_logprobs(fin_logprobs_obj, "fin_logprobs");
  Tensor fin_scores(fin_scores_obj, "fin_scores"), fin_slots(fin_slots_obj, "fin_slots");
  Tensor fin_count(fin_count_obj, "fin_count");
  grid(next_parents, ElemType::kInt64, G, W);
  grid(next_tokens, ElemType::kInt64, G, W);
  grid(next_scores, ElemType::kFloat32, G, W);
  grid(fin_parents, ElemType::kInt64, G, W);
  grid(fin_tokens, ElemType::kInt64, G, W);
  grid(fin_logprobs, ElemType::kFloat32, G, W);
  fin_scores.expect_ndim(2).expect_contiguous().expect_size(0, G, "num_groups").expect_size(1, W, "beam_width");
  fin_scores.expect(ElemType::kFloat64);
  grid(fin_slots, ElemType::kInt64, G, W);
  fin_count.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, G, "num_groups");

  kc::BeamSearchArgs args{};
  args.logprobs = logprobs.ptr<float>();
  args.logprobs_row_stride = logprobs.stride(0);
  args.beam_scores = bs;
  args.num_groups = G;
  args.beam_width = W;
  args.vocab_size = V;
  args.eos_ids = e;
  args.num_eos = num_eos;
  args.pad_token = pad_token_id >= 0 ? pad_token_id : (num_eos > 0 ? e[0] : 0);
  args.cur_len = cur_len;
  args.max_len = max_len;
  args.length_penalty = length_penalty;
  args.early_stopping = es;
  args.hyp_scores = hyp_scores.ptr<double>();
  args.hyp_order = hyp_order.ptr<int64_t>();
  args.num_hyps = num_hyps.ptr<int64_t>();
  args.worst_score = worst_score.ptr<double>();
  args.done = done.ptr<int32_t>();
  args.next_parents = next_parents.ptr<int64_t>();
  args.next_tokens = next_tokens.ptr<int64_t>();
  args.next_scores = next_scores.ptr<float>();
  args.fin_parents = fin_parents.ptr<int64_t>();
  args.fin_tokens = fin_tokens.ptr<int64_t>();
  args.fin_logprobs = fin_logprobs.ptr<float>();
  args.fin_scores = fin_scores.ptr<double>();
  args.fin_slots = fin_slots.ptr<int64_t>();
  args.fin_count = fin_count.ptr<int64_t>();
  if (G == 0) return;
  py::gil_scoped_release nogil;
  kc::beam_search_step(args);
}

}  // namespace

void bind_beam(py::module_& m) {
  m.def("beam_search_step", &beam_search_step, py::arg("logprobs"), py::arg("beam_scores"),
        py::arg("eos_token_ids"), py::arg("cur_len"), py::arg("length_penalty"), py::arg("early_stopping"),
        py::arg("max_len"), py::arg("pad_token_id"), py::arg("hyp_scores"), py::arg("hyp_order"),
        py::arg("num_hyps"), py::arg("worst_score"), py::arg("done"), py::arg("next_parents"),
        py::arg("next_tokens"), py::arg("next_scores"), py::arg("fin_parents"), py::arg("fin_tokens"),
        py::arg("fin_logprobs"), py::arg("fin_scores"), py::arg("fin_slots"), py::arg("fin_count"),
        "One beam-search step for G groups of W beams with Hugging Face BeamSearchScorer semantics "
        "(pad_token_id < 0: the first EOS id pads groups already done): "
        "logprobs float32 [G*W, V] (log_softmax'ed), beam_scores float32 [G*W], eos_token_ids int64; "
        "finished-hypotheses state hyp_scores float64 [G, W], hyp_order int64 [G, W], num_hyps int64 [G], "
        "worst_score float64 [G], done int32 [G] (updated in place). Writes next_parents/next_tokens "
        "int64, next_scores float32, fin_parents/fin_tokens/fin_slots int64, fin_logprobs float32, "
        "fin_scores float64 (all [G, W]) and fin_count int64 [G].");
}

}  // namespace mindie::host
