// dsakit._dsakit: the extension module of the Python package (python/dsakit). The Python side
// (python/dsakit/*.py) allocates outputs in the caller's framework and registers the torch ops;
// this module converts arrays (DLPack, zero-copy), checks what the C++ API does not, and calls
// the library with the GIL released on the caller's stream.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "dsakit/backend.h"
#include "python/src/bindings.h"

namespace nb = nanobind;

NB_MODULE(_dsakit, m) {
  using namespace dsakit::py;
  nb::set_leak_warnings(false);  // backends and torch.library keep references until exit
  m.doc() = "dsakit's C++ library (DeepSeek Sparse Attention prefill for MLA models)";
  register_errors(m);
  bind_array(m);
  m.def("cuda_compiled", &dsakit::cuda_backend_compiled,
        "Whether this build has the CUDA backend (sm_90a).");
  m.def("cuda_device_count", &dsakit::cuda_device_count);
  m.def(
      "device_name",
      [](const std::string& device) {
        return backend_for(parse_device(device)).backend->capabilities().device_name;
      },
      nb::arg("device"));
  m.def(
      "kernel_instances",
      [](const std::string& device) {
        return backend_for(parse_device(device)).backend->capabilities().kernel_instances;
      },
      nb::arg("device"));
  bind_layer(m);
  bind_ops(m);
}
