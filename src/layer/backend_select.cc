// The run-time backend choice (--device cpu|cuda|auto), and the CUDA entry points of a build
// without the CUDA backend.
#include "dsakit/backend.h"
#include "dsakit/error.h"

namespace dsakit {

#if !defined(DSAKIT_WITH_CUDA)
bool cuda_backend_compiled() {
  return false;
}
int cuda_device_count() {
  return 0;
}
std::unique_ptr<Backend> make_cuda_backend(int) {
  DSAKIT_FAIL(kUnsupported,
              "device cuda: this dsakit build has no CUDA backend "
              "(configure with CUDA available to build it)");
}
#endif

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend(0);
  if (device == "auto") return cuda_device_count() > 0 ? make_cuda_backend(0) : make_cpu_backend();
  DSAKIT_FAIL(kInvalidArgument, "device: expected cpu, cuda or auto, got '", device, "'");
}

}  // namespace dsakit
