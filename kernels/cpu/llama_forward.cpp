#include "cpu/llama_forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/kv_cache.h"
#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/moe.h"
#include "cpu/paged_attention.h"

namespace mindie::kernels::cpu {
namespace {

// Decode contexts split into fixed spans, whatever else is in the batch: the attention of a
// sequence must not depend on its neighbours.
constexpr int kAttentionPartition = 256;

void check_matrix(const WeightMatrix& w, int64_t rows, int64_t cols, const char* name) {
  if (w.rows != rows || w.cols != cols)
    throw std::invalid_argument(std::string(name) + ": expected [" + std::to_string(rows) + ", " +
                                std::to_string(cols) + "], got [" + std::to_string(w.rows) + ", " +
                                std::to_string(w.cols) + "]");
  if (w.quantized && cols % qformat_info(static_cast<int>(w.q.format)).block_elems != 0)
    throw std::invalid_argument(std::string(name) + ": columns are not a whole number of blocks");
}

}  // namespace

LlamaForward::LlamaForward(const LlamaShape& shape, std::vector<LlamaLayerWeights> layers, WeightMatrix embed,
                           WeightMatrix lm_head, const float* final_norm)
    : shape_(shape), layers_(std::move(layers)), embed_(embed), lm_head_(lm_head), final_norm_(final_norm) {
  const int64_t h = shape.hidden, qs = int64_t{shape.heads} * shape.head_dim, kvs = int64_t{shape.kv_heads} * shape.head_dim;
  if (h % 32 != 0 || shape.intermediate % 32 != 0 || qs % 32 != 0)
    throw std::invalid_argument("hidden, intermediate and heads * head_dim must be multiples of 32");
  check_matrix(embed_, shape.vocab, h, "token embedding");
  check_matrix(lm_head_, shape.vocab, h, "lm_head");
  for (const LlamaLayerWeights& l : layers_) {
    check_matrix(l.q, qs, h, "q_proj");
    check_matrix(l.k, kvs, h, "k_proj");
    check_matrix(l.v, kvs, h, "v_proj");
    check_matrix(l.o, h, qs, "o_proj");
    const size_t experts = l.expert_gate.size();
    if (experts == 0) {
      check_matrix(l.gate, shape.intermediate, h, "gate_proj");
      check_matrix(l.up, shape.intermediate, h, "up_proj");
      check_matrix(l.down, h, shape.intermediate, "down_proj");
      continue;
    }
    if (l.expert_up.size() != experts || l.expert_down.size() != experts)
      throw std::invalid_argument("every expert needs a gate, an up and a down projection");
    if (shape.experts_per_tok < 1 || static_cast<size_t>(shape.experts_per_tok) > experts)
      throw std::invalid_argument("experts_per_tok must be in [1, number of experts]");
    if (shape.expert_intermediate % 32 != 0)
      throw std::invalid_argument("expert_intermediate must be a multiple of 32");
    check_matrix(l.router, static_cast<int64_t>(experts), h, "router");
    for (size_t e = 0; e < experts; ++e) {
      check_matrix(l.expert_gate[e], shape.expert_intermediate, h, "expert gate_proj");
      check_matrix(l.expert_up[e], shape.expert_intermediate, h, "expert up_proj");
      check_matrix(l.expert_down[e], h, shape.expert_intermediate, "expert down_proj");
    }
    expert_rows_.resize(std::max(expert_rows_.size(), experts));
    expert_slots_.resize(expert_rows_.size());
  }
  last_experts_.resize(layers_.size());
}

std::vector<std::vector<int32_t>> LlamaForward::last_step_experts() {
  std::lock_guard<std::mutex> lk(mu_);
  return last_experts_;
}

void LlamaForward::set_kv_caches(std::vector<void*> keys, std::vector<void*> values) {
  if (keys.size() != layers_.size() || values.size() != layers_.size())
    throw std::invalid_argument("one K and one V cache per layer expected");
  std::lock_guard<std::mutex> lk(mu_);
  key_caches_ = std::move(keys);
  value_caches_ = std::move(values);
}

void LlamaForward::split_rows(const LlamaBatch& b) {
  RowForms& forms = token_forms_;
  forms.bf16.clear();
  forms.int8.clear();
  forms.all_bf16 = false;
  if (!shape_.bf16_prompts || b.prompt_lens == nullptr || !qmatmul_bf16_native()) return;
  for (int64_t seq = 0; seq < b.num_seqs; ++seq)
    for (int32_t t = b.query_start_loc[seq]; t < b.query_start_loc[seq + 1]; ++t)
      (b.positions[t] < b.prompt_lens[seq] ? forms.bf16 : forms.int8).push_back(t);
  forms.all_bf16 = forms.int8.empty();
  if (forms.bf16.empty() || forms.int8.empty()) {
    forms.bf16.clear();
    forms.int8.clear();
  }
}

void LlamaForward::qmatmul_rows(QMatmulArgs q, const float* x, int64_t k, const std::vector<int32_t>* rows, bool bf16) {
  if (rows != nullptr) {
    q.m = static_cast<int64_t>(rows->size());
    float* g = sized(gathered_, q.m * k);
    for (int64_t i = 0; i < q.m; ++i) std::memcpy(g + i * k, x + (*rows)[i] * k, k * sizeof(float));
    x = g;
    q.out_rows = rows->data();
  }
  if (bf16) {
    bf16_t* xb = sized(xb_, q.m * k);
    round_to_bf16({x, q.m, k, k, xb});
    q.xb = xb;
  } else {
    int8_t* xq = sized(xq_, 2 * q.m * k);
    float* xd = sized(xd_, q.m * k / 32);
    quantize_activations({x, q.m, k, k, xq, xd, shape_.activation_planes});
    q.xq = xq;
    q.xd = xd;
    q.planes = shape_.activation_planes;
  }
  qmatmul(q);
}

void LlamaForward::project(const float* x, int64_t m, int64_t k, const RowForms& forms,
                           std::initializer_list<Target> targets) {
  QMatmulArgs q{};
  q.m = m;
  q.k = k;
  for (const Target& t : targets) {
    if (t.w->quantized) {
      q.targets[q.num_targets++] = {t.w->q, t.bias, t.out, t.out_stride};
      continue;
    }
    linear({t.out, x, t.w->dense, nullptr, m, t.w->rows, k, k, t.out_stride, DType::kFloat32, t.w->dense_dtype});
    if (t.bias != nullptr)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < t.w->rows; ++i) t.out[r * t.out_stride + i] += t.bias[i];
  }
  if (q.num_targets == 0) return;
  if (forms.bf16.empty()) return qmatmul_rows(q, x, k, nullptr, forms.all_bf16);
  qmatmul_rows(q, x, k, &forms.int8, false);
  qmatmul_rows(q, x, k, &forms.bf16, true);
}

