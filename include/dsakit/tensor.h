// Tensor views (non-owning) and host tensors (owning). Shapes are row-major, strides in
// elements. Kernels take contiguous views; check_tensor() validates at the API edge.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/formats.h"

namespace dsakit {

enum class DType : uint8_t { kBF16, kF32, kF64, kI32, kU8 };
enum class Device : uint8_t { kCpu, kCuda };

size_t dtype_size(DType dtype);
const char* to_string(DType dtype);
const char* to_string(Device device);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<bf16_t>() {
  return DType::kBF16;
}
template <>
constexpr DType dtype_of<float>() {
  return DType::kF32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kF64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kI32;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::kU8;
}

inline constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Device device = Device::kCpu;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};

  int64_t size(int d) const { return shape[d]; }
  int64_t numel() const;
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  bool empty() const { return data == nullptr && numel() == 0; }
  std::string shape_str() const;  // "[12, 16, 128]"

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// A contiguous view over `data`.
TensorView make_view(void* data, DType dtype, Device device, const std::vector<int64_t>& shape);

// Rows [begin, end) of a view along dimension 0 (same strides; still contiguous when `v` is).
TensorView slice_rows(const TensorView& v, int64_t begin, int64_t end);

// An owning tensor. Host tensors allocate here; device tensors come from a Backend.
class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<void> storage, TensorView view)
      : storage_(std::move(storage)), view_(view) {}

  // 64-byte aligned host allocation, uninitialized.
  static Tensor host(DType dtype, const std::vector<int64_t>& shape);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  template <typename T>
  T* ptr() const {
    return view_.ptr<T>();
  }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return view_.nbytes(); }
  int64_t size(int d) const { return view_.shape[d]; }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  bool defined() const { return view_.ndim > 0; }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Validates a tensor argument at an API edge: contiguous, dtype, device and shape (-1 in
// `shape` matches any extent). Throws Error(kInvalidArgument) naming `name`, e.g.
//   "q_nope: expected shape [12, 16, 128], got [12, 16, 192]".
void check_tensor(const TensorView& t, const char* name, DType dtype, Device device,
                  std::initializer_list<int64_t> shape);
// As above, accepting any of `dtypes`.
void check_tensor(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                  Device device, std::initializer_list<int64_t> shape);

// As above for a view that need not be contiguous: unit stride in the last dim and rows that
// do not overlap (e.g. a column range of a larger tensor).
void check_strided_tensor(const TensorView& t, const char* name,
                          std::initializer_list<DType> dtypes, Device device,
                          std::initializer_list<int64_t> shape);

// Loads element i of a bf16 / f32 / f64 tensor as float (host code only).
float load_as_float(const TensorView& t, int64_t i);

}  // namespace dsakit
