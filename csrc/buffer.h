// One view over the tensors that cross into the extension: anything with __dlpack__ (torch,
// numpy, ...) or a DLPack capsule. Memory is borrowed for the duration of the call (the capsule is
// held, never consumed), and every check raises a Python exception naming the argument.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "cpu/types.h"

namespace mindie::host {

namespace py = pybind11;
using kernels::cpu::DType;

// DLPack ABI (v0.x, the "dltensor" capsule every producer still returns by default).
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data; DLDevice device; int32_t ndim; DLDataType dtype;
  int64_t* shape; int64_t* strides; uint64_t byte_offset;
};
struct DLManagedTensor { DLTensor dl_tensor; void* manager_ctx; void (*deleter)(DLManagedTensor*); };

enum class ElemType { kFloat32, kBFloat16, kFloat64, kInt32, kInt64, kInt8, kUInt8, kOther };

class Tensor {
 public:
  Tensor(py::handle obj, std::string name);

  const std::string& name() const { return name_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int i) const { return shape_.at(i); }
  int64_t stride(int i) const { return strides_.at(i); }
  int64_t numel() const;
  ElemType elem() const { return elem_; }
  const char* elem_name() const;
  bool is_contiguous() const;
  void* data() const { return data_; }
  template <typename T> T* ptr() const { return static_cast<T*>(data_); }

  // Checks, each raising ValueError/TypeError with the argument's name.
  DType float_dtype() const;  // float32 or bfloat16
  const Tensor& expect(ElemType t) const;
  const Tensor& expect_ndim(int n) const;
  const Tensor& expect_size(int i, int64_t n, const char* what = nullptr) const;
  const Tensor& expect_contiguous() const;
  // Innermost `dims` dimensions dense (the outer one may have any positive stride).
  const Tensor& expect_inner_contiguous(int dims) const;

 private:
  py::object capsule_;
  std::string name_;
  void* data_ = nullptr;
  std::vector<int64_t> shape_;
  std::vector<int64_t> strides_;
  ElemType elem_ = ElemType::kOther;
};

std::string shape_str(const Tensor& t);
[[noreturn]] void fail(const std::string& msg);  // raises ValueError

}  // namespace mindie::host
