#include <memory>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "cpu/llama_forward.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

constexpr int kGgmlF32 = 0, kGgmlBF16 = 30;

// The weights' buffers stay referenced here for as long as the C++ step that reads them lives.
class LlamaForwardHandle {
 public:
  LlamaForwardHandle(const py::dict& shape, const py::list& layers, const py::tuple& embed, const py::tuple& lm_head,
                     py::handle final_norm) {
    kc::LlamaShape s{};
    s.hidden = shape["hidden"].cast<int64_t>();
    s.intermediate = shape["intermediate"].cast<int64_t>();
    s.vocab = shape["vocab"].cast<int64_t>();
    s.heads = shape["heads"].cast<int>();
    s.kv_heads = shape["kv_heads"].cast<int>();
    s.head_dim = shape["head_dim"].cast<int>();
    s.eps = shape["eps"].cast<float>();
    s.attn_scale = shape["attn_scale"].cast<float>();
    s.block_size = shape["block_size"].cast<int>();
    s.kv_dtype = shape["kv_dtype"].cast<std::string>() == "bfloat16" ? DType::kBFloat16 : DType::kFloat32;
    s.bf16_prompts = shape["bf16_prompts"].cast<bool>();
    s.activation_planes = shape.attr("get")("activation_planes", 2).cast<int>();
    if (s.activation_planes != 1 && s.activation_planes != 2)
      fail("activation_planes must be 1 or 2, got " + std::to_string(s.activation_planes));
    s.expert_intermediate = shape.attr("get")("expert_intermediate", 0).cast<int64_t>();
    s.experts_per_tok = shape.attr("get")("experts_per_tok", 0).cast<int>();
    s.norm_topk_prob = shape.attr("get")("norm_topk_prob", true).cast<bool>();
    // optional keys (Gemma 3), absent for a Llama-shaped model
    s.gelu = shape.attr("get")("gelu", false).cast<bool>();
    s.embed_scale = shape.attr("get")("embed_scale", 1.0).cast<float>();
    s.attn_softcap = shape.attr("get")("attn_softcap", 0.0).cast<float>();
    s.final_softcap = shape.attr("get")("final_softcap", 0.0).cast<float>();
    Tensor cos_sin(shape["cos_sin"], "cos_sin");
    cos_sin.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous();
    // The table's width is how many dimensions of a head rotate (Phi-3: partial rotary), as in _C.rotary_embedding
    s.rotary_dim = static_cast<int>(cos_sin.size(1));
    if (s.rotary_dim < 2 || s.rotary_dim % 2 != 0 || s.rotary_dim > s.head_dim)
      fail("cos_sin: its width (the rotary dimensions) must be even and in [2, head_dim=" +
           std::to_string(s.head_dim) + "], got " + std::to_string(s.rotary_dim));
    s.cos_sin = cos_sin.ptr<float>();
    s.max_position = cos_sin.size(0);
    keep(shape["cos_sin"]);
    std::vector<kc::LlamaLayerWeights> ls;
    for (py::handle item : layers) {
      py::dict d = py::reinterpret_borrow<py::dict>(item);
      kc::LlamaLayerWeights l{};
      l.input_norm = vector(d["input_norm"], s.hidden, "input_norm");
      l.post_norm = vector(d["post_norm"], s.hidden, "post_norm");
      l.q = matrix(d["q"], "q_proj");
      l.k = matrix(d["k"], "k_proj");
      l.v = matrix(d["v"], "v_proj");
      l.o = matrix(d["o"], "o_proj");
      // an MoE layer has "router" and "experts" (per expert a (gate, up, down) of matrix specs) instead
      if (!d.attr("get")("router").is_none()) {
        l.router = matrix(d["router"], "router");
        for (py::handle expert : d["experts"]) {
          py::tuple g_u_d = py::reinterpret_borrow<py::tuple>(expert);
          l.expert_gate.push_back(matrix(g_u_d[0], "expert gate_proj"));
          l.expert_up.push_back(matrix(g_u_d[1], "expert up_proj"));
          l.expert_down.push_back(matrix(g_u_d[2], "expert down_proj"));
        }
      } else {
        l.gate = matrix(d["gate"], "gate_proj");
        l.up = matrix(d["up"], "up_proj");
        l.down = matrix(d["down"], "down_proj");
      }
      if (!d["q_bias"].is_none()) {
        l.q_bias = vector(d["q_bias"], l.q.rows, "q_bias");
        l.k_bias = vector(d["k_bias"], l.k.rows, "k_bias");
        l.v_bias = vector(d["v_bias"], l.v.rows, "v_bias");
      }
      // optional keys: a layer spec without them (or with None) has no q/k head norm
      if (!d.attr("get")("q_norm").is_none()) l.q_norm = vector(d["q_norm"], s.head_dim, "q_norm");
      if (!d.attr("get")("k_norm").is_none()) l.k_norm = vector(d["k_norm"], s.head_dim, "k_norm");
      if (!d.attr("get")("post_attn_norm").is_none()) l.post_attn_norm = vector(d["post_attn_norm"], s.hidden, "post_attn_norm");
      if (!d.attr("get")("post_ffn_norm").is_none()) l.post_ffn_norm = vector(d["post_ffn_norm"], s.hidden, "post_ffn_norm");
      l.window = d.attr("get")("window", 0).cast<int>();
      if (l.window < 0) fail("window must be >= 0");
      if (!d.attr("get")("cos_sin").is_none()) {
        Tensor table(d["cos_sin"], "layer cos_sin");
        table.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(1, s.rotary_dim, "rotary_dim")
            .expect_size(0, s.max_position, "the shape's cos_sin rows");
        keep(d["cos_sin"]);
        l.cos_sin = table.ptr<float>();
      }
      ls.push_back(l);
    }
    const float* norm = vector(final_norm, s.hidden, "final_norm");
    shape_ = s;
    try {
      step_ = std::make_unique<kc::LlamaForward>(s, std::move(ls), matrix(embed, "token embedding"),
                                                 matrix(lm_head, "lm_head"), norm);
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }

  void set_kv_caches(const py::list& keys, const py::list& values) {
    std::vector<void*> k, v;
    cache_refs_.clear();
    for (size_t i = 0; i < keys.size(); ++i) {
      for (auto [list, out] : {std::pair{&keys, &k}, std::pair{&values, &v}}) {
        Tensor c((*list)[i], "kv cache");
        c.expect_ndim(4).expect_contiguous().expect_size(1, shape_.block_size, "block_size")
            .expect_size(2, shape_.kv_heads, "kv_heads").expect_size(3, shape_.head_dim, "head_dim");
        if (c.float_dtype() != shape_.kv_dtype) fail("kv cache: dtype differs from the model's kv dtype");
        if (num_slots_ != 0 && num_slots_ != c.size(0) * shape_.block_size) fail("kv caches differ in size");
        num_slots_ = c.size(0) * shape_.block_size;
        out->push_back(c.data());
        cache_refs_.push_back(py::reinterpret_borrow<py::object>((*list)[i]));
      }
    }
    try {
      step_->set_kv_caches(std::move(k), std::move(v));
    } catch (const std::invalid_argument& e) {
      fail(e.what());
    }
  }

  void run(py::handle logits_obj, py::handle ids_obj, py::handle pos_obj, py::handle slots_obj, py::handle tables_obj,
           py::handle starts_obj, py::handle lens_obj, py::handle rows_obj, py::handle prompt_lens_obj,
           py::handle rope_obj, py::handle media_rows_obj, py::handle media_embeds_obj) {
    Tensor logits(logits_obj, "logits"), ids(ids_obj, "input_ids"), pos(pos_obj, "positions"),
        slots(slots_obj, "slot_mapping"), tables(tables_obj, "block_tables"), starts(starts_obj, "query_start_loc"),
        lens(lens_obj, "seq_lens"), rows(rows_obj, "logits_indices");
    ids.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous();
    const int64_t T = ids.size(0);
    pos.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, T, "tokens");
    slots.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, T, "tokens");
    tables.expect(ElemType::kInt32).expect_ndim(2).expect_contiguous();
    const int64_t S = tables.size(0), width = tables.size(1);
    starts.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous().expect_size(0, S + 1, "sequences + 1");
    lens.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous().expect_size(0, S, "sequences");
    rows.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous();
    const int64_t R = rows.size(0);
    logits.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, R, "logits rows")
        .expect_size(1, shape_.vocab, "vocab");
    if (num_slots_ == 0) fail("set_kv_caches must be called before run");
    for (int64_t t = 0; t < T; ++t) {
      if (ids.ptr<int64_t>()[t] < 0 || ids.ptr<int64_t>()[t] >= shape_.vocab) fail("input_ids: id out of vocab");
      if (pos.ptr<int64_t>()[t] < 0 || pos.ptr<int64_t>()[t] >= shape_.max_position) fail("positions: out of range");
      if (slots.ptr<int64_t>()[t] < 0 || slots.ptr<int64_t>()[t] >= num_slots_) fail("slot_mapping: out of range");
    }
    const int32_t* st = starts.ptr<int32_t>();
    if (st[0] != 0 || st[S] != T) fail("query_start_loc: must start at 0 and end at the token count");
    const int64_t num_blocks = num_slots_ / shape_.block_size;
    for (int64_t s = 0; s < S; ++s) {
      const int32_t q_len = st[s + 1] - st[s], len = lens.ptr<int32_t>()[s];
      if (q_len < 0 || len < q_len || (len + shape_.block_size - 1) / shape_.block_size > width)
        fail("seq_lens / query_start_loc: inconsistent with the block table");
      for (int64_t i = 0; i < (len + shape_.block_size - 1) / shape_.block_size; ++i) {
        const int32_t blk = tables.ptr<int32_t>()[s * width + i];
        if (blk < 0 || blk >= num_blocks) fail("block_tables: block id out of range");
      }
    }
    for (int64_t r = 0; r < R; ++r)
      if (rows.ptr<int64_t>()[r] < 0 || rows.ptr<int64_t>()[r] >= T) fail("logits_indices: out of range");
    const int32_t* prompt_lens = nullptr;
    if (!prompt_lens_obj.is_none()) {
      Tensor pl(prompt_lens_obj, "prompt_lens");
      pl.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous().expect_size(0, S, "sequences");
      prompt_lens = pl.ptr<int32_t>();
    }
    kc::LlamaBatch b{ids.ptr<int64_t>(), T, pos.ptr<int64_t>(), slots.ptr<int64_t>(), tables.ptr<int32_t>(), width,
                     st, lens.ptr<int32_t>(), S, rows.ptr<int64_t>(), R, logits.ptr<float>(), prompt_lens};
    if (!rope_obj.is_none()) {
      Tensor rope(rope_obj, "rope_cos_sin");
      rope.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, T, "tokens")
          .expect_size(1, shape_.rotary_dim, "the cos_sin table's width");
      b.rope_rows = rope.ptr<float>();
    }
    if (media_rows_obj.is_none() != media_embeds_obj.is_none()) fail("media_rows and media_embeds go together");
    if (!media_rows_obj.is_none()) {
      Tensor mrows(media_rows_obj, "media_rows"), membeds(media_embeds_obj, "media_embeds");
      mrows.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous();
      const int64_t k = mrows.size(0);
      membeds.expect(ElemType::kFloat32).expect_ndim(2).expect_contiguous().expect_size(0, k, "media rows")
          .expect_size(1, shape_.hidden, "hidden");
      for (int64_t r = 0; r < k; ++r)
        if (mrows.ptr<int64_t>()[r] < 0 || mrows.ptr<int64_t>()[r] >= T) fail("media_rows: out of range");
      b.media_rows = mrows.ptr<int64_t>();
      b.media_embeds = membeds.ptr<float>();
      b.num_media_rows = k;
    }
    py::gil_scoped_release nogil;
    step_->run(b);
  }

  std::vector<std::vector<int32_t>> last_step_experts() { return step_->last_step_experts(); }

 private:
  void keep(py::handle obj) { refs_.push_back(py::reinterpret_borrow<py::object>(obj)); }

  const float* vector(py::handle obj, int64_t n, const char* name) {
    Tensor t(obj, name);
    t.expect(ElemType::kFloat32).expect_ndim(1).expect_contiguous().expect_size(0, n, "size");
    keep(obj);
    return t.ptr<float>();
  }

  // (ggml_type, data, cols, rows, packed): F32 / BF16 dense [rows, cols], or GGUF blocks
  // [rows, row_bytes] uint8, or (packed) blocks packed in panels of 16 rows (pack_panels).
  kc::WeightMatrix matrix(py::handle spec, const char* name) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(spec);
    const int type = t[0].cast<int>();
    const int64_t cols = t[2].cast<int64_t>();
    keep(t[1]);
    kc::WeightMatrix w;
    w.cols = cols;
    if (type == kGgmlF32 || type == kGgmlBF16) {
      Tensor d(t[1], name);
      d.expect(type == kGgmlF32 ? ElemType::kFloat32 : ElemType::kBFloat16).expect_ndim(2).expect_contiguous()
          .expect_size(1, cols, "columns");
      w.dense = d.data();
      w.dense_dtype = type == kGgmlF32 ? DType::kFloat32 : DType::kBFloat16;
      w.rows = d.size(0);
      return w;
    }
    w.quantized = true;
    w.q = quantized_matrix(t, name);
    w.rows = w.q.rows;
    return w;
  }

  kc::LlamaShape shape_{};
  std::unique_ptr<kc::LlamaForward> step_;
  std::vector<py::object> refs_, cache_refs_;
  int64_t num_slots_ = 0;
};

}  // namespace