void LlamaForward::embed_rows(const LlamaBatch& b) {
  const int64_t h = shape_.hidden;
  float* out = sized(hidden_, b.tokens * h);
  if (embed_.quantized) {
    int32_t* ids = sized(ids_, b.tokens);
    for (int64_t t = 0; t < b.tokens; ++t) ids[t] = static_cast<int32_t>(b.input_ids[t]);
    dequantize_rows({embed_.q, 0, b.tokens, out, h, ids});
    return;
  }
  for (int64_t t = 0; t < b.tokens; ++t) {
    float* row = out + t * h;
    if (embed_.dense_dtype == DType::kFloat32) {
      std::memcpy(row, static_cast<const float*>(embed_.dense) + b.input_ids[t] * h, h * sizeof(float));
    } else {
      const bf16_t* src = static_cast<const bf16_t*>(embed_.dense) + b.input_ids[t] * h;
      for (int64_t i = 0; i < h; ++i) row[i] = bf16_to_float(src[i]);
    }
  }
}

void LlamaForward::moe_mlp(size_t li, const float* x, int64_t T, float* out) {
  const LlamaLayerWeights& L = layers_[li];
  const int E = static_cast<int>(L.expert_gate.size()), K = shape_.experts_per_tok;
  const int64_t h = shape_.hidden, ie = shape_.expert_intermediate;
  float* logits = sized(router_logits_, T * E);
  project(x, T, h, RowForms{}, {{&L.router, nullptr, logits, E}});
  float* weights = sized(route_weights_, T * K);
  int32_t* ids = sized(route_ids_, T * K);
  moe_route({logits, T, E, K, E, shape_.norm_topk_prob, weights, ids});
  for (int e = 0; e < E; ++e) {
    expert_rows_[e].clear();
    expert_slots_[e].clear();
  }
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < K; ++j) {
      expert_rows_[ids[t * K + j]].push_back(static_cast<int32_t>(t));
      expert_slots_[ids[t * K + j]].push_back(static_cast<int32_t>(t * K + j));
    }
  // A row takes the same form (bf16 or int8) in its experts as in the rest of the layer.
  std::vector<char> row_bf16(T, token_forms_.all_bf16 ? 1 : 0);
  for (int32_t t : token_forms_.bf16) row_bf16[t] = 1;
  float* y = sized(routed_y_, T * K * h);
  last_experts_[li].clear();
  bool batched = std::find(row_bf16.begin(), row_bf16.end(), 1) == row_bf16.end();
  for (int e = 0; e < E; ++e) {
    if (expert_rows_[e].empty()) continue;  // never touched: its bytes are not read
    last_experts_[li].push_back(e);
    batched = batched && L.expert_gate[e].quantized && L.expert_up[e].quantized && L.expert_down[e].quantized;
  }
  if (batched) {
    routed_experts_batched(L, x, y);
  } else {
    for (int e : last_experts_[li]) {
      const std::vector<int32_t>& rows = expert_rows_[e];
      const int64_t n = static_cast<int64_t>(rows.size());
      RowForms forms;
      for (int64_t c = 0; c < n; ++c) (row_bf16[rows[c]] ? forms.bf16 : forms.int8).push_back(static_cast<int32_t>(c));
      forms.all_bf16 = forms.int8.empty();
      if (forms.bf16.empty() || forms.int8.empty()) {
        forms.bf16.clear();
        forms.int8.clear();
      }
      float* xe = sized(expert_x_, n * h);
      for (int64_t c = 0; c < n; ++c) std::memcpy(xe + c * h, x + rows[c] * h, h * sizeof(float));
      float* gate_up = sized(expert_gate_up_, n * 2 * ie);
      project(xe, n, h, forms, {{&L.expert_gate[e], nullptr, gate_up, 2 * ie}, {&L.expert_up[e], nullptr, gate_up + ie, 2 * ie}});
      float* act = sized(expert_act_, n * ie);
      silu_and_mul({act, gate_up, n, ie, 2 * ie, ie, DType::kFloat32});
      float* ye = sized(expert_y_, n * h);
      project(act, n, ie, forms, {{&L.expert_down[e], nullptr, ye, h}});
      for (int64_t c = 0; c < n; ++c) std::memcpy(y + expert_slots_[e][c] * h, ye + c * h, h * sizeof(float));
    }
  }
  moe_combine({y, weights, ids, T, K, h, out, h});
}

