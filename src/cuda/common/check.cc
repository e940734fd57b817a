#include "src/cuda/common/check.h"

#include "dsakit/error.h"

namespace dsakit::cuda {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  DSAKIT_FAIL(kBackend, call, " failed at ", file, ":", line, ": ", cudaGetErrorName(status), " (",
              cudaGetErrorString(status), ")");
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  DSAKIT_FAIL(kBackend, call, " failed at ", file, ":", line, ": ", cublasGetStatusName(status),
              " (", cublasGetStatusString(status), ")");
}

}  // namespace dsakit::cuda
