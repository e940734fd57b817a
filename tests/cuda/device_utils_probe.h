// Test-only launchers of the device helpers in src/cuda/common/device_utils.cuh over arrays, so
// GoogleTest code compiled by the host compiler can check them on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda::testing {

// out[i] = e4m3_pair_to_f16x2_bits(a[i], b[i], j[i]) for i < n; device pointers, j[i] in [0, 4).
cudaError_t e4m3_pairs_by_bits(const uint32_t* a, const uint32_t* b, const int32_t* j,
                               uint32_t* out, int n, cudaStream_t stream);

}  // namespace dsakit::cuda::testing
