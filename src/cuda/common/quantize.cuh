// Warp-level FP8 quantizer of one d-vector with the indexer's power-of-two scale
// (docs/formats.md#scale-rules): used for indexer keys (pool store) and indexer queries. Formulas
// from dsakit/formats.h.
#pragma once

#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {

// x bf16 [d] -> codes [d] e4m3(x / s), returns s. All 32 lanes of the warp call it; a lane owns
// the groups of 4 values starting at 4·lane, 4·lane + 128, …; d is a multiple of 4.
__device__ __forceinline__ float warp_quantize_pow2(const bf16_t* x, int d, uint8_t* codes,
                                                    int lane) {
  float amax = 0.0f;  // fmaxf skips NaN, as the CPU backend's amax does
  for (int e = 4 * lane; e < d; e += 4 * kWarpSize) {
    float v[4];
    load_bf16x4(x + e, v);
#pragma unroll
    for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
  }
  const float scale = indexer_fp8_scale(warp_max(amax));
  for (int e = 4 * lane; e < d; e += 4 * kWarpSize) {
    float v[4];
    load_bf16x4(x + e, v);
    uint8_t q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = quantize_e4m3_like_host(v[j], scale);
    store_u8x4(codes + e, q);
  }
  return scale;
}

}  // namespace dsakit::cuda