void LlamaForward::routed_experts_batched(const LlamaLayerWeights& L, const float* x, float* y) {
  const int64_t h = shape_.hidden, ie = shape_.expert_intermediate;
  // The routed experts' rows stacked in expert order, as int8 rows: expert e's n rows from offset[e].
  std::vector<int> experts;
  std::vector<int64_t> offset;
  int64_t rows = 0;
  for (int e = 0; e < static_cast<int>(expert_rows_.size()); ++e) {
    if (expert_rows_[e].empty()) continue;
    experts.push_back(e);
    offset.push_back(rows);
    rows += static_cast<int64_t>(expert_rows_[e].size());
  }
  float* xs = sized(expert_x_, rows * h);
  for (size_t i = 0; i < experts.size(); ++i)
    for (size_t c = 0; c < expert_rows_[experts[i]].size(); ++c)
      std::memcpy(xs + (offset[i] + static_cast<int64_t>(c)) * h, x + expert_rows_[experts[i]][c] * h, h * sizeof(float));
  float* gate_up = sized(expert_gate_up_, rows * 2 * ie);
  float* act = sized(expert_act_, rows * ie);
  float* ys = sized(expert_y_, rows * h);
  // `each(i, args)` fills one expert's call; the calls run in batches of experts with one row count.
  const auto run_batches = [&](const float* in, int64_t k, auto&& each) {
    int8_t* q = sized(xq_, 2 * rows * k);
    float* d = sized(xd_, rows * k / 32);
    quantize_activations({in, rows, k, k, q, d, shape_.activation_planes});
    std::vector<QMatmulArgs> calls;
    std::vector<char> done(experts.size(), 0);
    for (size_t i = 0; i < experts.size(); ++i) {
      if (done[i]) continue;
      const int64_t n = static_cast<int64_t>(expert_rows_[experts[i]].size());
      calls.clear();
      for (size_t j = i; j < experts.size() && calls.size() < kMaxQMatmulBatch; ++j) {
        if (done[j] || static_cast<int64_t>(expert_rows_[experts[j]].size()) != n) continue;
        done[j] = 1;
        QMatmulArgs a{};
        a.m = n;
        a.k = k;
        a.xq = q + offset[j] * 2 * k;
        a.xd = d + offset[j] * k / 32;
        a.planes = shape_.activation_planes;
        each(j, a);
        calls.push_back(a);
      }
      qmatmul_batch({calls.data(), static_cast<int>(calls.size())});
    }
  };
  run_batches(xs, h, [&](size_t j, QMatmulArgs& a) {
    float* out = gate_up + offset[j] * 2 * ie;
    a.targets[0] = {L.expert_gate[experts[j]].q, nullptr, out, 2 * ie};
    a.targets[1] = {L.expert_up[experts[j]].q, nullptr, out + ie, 2 * ie};
    a.num_targets = 2;
  });
  silu_and_mul({act, gate_up, rows, ie, 2 * ie, ie, DType::kFloat32});
  run_batches(act, ie, [&](size_t j, QMatmulArgs& a) {
    a.targets[0] = {L.expert_down[experts[j]].q, nullptr, ys + offset[j] * h, h};
    a.num_targets = 1;
  });
  for (size_t i = 0; i < experts.size(); ++i)
    for (size_t c = 0; c < expert_slots_[experts[i]].size(); ++c)
      std::memcpy(y + expert_slots_[experts[i]][c] * h, ys + (offset[i] + static_cast<int64_t>(c)) * h, h * sizeof(float));
}

