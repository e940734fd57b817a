#include "src/cuda/common/device_utils.cuh"
#include "tests/cuda/device_utils_probe.h"

namespace dsakit::cuda::testing {
namespace {

__global__ void e4m3_pairs_by_bits_kernel(const uint32_t* a, const uint32_t* b, const int32_t* j,
                                          uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = e4m3_pair_to_f16x2_bits(a[i], b[i], j[i]);
}

}  // namespace

cudaError_t e4m3_pairs_by_bits(const uint32_t* a, const uint32_t* b, const int32_t* j,
                               uint32_t* out, int n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  e4m3_pairs_by_bits_kernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(a, b, j, out,
                                                                                    n);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda::testing
