#include <unordered_set>

#include "bindings.h"
#include "cpu/kv_cache.h"

namespace mindie::host {
namespace {

namespace kc = kernels::cpu;

void check_cache_pair(const Tensor& kc, const Tensor& vc) {
  kc.expect_ndim(4).expect_contiguous();
  vc.expect_ndim(4).expect_contiguous();
  for (int i = 0; i < 4; ++i) vc.expect_size(i, kc.size(i), "must match key_cache");
  if (vc.elem() != kc.elem()) fail("value_cache: dtype must match key_cache");
}

void reshape_and_cache(py::handle key_obj, py::handle value_obj, py::handle key_cache_obj,
                       py::handle value_cache_obj, py::handle slot_mapping_obj) {
  Tensor key(key_obj, "key"), value(value_obj, "value");
  Tensor key_cache(key_cache_obj, "key_cache"), value_cache(value_cache_obj, "value_cache");
  Tensor slots(slot_mapping_obj, "slot_mapping");
  check_cache_pair(key_cache, value_cache);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t kv_heads = key_cache.size(2), head_dim = key_cache.size(3);
  key.expect_ndim(3).expect_inner_contiguous(2);
  const int64_t num_tokens = key.size(0);
  key.expect_size(1, kv_heads, "kv_heads of the cache").expect_size(2, head_dim, "head_dim of the cache");
  value.expect_ndim(3).expect_inner_contiguous(2);
  for (int i = 0; i < 3; ++i) value.expect_size(i, key.size(i), "must match key");
  const DType src = key.float_dtype(), dst = key_cache.float_dtype();
  if (value.float_dtype() != src) fail("value: dtype must match key");
  if (src != dst && !(src == DType::kFloat32 && dst == DType::kBFloat16))
    fail("key: a " + std::string(key.elem_name()) + " key cannot be written into a " +
         key_cache.elem_name() + " cache (only float32 -> bfloat16 converts)");
  slots.expect(ElemType::kInt64).expect_ndim(1).expect_contiguous().expect_size(0, num_tokens, "num_tokens");
  const int64_t total_slots = num_blocks * block_size;
  const int64_t* s = slots.ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    if (s[t] >= total_slots)
      fail("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(s[t]) +
           " is out of range [0, " + std::to_string(total_slots) + ") (negative skips a token)");
  kc::KVWriteArgs args{key.data(), value.data(), key.stride(0), value.stride(0),
                       key_cache.data(), value_cache.data(), s, num_tokens,
                       static_cast<int>(block_size), static_cast<int>(kv_heads),
                       static_cast<int>(head_dim), src, dst};
  py::gil_scoped_release nogil;
  kc::reshape_and_cache(args);
}

void copy_blocks(py::handle src_obj, py::handle dst_obj, py::handle mapping_obj) {
  Tensor src(src_obj, "src_cache"), dst(dst_obj, "dst_cache"), mapping(mapping_obj, "block_mapping");
  src.expect_contiguous();
  dst.expect_contiguous();
  if (src.ndim() < 2) fail("src_cache: expected [num_blocks, ...] with at least 2 dimensions");
  dst.expect_ndim(src.ndim());
  for (int i = 1; i < src.ndim(); ++i) dst.expect_size(i, src.size(i), "block shape of src_cache");
  if (src.elem() != dst.elem() || src.elem() == ElemType::kOther) fail("dst_cache: dtype must match src_cache");
  mapping.expect(ElemType::kInt64).expect_ndim(2).expect_contiguous().expect_size(1, 2, "(src, dst) pairs");
  const int64_t n = mapping.size(0);
  const int64_t* pairs = mapping.ptr<int64_t>();
  const bool same = src.data() == dst.data();
  std::unordered_set<int64_t> dsts, srcs;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = pairs[2 * i], d = pairs[2 * i + 1];
    if (s < 0 || s >= src.size(0))
      fail("block_mapping[" + std::to_string(i) + "][0] = " + std::to_string(s) + " is out of range [0, " +
           std::to_string(src.size(0)) + ")");
    if (d < 0 || d >= dst.size(0))
      fail("block_mapping[" + std::to_string(i) + "][1] = " + std::to_string(d) + " is out of range [0, " +
           std::to_string(dst.size(0)) + ")");
    if (!dsts.insert(d).second) fail("block_mapping: destination block " + std::to_string(d) + " appears twice");
    if (s != d) srcs.insert(s);
  }
  // Within one tensor the copies run in parallel, so no block may be read by one pair and
  // written by another.
  if (same)
    for (int64_t i = 0; i < n; ++i)
      if (pairs[2 * i] != pairs[2 * i + 1] && srcs.count(pairs[2 * i + 1]))
        fail("block_mapping: block " + std::to_string(pairs[2 * i + 1]) + " is both a source and a destination");
  const int64_t elem_bytes = src.elem() == ElemType::kBFloat16 ? 2 : 4;
  kc::BlockCopyArgs args{src.data(), dst.data(), pairs, n, src.numel() / src.size(0) * elem_bytes};
  if (src.size(0) == 0) return;
  py::gil_scoped_release nogil;
  kc::copy_blocks(args);
}

}  // namespace

void bind_cache(py::module_& m) {
  m.def("reshape_and_cache", &reshape_and_cache, py::arg("key"), py::arg("value"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("slot_mapping"),
        "Writes key/value [num_tokens, kv_heads, head_dim] into the paged caches "
        "[num_blocks, block_size, kv_heads, head_dim] at slot_mapping (int64; negative = skip).");
  m.def("copy_blocks", &copy_blocks, py::arg("src_cache"), py::arg("dst_cache"), py::arg("block_mapping"),
        "Copies whole blocks src_cache[m[i,0]] -> dst_cache[m[i,1]] (int64 [n, 2]); the caches may be "
        "the same tensor (copy-on-write) or two pools with the same block shape (swap, export).");
}

}  // namespace mindie::host