void LlamaForward::run(const LlamaBatch& b) {
  std::lock_guard<std::mutex> lk(mu_);
  if (key_caches_.size() != layers_.size()) throw std::logic_error("set_kv_caches must be called before run");
  const LlamaShape& s = shape_;
  const int64_t T = b.tokens, h = s.hidden, inter = s.intermediate;
  const int64_t qsz = int64_t{s.heads} * s.head_dim, kvsz = int64_t{s.kv_heads} * s.head_dim;
  const int64_t qkv_w = qsz + 2 * kvsz;
  embed_rows(b);
  float* hidden = sized(hidden_, T * h);
  float* residual = sized(residual_, T * h);
  float* x = sized(x_, T * h);
  float* qkv = sized(qkv_, T * qkv_w);
  float* attn = sized(attn_, T * qsz);
  float* gate_up = sized(gate_up_, T * 2 * inter);
  float* act = sized(act_, T * inter);
  if (s.embed_scale != 1.f)  // before the media rows, which come scaled as they are
    for (int64_t i = 0; i < T * h; ++i) hidden[i] *= s.embed_scale;
  for (int64_t r = 0; r < b.num_media_rows; ++r)
    std::memcpy(hidden + b.media_rows[r] * h, b.media_embeds + r * h, h * sizeof(float));
  std::memcpy(residual, hidden, T * h * sizeof(float));
  split_rows(b);
  const int64_t* rope_positions = b.positions;
  const float* rope_table = s.cos_sin;
  if (b.rope_rows != nullptr) {  // row t rotates by rope_rows[t]
    int64_t* index = sized(row_index_, T);
    for (int64_t t = 0; t < T; ++t) index[t] = t;
    rope_positions = index;
    rope_table = b.rope_rows;
  }
  const RowForms& forms = token_forms_;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const LlamaLayerWeights& L = layers_[li];
    // Layer 0 normalises the embedding (already in the residual); later layers add their input first.
    rms_norm({x, li == 0 ? residual : hidden, li == 0 ? nullptr : residual, L.input_norm, T, h, h, h, h, s.eps,
              DType::kFloat32, DType::kFloat32});
    project(x, T, h, forms, {{&L.q, L.q_bias, qkv, qkv_w}, {&L.k, L.k_bias, qkv + qsz, qkv_w},
                      {&L.v, L.v_bias, qkv + qsz + kvsz, qkv_w}});
    if (L.q_norm != nullptr)
      head_rms_norm({qkv, L.q_norm, T, s.heads, s.head_dim, qkv_w, s.eps, DType::kFloat32, DType::kFloat32});
    if (L.k_norm != nullptr)
      head_rms_norm({qkv + qsz, L.k_norm, T, s.kv_heads, s.head_dim, qkv_w, s.eps, DType::kFloat32, DType::kFloat32});
    const float* table = b.rope_rows == nullptr && L.cos_sin != nullptr ? L.cos_sin : rope_table;
    rotary_embedding({rope_positions, qkv, qkv + qsz, table, T, s.heads, s.kv_heads, s.head_dim, s.rotary_dim,
                      qkv_w, qkv_w, true, DType::kFloat32});
    reshape_and_cache({qkv + qsz, qkv + qsz + kvsz, qkv_w, qkv_w, key_caches_[li], value_caches_[li], b.slot_mapping,
                       T, s.block_size, s.kv_heads, s.head_dim, DType::kFloat32, s.kv_dtype});
    paged_attention({qkv, qkv_w, key_caches_[li], value_caches_[li], b.block_tables, b.block_table_stride,
                     b.query_start_loc, b.seq_lens, attn, qsz, b.num_seqs, s.heads, s.kv_heads, s.head_dim,
                     s.block_size, s.attn_scale, kAttentionPartition, DType::kFloat32, s.kv_dtype, L.window,
                     s.attn_softcap});
    project(attn, T, qsz, forms, {{&L.o, nullptr, hidden, h}});
    if (L.post_attn_norm != nullptr)
      rms_norm({hidden, hidden, nullptr, L.post_attn_norm, T, h, h, h, h, s.eps, DType::kFloat32, DType::kFloat32});
    rms_norm({x, hidden, residual, L.post_norm, T, h, h, h, h, s.eps, DType::kFloat32, DType::kFloat32});
    if (!L.expert_gate.empty()) {
      moe_mlp(li, x, T, hidden);
    } else {
      project(x, T, h, forms, {{&L.gate, nullptr, gate_up, 2 * inter}, {&L.up, nullptr, gate_up + inter, 2 * inter}});
      (s.gelu ? gelu_tanh_and_mul : silu_and_mul)({act, gate_up, T, inter, 2 * inter, inter, DType::kFloat32});
      project(act, T, inter, forms, {{&L.down, nullptr, hidden, h}});
    }
    if (L.post_ffn_norm != nullptr)
      rms_norm({hidden, hidden, nullptr, L.post_ffn_norm, T, h, h, h, h, s.eps, DType::kFloat32, DType::kFloat32});
  }
  const int64_t R = b.num_logits;
  float* fx = sized(final_x_, R * h);
  float* fres = sized(final_res_, R * h);
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(fx + r * h, hidden + b.logits_indices[r] * h, h * sizeof(float));
    std::memcpy(fres + r * h, residual + b.logits_indices[r] * h, h * sizeof(float));
  }
  rms_norm({fx, fx, fres, final_norm_, R, h, h, h, h, s.eps, DType::kFloat32, DType::kFloat32});
  // Logits rows are int8 whatever their token: usually one per prompt, which would not repay
  // rounding the whole lm_head to bf16 panels.
  project(fx, R, h, RowForms{}, {{&lm_head_, nullptr, b.logits, s.vocab}});
  if (s.final_softcap > 0.f)
    for (int64_t i = 0; i < R * s.vocab; ++i) b.logits[i] = s.final_softcap * std::tanh(b.logits[i] / s.final_softcap);
}

}  // namespace mindie::kernels::cpu
