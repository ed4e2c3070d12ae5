#include "buffer.h"

#include <sstream>

namespace mindie::host {

namespace {
constexpr int32_t kDLCPU = 1;
constexpr uint8_t kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4;

// torch.Tensor.__dlpack__ is a Python method with argument checks (about 3 us a call); its C entry
// point torch._C._to_dlpack exports the same capsule in about 0.4 us, which matters when a model
// step makes hundreds of kernel calls. Looked up only once torch has been imported by the user.
struct TorchExport {
  py::object tensor_type;
  py::object to_dlpack;
};

const TorchExport* torch_export() {
  static TorchExport* found = nullptr;  // never freed: lives as long as the interpreter
  if (found == nullptr) {
    py::dict modules = py::module_::import("sys").attr("modules");
    if (!modules.contains("torch")) return nullptr;
    py::object torch = modules["torch"];
    found = new TorchExport{torch.attr("Tensor"), torch.attr("_C").attr("_to_dlpack")};
  }
  return found;
}

}  // namespace

void fail(const std::string& msg) { throw py::value_error(msg); }

Tensor::Tensor(py::handle obj, std::string name) : name_(std::move(name)) {
  const TorchExport* te = torch_export();
  if (te != nullptr && PyObject_IsInstance(obj.ptr(), te->tensor_type.ptr()) == 1) {
    capsule_ = te->to_dlpack(obj);
  } else if (PyCapsule_CheckExact(obj.ptr())) {
    capsule_ = py::reinterpret_borrow<py::object>(obj);
  } else if (py::hasattr(obj, "__dlpack__")) {
    capsule_ = obj.attr("__dlpack__")();
  } else {
    throw py::type_error(name_ + ": expected a tensor or array supporting DLPack, got " +
                         std::string(py::str(py::type::of(obj))));
  }
  if (!PyCapsule_IsValid(capsule_.ptr(), "dltensor"))
    throw py::type_error(name_ + ": not an unconsumed DLPack capsule");
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule_.ptr(), "dltensor"));
  const DLTensor& t = managed->dl_tensor;
  if (t.device.device_type != kDLCPU) fail(name_ + ": tensor must be on the CPU");
  if (t.dtype.lanes != 1) fail(name_ + ": vector dtypes are not supported");
  data_ = static_cast<char*>(t.data) + t.byte_offset;
  shape_.assign(t.shape, t.shape + t.ndim);
  strides_.resize(t.ndim);
  int64_t expected = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    strides_[i] = t.strides != nullptr ? t.strides[i] : expected;
    expected *= shape_[i];
  }
  const auto c = t.dtype.code, b = t.dtype.bits;
  if (c == kDLFloat && b == 32) elem_ = ElemType::kFloat32;
  else if (c == kDLBfloat && b == 16) elem_ = ElemType::kBFloat16;
  else if (c == kDLFloat && b == 64) elem_ = ElemType::kFloat64;
  else if (c == kDLInt && b == 32) elem_ = ElemType::kInt32;
  else if (c == kDLInt && b == 64) elem_ = ElemType::kInt64;
  else if (c == kDLInt && b == 8) elem_ = ElemType::kInt8;
  else if (c == kDLUInt && b == 8) elem_ = ElemType::kUInt8;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

const char* Tensor::elem_name() const {
  switch (elem_) {
    case ElemType::kFloat32: return "float32";
    case ElemType::kBFloat16: return "bfloat16";
    case ElemType::kFloat64: return "float64";
    case ElemType::kInt32: return "int32";
    case ElemType::kInt64: return "int64";
    case ElemType::kInt8: return "int8";
    case ElemType::kUInt8: return "uint8";
    default: return "an unsupported dtype";
  }
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // nothing to address (torch gives empty tensors arbitrary strides)
  int64_t expected = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

DType Tensor::float_dtype() const {
  if (elem_ == ElemType::kFloat32) return DType::kFloat32;
  if (elem_ == ElemType::kBFloat16) return DType::kBFloat16;
  throw py::type_error(name_ + ": expected dtype float32 or bfloat16, got " + elem_name());
}

const Tensor& Tensor::expect(ElemType want) const {
  if (elem_ != want) {
    Tensor probe = *this;
    probe.elem_ = want;
    throw py::type_error(name_ + ": expected dtype " + probe.elem_name() + ", got " + elem_name());
  }
  return *this;
}

const Tensor& Tensor::expect_ndim(int n) const {
  if (ndim() != n)
    fail(name_ + ": expected " + std::to_string(n) + " dimensions, got shape " + shape_str(*this));
  return *this;
}

const Tensor& Tensor::expect_size(int i, int64_t n, const char* what) const {
  if (size(i) != n) {
    std::ostringstream os;
    os << name_ << ": dimension " << i << " must be " << n;
    if (what != nullptr) os << " (" << what << ")";
    os << ", got shape " << shape_str(*this);
    fail(os.str());
  }
  return *this;
}

const Tensor& Tensor::expect_contiguous() const {
  if (!is_contiguous()) fail(name_ + ": must be contiguous");
  return *this;
}

const Tensor& Tensor::expect_inner_contiguous(int dims) const {
  int64_t expected = 1;
  for (int i = ndim() - 1; i >= ndim() - dims && i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) fail(name_ + ": inner dimensions must be contiguous");
    expected *= shape_[i];
  }
  if (ndim() > dims && strides_[ndim() - dims - 1] < expected && shape_[ndim() - dims - 1] > 1)
    fail(name_ + ": rows must not overlap");
  return *this;
}

std::string shape_str(const Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < t.ndim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

}  // namespace mindie::host
