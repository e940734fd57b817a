// The binding's CUDA specifics (built only with the CUDA backend): the caller's stream, graph
// capture, and strided row copies on the backend's stream.
#include <cuda_runtime.h>

#include "dsakit/error.h"
#include "python/src/backends.h"
#include "src/cuda/cuda_backend.h"

namespace dsakit::py {

namespace {

cuda::CudaBackend& cuda_backend(Backend& be) {
  auto* c = dynamic_cast<cuda::CudaBackend*>(&be);
  DSAKIT_CHECK(c != nullptr, kInternal, "binding: a cuda device without a CudaBackend");
  return *c;
}

void check(cudaError_t e, const char* what) {
  DSAKIT_CHECK(e == cudaSuccess, kBackend, what, ": ", cudaGetErrorString(e));
}

}  // namespace

void cuda_use_stream(Backend& be, uint64_t stream) {
  cuda::CudaBackend& c = cuda_backend(be);
  // CUDA reads a null stream as the legacy default stream (PyTorch's default stream, whose
  // handle PyTorch reports as 0); CudaBackend reads null as "its own stream", so say it outright.
  const cudaStream_t s = stream == 0 ? cudaStreamLegacy : reinterpret_cast<cudaStream_t>(stream);
  if (c.stream() != s) c.set_stream(s);
}

bool cuda_capturing(Backend& be) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(cuda_backend(be).stream(), &status), "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;
}

void cuda_copy_rows(Backend& be, const Rows& dst, const Rows& src) {
  const cudaStream_t s = cuda_backend(be).stream();
  check(cudaMemcpy2DAsync(dst.data, size_t(dst.pitch_bytes), src.data, size_t(src.pitch_bytes),
                          size_t(dst.row_bytes), size_t(dst.rows), cudaMemcpyDefault, s),
        "cudaMemcpy2DAsync");
  if (dst.device == Device::kCpu || src.device == Device::kCpu)
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

}  // namespace dsakit::py
