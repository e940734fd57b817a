#include "dsakit/tensor.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>

#include "dsakit/error.h"

namespace dsakit {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kF64:
      return 8;
    case DType::kI32:
      return 4;
    case DType::kU8:
      return 1;
  }
  return 0;
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kF32:
      return "f32";
    case DType::kF64:
      return "f64";
    case DType::kI32:
      return "i32";
    case DType::kU8:
      return "u8";
  }
  return "?";
}

const char* to_string(Device device) {
  return device == Device::kCpu ? "cpu" : "cuda";
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[size_t(d)];
  return ndim == 0 ? 0 : n;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[size_t(d)] != 1 && stride[size_t(d)] != expect) return false;
    expect *= shape[size_t(d)];
  }
  return true;
}

static std::string dims_str(const int64_t* dims, int n) {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < n; ++d) {
    if (d) os << ", ";
    if (dims[d] < 0)
      os << '*';
    else
      os << dims[d];
  }
  os << ']';
  return os.str();
}

std::string TensorView::shape_str() const {
  return dims_str(shape.data(), ndim);
}

TensorView make_view(void* data, DType dtype, Device device, const std::vector<int64_t>& shape) {
  DSAKIT_CHECK_ARG(shape.size() >= 1 && shape.size() <= size_t(kMaxDims), "tensor rank must be 1..",
                   kMaxDims, ", got ", shape.size());
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = int(shape.size());
  int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    DSAKIT_CHECK_ARG(shape[size_t(d)] >= 0, "tensor extent must be >= 0, got ", shape[size_t(d)]);
    v.shape[size_t(d)] = shape[size_t(d)];
    v.stride[size_t(d)] = s;
    s *= shape[size_t(d)];
  }
  return v;
}

TensorView slice_rows(const TensorView& v, int64_t begin, int64_t end) {
  DSAKIT_CHECK_ARG(v.ndim >= 1 && begin >= 0 && begin <= end && end <= v.shape[0],
                   "slice_rows: rows [", begin, ", ", end, ") of a tensor of shape ",
                   v.shape_str());
  TensorView s = v;
  s.shape[0] = end - begin;
  if (v.data)
    s.data = static_cast<char*>(v.data) + begin * v.stride[0] * int64_t(dtype_size(v.dtype));
  return s;
}

Tensor Tensor::host(DType dtype, const std::vector<int64_t>& shape) {
  TensorView v = make_view(nullptr, dtype, Device::kCpu, shape);
  const size_t bytes = (v.nbytes() + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  DSAKIT_CHECK(p != nullptr, kResource, "host allocation of ", v.nbytes(), " bytes failed");
  v.data = p;
  return Tensor(std::shared_ptr<void>(p, [](void* q) { std::free(q); }), v);
}

static void check_shape(const TensorView& t, const char* name, Device device,
                        std::initializer_list<int64_t> shape, bool strided_ok = false) {
  DSAKIT_CHECK_ARG(t.device == device, name, ": expected a ", to_string(device), " tensor, got a ",
                   to_string(t.device), " tensor");
  const int n = int(shape.size());
  bool ok = t.ndim == n;
  int d = 0;
  for (int64_t e : shape) {
    if (ok && e >= 0 && t.shape[size_t(d)] != e) ok = false;
    ++d;
  }
  DSAKIT_CHECK_ARG(ok, name, ": expected shape ", dims_str(shape.begin(), n), ", got ",
                   t.shape_str());
  if (strided_ok) {
    // Unit stride in the last dim; each outer stride spans its inner extent (no overlap).
    bool rows_ok = t.ndim == 0 || t.stride[size_t(t.ndim - 1)] == 1;
    for (int i = 0; rows_ok && i + 1 < t.ndim; ++i)
      rows_ok = t.stride[size_t(i)] >= t.shape[size_t(i + 1)] * t.stride[size_t(i + 1)];
    DSAKIT_CHECK_ARG(rows_ok, name,
                     ": expected unit stride in the last dim and non-overlapping "
                     "rows, got shape ",
                     t.shape_str(), " with strides ", dims_str(t.stride.data(), t.ndim));
  } else {
    DSAKIT_CHECK_ARG(t.is_contiguous(), name, ": expected a contiguous tensor of shape ",
                     t.shape_str());
  }
  DSAKIT_CHECK_ARG(t.data != nullptr || t.numel() == 0, name, ": null data pointer");
}

void check_tensor(const TensorView& t, const char* name, DType dtype, Device device,
                  std::initializer_list<int64_t> shape) {
  DSAKIT_CHECK_ARG(t.dtype == dtype, name, ": expected dtype ", to_string(dtype), ", got ",
                   to_string(t.dtype));
  check_shape(t, name, device, shape);
}

static void check_dtype(const TensorView& t, const char* name,
                        std::initializer_list<DType> dtypes) {
  bool ok = false;
  std::string accepted;
  for (DType d : dtypes) {
    ok = ok || d == t.dtype;
    accepted += accepted.empty() ? "" : " or ";
    accepted += to_string(d);
  }
  DSAKIT_CHECK_ARG(ok, name, ": expected dtype ", accepted, ", got ", to_string(t.dtype));
}

void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                  Device device, std::initializer_list<int64_t> shape) {
  check_dtype(t, name, dtypes);
  check_shape(t, name, device, shape);
}

void check_strided_tensor(const TensorView& t, const char* name,
                          std::initializer_list<DType> dtypes, Device device,
                          std::initializer_list<int64_t> shape) {
  check_dtype(t, name, dtypes);
  check_shape(t, name, device, shape, /*strided_ok=*/true);
}

float load_as_float(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::kBF16:
      return bf16_to_f32(t.ptr<const bf16_t>()[i]);
    case DType::kF32:
      return t.ptr<const float>()[i];
    case DType::kF64:
      return float(t.ptr<const double>()[i]);
    case DType::kI32:
      return float(t.ptr<const int32_t>()[i]);
    case DType::kU8:
      return float(t.ptr<const uint8_t>()[i]);
  }
  return std::numeric_limits<float>::quiet_NaN();
}

}  // namespace dsakit
