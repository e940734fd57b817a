#include "python/src/convert.h"

#include <nanobind/stl/string.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <string>

#include "dsakit/error.h"

namespace dsakit::py {

namespace {

namespace dl = nb::dlpack;

[[noreturn]] void type_error(const std::string& what) {
  throw nb::type_error(what.c_str());
}
[[noreturn]] void value_error(const std::string& what) {
  throw nb::value_error(what.c_str());
}

std::string dlpack_dtype_name(const dl::dtype& t) {
  const char* prefix = "?";
  switch (dl::dtype_code(t.code)) {
    case dl::dtype_code::Int:
      prefix = "int";
      break;
    case dl::dtype_code::UInt:
      prefix = "uint";
      break;
    case dl::dtype_code::Float:
      prefix = "float";
      break;
    case dl::dtype_code::Bfloat:
      prefix = "bfloat";
      break;
    case dl::dtype_code::Complex:
      prefix = "complex";
      break;
    case dl::dtype_code::Bool:
      prefix = "bool";
      break;
    default:
      return "DLPack type code " + std::to_string(int(t.code)) + " (" + std::to_string(t.bits) +
             " bits)";
  }
  return std::string(prefix) + std::to_string(t.bits);
}

// DLPack's type code of float8_e4m3fn (DLPack >= 1.0; nanobind < 3 has no name for it).
constexpr uint8_t kDLFloat8E4M3FN = 10;

// dsakit's element type for a DLPack one: exact matches only (FP8 e4m3fn is the library's u8).
bool to_dtype(const dl::dtype& t, DType& out) {
  if (t.lanes != 1) return false;
  const auto code = dl::dtype_code(t.code);
  if (code == dl::dtype_code::Bfloat && t.bits == 16)
    out = DType::kBF16;
  else if (code == dl::dtype_code::Float && t.bits == 32)
    out = DType::kF32;
  else if (code == dl::dtype_code::Float && t.bits == 64)
    out = DType::kF64;
  else if (code == dl::dtype_code::Int && t.bits == 32)
    out = DType::kI32;
  else if (code == dl::dtype_code::UInt && t.bits == 8)
    out = DType::kU8;
  else if (t.code == kDLFloat8E4M3FN && t.bits == 8)
    out = DType::kU8;
  else
    return false;
  return true;
}

dl::dtype to_dlpack(DType t) {
  switch (t) {
    case DType::kBF16:
      return {uint8_t(dl::dtype_code::Bfloat), 16, 1};
    case DType::kF32:
      return {uint8_t(dl::dtype_code::Float), 32, 1};
    case DType::kF64:
      return {uint8_t(dl::dtype_code::Float), 64, 1};
    case DType::kI32:
      return {uint8_t(dl::dtype_code::Int), 32, 1};
    case DType::kU8:
      return {uint8_t(dl::dtype_code::UInt), 8, 1};
  }
  return {};
}

// A NumPy array of ml_dtypes.bfloat16: NumPy exports it through neither DLPack nor the buffer
// protocol, so it crosses as its uint16 view (the same bytes) and is read as bf16. Only
// ml_dtypes defines that dtype: until it is imported no array can have it; after, its dtype
// object (a singleton) is compared by identity (dtype.name would cost more than the import).
bool is_numpy_bf16(nb::handle obj) {
  if (std::strcmp(Py_TYPE(obj.ptr())->tp_name, "numpy.ndarray") != 0) return false;
  static PyObject* bf16 = nullptr;  // numpy.dtype(ml_dtypes.bfloat16), kept for the process
  if (bf16 == nullptr) {
    PyObject* ml = PyDict_GetItemString(PyImport_GetModuleDict(), "ml_dtypes");  // borrowed
    if (ml == nullptr) return false;
    bf16 = nb::module_::import_("numpy")
               .attr("dtype")(nb::handle(ml).attr("bfloat16"))
               .release()
               .ptr();
  }
  const nb::object dt = obj.attr("dtype");
  return dt.ptr() == bf16;
}

template <typename Array>
TensorView view_of(const Array& a, const char* name, bool bf16, DeviceRef& device) {
  const int ndim = int(a.ndim());
  if (ndim < 1 || ndim > kMaxDims)
    value_error(std::string(name) + ": expected a tensor of 1 to " + std::to_string(kMaxDims) +
                " dims, got " + std::to_string(ndim));
  TensorView v;
  if (bf16) {
    v.dtype = DType::kBF16;
  } else if (!to_dtype(a.dtype(), v.dtype)) {
    value_error(std::string(name) + ": element type " + dlpack_dtype_name(a.dtype()) +
                " is not one dsakit reads (bf16, f32, f64, i32, u8 or float8_e4m3fn bytes)");
  }
  switch (a.device_type()) {
    case nb::device::cpu::value:
      device = {Device::kCpu, 0};
      break;
    case nb::device::cuda::value:
      device = {Device::kCuda, a.device_id()};
      break;
    default:
      value_error(std::string(name) + ": memory on DLPack device type " +
                  std::to_string(a.device_type()) +
                  " (e.g. pinned host or managed memory) is not supported; expected cpu or cuda");
  }
  v.device = device.type;
  v.ndim = ndim;
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  for (int d = 0; d < ndim; ++d) {
    v.shape[size_t(d)] = int64_t(a.shape(size_t(d)));
    v.stride[size_t(d)] = a.stride(size_t(d));
  }
  // The stride of a one-element extent is meaningless (producers report anything): give it the
  // contiguous one, so that contiguity and row checks see the layout that matters. So are all
  // strides of an empty tensor.
  const bool empty = v.numel() == 0;
  for (int d = ndim - 1; d >= 0; --d)
    if (empty || v.shape[size_t(d)] == 1)
      v.stride[size_t(d)] = d == ndim - 1 ? 1 : v.shape[size_t(d + 1)] * v.stride[size_t(d + 1)];
  return v;
}

// dsakit.Error and one subclass per ErrorKind, each also a subclass of the builtin exception a
// Python caller expects (ValueError for bad arguments, NotImplementedError, MemoryError).
std::array<PyObject*, 8> g_error_types{};
PyObject* g_error_base = nullptr;

}  // namespace

std::string DeviceRef::str() const {
  return type == Device::kCpu ? std::string("cpu") : "cuda:" + std::to_string(index);
}

DeviceRef parse_device(const std::string& name) {
  if (name == "cpu") return {Device::kCpu, 0};
  if (name == "cuda") return {Device::kCuda, 0};
  if (name.rfind("cuda:", 0) == 0) {
    const std::string n = name.substr(5);
    char* end = nullptr;
    const long idx = std::strtol(n.c_str(), &end, 10);
    if (!n.empty() && end && *end == '\0' && idx >= 0 && idx < 1024)
      return {Device::kCuda, int(idx)};
  }
  DSAKIT_FAIL(kInvalidArgument, "device: expected cpu, cuda or cuda:N, got '", name, "'");
}

Arg arg(nb::handle obj, const char* name, bool writable, bool optional) {
  Arg a;
  a.name = name;
  if (obj.is_none()) {
    if (optional) return a;
    type_error(std::string(name) + ": expected a tensor, got None");
  }
  nb::object bf16_view;
  const bool bf16 = is_numpy_bf16(obj);
  nb::handle src = obj;
  if (bf16) {
    static PyObject* u16 = nb::object(nb::module_::import_("numpy").attr("uint16")).release().ptr();
    bf16_view = obj.attr("view")(nb::handle(u16));
    src = bf16_view;
  }
  if (writable) {
    if (!nb::try_cast(src, a.array, /*convert=*/false))
      type_error(std::string(name) + ": expected a writable tensor (an object with __dlpack__ or " +
                 "the buffer protocol), got " + nb::cast<std::string>(nb::str(src.type())));
    a.view = view_of(a.array, name, bf16, a.device);
  } else {
    nb::ndarray<nb::ro> ro;
    if (!nb::try_cast(src, ro, /*convert=*/false))
      type_error(std::string(name) + ": expected a tensor (an object with __dlpack__ or the " +
                 "buffer protocol), got " + nb::cast<std::string>(nb::str(src.type())));
    a.view = view_of(ro, name, bf16, a.device);
    a.array = nb::ndarray<>(ro);
  }
  return a;
}

void check_same_device(const DeviceRef& device, std::initializer_list<const Arg*> args) {
  for (const Arg* a : args) {
    if (!a->given() || a->device == device) continue;
    DSAKIT_FAIL(kInvalidArgument, a->name, ": expected a tensor on ", device.str(),
                " (where the call runs), got one on ", a->device.str());
  }
}

namespace {

struct Array {
  Tensor tensor;
  DeviceRef device;
};

// A fresh DLPack capsule of the array (a capsule can be consumed once; the Array many times).
nb::object capsule_of(const Array& a) {
  const TensorView& v = a.tensor.view();
  std::array<size_t, kMaxDims> shape{};
  for (int d = 0; d < v.ndim; ++d) shape[size_t(d)] = size_t(v.shape[size_t(d)]);
  nb::capsule owner(new Tensor(a.tensor), [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  nb::ndarray<> nd(
      v.data, size_t(v.ndim), shape.data(), owner, v.stride.data(), to_dlpack(v.dtype),
      a.device.type == Device::kCuda ? nb::device::cuda::value : nb::device::cpu::value,
      a.device.index);
  return nb::cast(nd, nb::rv_policy::reference);
}

}  // namespace

nb::object export_tensor(const Tensor& t, const DeviceRef& device) {
  return nb::cast(Array{t, device});
}

void bind_array(nb::module_& m) {
  nb::class_<Array>(m, "Array",
                    "A dsakit-allocated array: a DLPack producer (torch.from_dlpack, "
                    "numpy.from_dlpack, ...), zero-copy.")
      .def(
          "__dlpack__",
          [](const Array& a, nb::handle stream, nb::handle max_version, nb::handle dl_device,
             nb::handle copy) {
            (void)stream, (void)max_version, (void)dl_device;
            if (!copy.is_none() && nb::cast<bool>(copy))
              throw nb::buffer_error("dsakit.Array: __dlpack__(copy=True) is not supported");
            return capsule_of(a);
          },
          nb::kw_only(), nb::arg("stream").none() = nb::none(),
          nb::arg("max_version").none() = nb::none(), nb::arg("dl_device").none() = nb::none(),
          nb::arg("copy").none() = nb::none())
      .def("__dlpack_device__",
           [](const Array& a) {
             return nb::make_tuple(a.device.type == Device::kCuda ? 2 : 1, a.device.index);
           })
      .def_prop_ro("shape",
                   [](const Array& a) {
                     nb::list l;
                     for (int d = 0; d < a.tensor.view().ndim; ++d) l.append(a.tensor.size(d));
                     return nb::tuple(l);
                   })
      .def_prop_ro("dtype", [](const Array& a) { return std::string(to_string(a.tensor.dtype())); })
      .def_prop_ro("device", [](const Array& a) { return a.device.str(); })
      .def("__repr__", [](const Array& a) {
        return "dsakit.Array(" + std::string(to_string(a.tensor.dtype())) + " " +
               a.tensor.view().shape_str() + " on " + a.device.str() + ")";
      });
}

DType parse_dtype(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "f32" || name == "float32") return DType::kF32;
  if (name == "f64" || name == "float64") return DType::kF64;
  if (name == "i32" || name == "int32") return DType::kI32;
  if (name == "u8" || name == "uint8") return DType::kU8;
  DSAKIT_FAIL(kInvalidArgument, "dtype: expected bf16, f32, f64, i32 or u8, got '", name, "'");
}

void register_errors(nb::module_& m) {
  nb::object type = nb::module_::import_("builtins").attr("type");
  const auto make = [&](const char* name, nb::tuple bases, const char* doc) {
    nb::dict ns;
    ns["__module__"] = "dsakit";
    ns["__doc__"] = doc;
    nb::object cls = type(name, bases, ns);
    m.attr(name) = cls;
    return cls.release().ptr();  // kept for the life of the process
  };
  g_error_base = make("Error", nb::make_tuple(nb::handle(PyExc_RuntimeError)),
                      "An error raised by dsakit; the message is the library's. Subclasses name "
                      "the kind and are also the builtin exception a caller expects.");
  const nb::handle base(g_error_base);
  struct Kind {
    ErrorKind kind;
    const char* name;
    PyObject* builtin;
    const char* doc;
  };
  const Kind kinds[] = {
      {ErrorKind::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError,
       "A shape, dtype, stride, device, length, index, page table or flag was refused."},
      {ErrorKind::kLayoutMismatch, "LayoutMismatchError", PyExc_ValueError,
       "A pool read or written as the wrong layout (e.g. 576-byte rows as the 656-byte one)."},
      {ErrorKind::kUnsupported, "UnsupportedError", PyExc_NotImplementedError,
       "A valid request that no compiled kernel instance or backend implements."},
      {ErrorKind::kConfig, "ConfigError", PyExc_ValueError, "A model config file or key."},
      {ErrorKind::kFormat, "FormatError", PyExc_ValueError, "A malformed file."},
      {ErrorKind::kResource, "ResourceError", PyExc_MemoryError,
       "A workspace or memory limit (LayerOptions.max_workspace_bytes, device memory)."},
      {ErrorKind::kBackend, "BackendError", nullptr,
       "An error reported by the device runtime (CUDA, cuBLAS)."},
      {ErrorKind::kInternal, "InternalError", nullptr, "An invariant broken inside dsakit."},
  };
  for (const Kind& k : kinds) {
    nb::tuple bases =
        k.builtin ? nb::make_tuple(base, nb::handle(k.builtin)) : nb::make_tuple(base);
    g_error_types[size_t(k.kind)] = make(k.name, bases, k.doc);
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* cls = g_error_types[size_t(e.kind())];
      PyErr_SetString(cls ? cls : g_error_base, e.what());
    }
  });
}

}  // namespace dsakit::py