void bind_forward(py::module_& m) {
  py::class_<LlamaForwardHandle>(m, "LlamaForward",
                                 "A Llama-family forward step in C++ over quantized (or dense) weights.")
      .def(py::init<const py::dict&, const py::list&, const py::tuple&, const py::tuple&, py::handle>(),
           py::arg("shape"), py::arg("layers"), py::arg("embed"), py::arg("lm_head"), py::arg("final_norm"))
      .def("set_kv_caches", &LlamaForwardHandle::set_kv_caches, py::arg("keys"), py::arg("values"))
      .def("last_step_experts", &LlamaForwardHandle::last_step_experts,
           "Per layer, the expert ids (ascending) the last step ran; empty lists for dense layers.")
      .def("run", &LlamaForwardHandle::run, py::arg("logits"), py::arg("input_ids"), py::arg("positions"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"),
           py::arg("logits_indices"), py::arg("prompt_lens") = py::none(), py::arg("rope_cos_sin") = py::none(),
           py::arg("media_rows") = py::none(), py::arg("media_embeds") = py::none(),
           "Runs one step; logits [len(logits_indices), vocab] float32 are written in place. prompt_lens "
           "(int32 [sequences]): a row whose position is below its sequence's is a prompt token. rope_cos_sin "
           "(float32 [tokens, rotary dims]): each row's own rotary cos/sin instead of the table's at its position; "
           "media_rows (int64 [k]) with media_embeds (float32 [k, hidden]): rows whose embedding is replaced.");
}

}  // namespace mindie::host
