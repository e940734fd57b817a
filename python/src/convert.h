// Python <-> dsakit conversions of the binding (docs/python.md): DLPack arrays to TensorViews
// (zero-copy, nothing converted), dsakit tensors back to DLPack arrays, devices, and dsakit::Error
// as Python exceptions. No kernel and no library logic lives here.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/tensor.h"

namespace dsakit::py {

namespace nb = nanobind;

// A device as the binding names it: cpu, or cuda with an ordinal.
struct DeviceRef {
  Device type = Device::kCpu;
  int index = 0;
  bool operator==(const DeviceRef& o) const { return type == o.type && index == o.index; }
  bool operator!=(const DeviceRef& o) const { return !(*this == o); }
  std::string str() const;  // "cpu" | "cuda:0"
};
// "cpu", "cuda", "cuda:N" (also a torch.device's str()). Throws kInvalidArgument.
DeviceRef parse_device(const std::string& name);

// One tensor argument: the view and what keeps its memory alive while the call runs (the DLPack
// import holds the producer's object). Strides are the producer's; extents of one element get
// the contiguous stride (their stride is meaningless, and some producers report any value).
struct Arg {
  const char* name = "";
  nb::ndarray<> array;  // empty for an absent optional argument
  TensorView view;
  DeviceRef device;
  bool given() const { return view.ndim != 0 || array.is_valid(); }
};

// Imports `obj` (anything with __dlpack__ or the buffer protocol; a NumPy array of ml_dtypes'
// bfloat16 too) without copying. Raises TypeError naming `name` for a non-array, ValueError for
// an element type dsakit does not read, more than 4 dims or memory that is neither cpu nor cuda.
// FP8 e4m3fn arrays arrive as u8 (the library keeps FP8 as bytes). `writable`: the call writes it
// (a read-only array is refused). None gives an absent Arg when `optional`.
Arg arg(nb::handle obj, const char* name, bool writable = false, bool optional = false);

// Throws ValueError unless every given arg lives on `device` (names the first that does not).
void check_same_device(const DeviceRef& device, std::initializer_list<const Arg*> args);

// A dsakit tensor as a DLPack producer (dsakit._dsakit.Array: __dlpack__, __dlpack_device__,
// shape, dtype), zero-copy; every capsule it hands out keeps the storage alive.
nb::object export_tensor(const Tensor& t, const DeviceRef& device);

// Memory the caller owns, seen as a dsakit Tensor without taking ownership (the Python object
// that keeps it alive is held next to it, for the call or by the owner).
inline Tensor borrowed(const TensorView& v) {
  return Tensor(std::shared_ptr<void>(), v);
}
void bind_array(nb::module_& m);

// Registers the exception types (dsakit.Error and its kinds) and the translator of dsakit::Error.
void register_errors(nb::module_& m);

DType parse_dtype(const std::string& name);  // bf16 | f32 | f64 | i32 | u8

}  // namespace dsakit::py
