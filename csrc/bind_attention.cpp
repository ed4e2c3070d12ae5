#include <cmath>

#include "bindings.h"
#include "cpu/paged_attention.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

void paged_attention(py::handle out_obj, py::handle query_obj, py::handle key_cache_obj,
                     py::handle value_cache_obj, py::handle block_tables_obj,
                     py::handle query_start_loc_obj, py::handle seq_lens_obj, double scale,
                     int partition_size, int window, double softcap) {
  Tensor out(out_obj, "out"), query(query_obj, "query");
  Tensor key_cache(key_cache_obj, "key_cache"), value_cache(value_cache_obj, "value_cache");
  Tensor tables(block_tables_obj, "block_tables"), qsl(query_start_loc_obj, "query_start_loc");
  Tensor lens(seq_lens_obj, "seq_lens");

  key_cache.expect_ndim(4).expect_contiguous();
  value_cache.expect_ndim(4).expect_contiguous();
  for (int i = 0; i < 4; ++i) value_cache.expect_size(i, key_cache.size(i), "must match key_cache");
  const DType kv_dtype = key_cache.float_dtype();
  if (value_cache.float_dtype() != kv_dtype) fail("value_cache: dtype must match key_cache");
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  if (block_size < 1 || kv_heads < 1 || head_dim < 1) fail("key_cache: every dimension but num_blocks must be >= 1");

  query.expect_ndim(3).expect_inner_contiguous(2).expect_size(2, head_dim, "head_dim of the cache");
  const DType q_dtype = query.float_dtype();
  const int64_t num_tokens = query.size(0), num_heads = query.size(1);
  if (num_heads % kv_heads != 0)
    fail("query: num_heads (" + std::to_string(num_heads) + ") must be a multiple of kv_heads (" +
         std::to_string(kv_heads) + ")");
  out.expect_ndim(3).expect_inner_contiguous(2);
  for (int i = 0; i < 3; ++i) out.expect_size(i, query.size(i), "must match query");
  if (out.float_dtype() != q_dtype) fail("out: dtype must match query");

  lens.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous();
  const int64_t num_seqs = lens.size(0);
  qsl.expect(ElemType::kInt32).expect_ndim(1).expect_contiguous().expect_size(0, num_seqs + 1, "num_seqs + 1");
  tables.expect(ElemType::kInt32).expect_ndim(2).expect_size(0, num_seqs, "num_seqs").expect_inner_contiguous(1);
  const int64_t max_blocks = tables.size(1);

  const int32_t* starts = qsl.ptr<int32_t>();
  const int32_t* seq_lens = lens.ptr<int32_t>();
  const int32_t* bt = tables.ptr<int32_t>();
  if (starts[0] != 0) fail("query_start_loc[0] must be 0");
  if (starts[num_seqs] != num_tokens)
    fail("query_start_loc[-1] must equal the number of query tokens (" + std::to_string(num_tokens) + ")");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const std::string at = "[" + std::to_string(s) + "]";
    const int64_t q_len = static_cast<int64_t>(starts[s + 1]) - starts[s];
    if (q_len < 0) fail("query_start_loc must be non-decreasing (at index " + std::to_string(s + 1) + ")");
    const int64_t ctx = seq_lens[s];
    if (ctx < q_len)
      fail("seq_lens" + at + " = " + std::to_string(ctx) + " is smaller than the sequence's " +
           std::to_string(q_len) + " query tokens");
    const int64_t used = (ctx + block_size - 1) / block_size;
    if (used > max_blocks)
      fail("seq_lens" + at + " = " + std::to_string(ctx) + " needs " + std::to_string(used) +
           " blocks but block_tables has " + std::to_string(max_blocks) + " columns");
    const int32_t* row = bt + s * tables.stride(0);
    for (int64_t b = 0; b < used; ++b)
      if (row[b] < 0 || row[b] >= num_blocks)
        fail("block_tables" + at + "[" + std::to_string(b) + "] = " + std::to_string(row[b]) +
             " is out of range [0, " + std::to_string(num_blocks) + ")");
  }
  if (!std::isfinite(scale) || scale <= 0) fail("scale must be a finite positive number");
  if (partition_size < 0) fail("partition_size must be >= 0 (0 chooses automatically)");
  if (window < 0) fail("window must be >= 0 (0: no sliding window)");
  if (!std::isfinite(softcap) || softcap < 0) fail("softcap must be a finite number >= 0 (0: off)");

  kc::PagedAttentionArgs args{query.data(), query.stride(0), key_cache.data(), value_cache.data(),
                              bt, tables.stride(0), starts, seq_lens, out.data(), out.stride(0),
                              num_seqs, static_cast<int>(num_heads), static_cast<int>(kv_heads),
                              static_cast<int>(head_dim), static_cast<int>(block_size),
                              static_cast<float>(scale), partition_size, q_dtype, kv_dtype, window,
                              static_cast<float>(softcap)};
  py::gil_scoped_release nogil;
  kc::paged_attention(args);
}

}  // namespace

void bind_attention(py::module_& m) {
  m.def("paged_attention", &paged_attention, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("partition_size") = 0, py::arg("window") = 0, py::arg("softcap") = 0.0,
        "Causal paged attention for a flattened batch: query [num_tokens, num_heads, head_dim], "
        "caches [num_blocks, block_size, kv_heads, head_dim], block_tables int32 [num_seqs, max_blocks], "
        "query_start_loc int32 [num_seqs + 1], seq_lens int32 [num_seqs] (context incl. the new "
        "tokens, already written to the cache). Writes out [num_tokens, num_heads, head_dim]. window > 0: "
        "a query at position p sees keys p - window + 1..p only; softcap > 0: scores become "
        "softcap * tanh(score / softcap).");
}

}  // namespace mindie::host
