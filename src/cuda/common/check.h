// Error checks at the API edge of the CUDA backend: a failed CUDA runtime or cuBLAS call becomes
// dsakit::Error(kBackend) naming the call, its file and line, and the runtime's message.
// Launchers return cudaError_t (cudaGetLastError() after the launch); the backend wraps them in
// DSAKIT_CUDA_CHECK. Kernels and launchers never throw.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace dsakit::cuda {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line);
void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

}  // namespace dsakit::cuda

#define DSAKIT_CUDA_CHECK(call)                                                    \
  do {                                                                             \
    const cudaError_t dsakit_status_ = (call);                                     \
    if (dsakit_status_ != cudaSuccess)                                             \
      ::dsakit::cuda::throw_cuda_error(dsakit_status_, #call, __FILE__, __LINE__); \
  } while (0)

#define DSAKIT_CUBLAS_CHECK(call)                                                    \
  do {                                                                               \
    const cublasStatus_t dsakit_status_ = (call);                                    \
    if (dsakit_status_ != CUBLAS_STATUS_SUCCESS)                                     \
      ::dsakit::cuda::throw_cublas_error(dsakit_status_, #call, __FILE__, __LINE__); \
  } while (0)
