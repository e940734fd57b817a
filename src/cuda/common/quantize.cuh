// Warp-level FP8 quantizer of one d-vector with the indexer's power-of-two scale
// (docs/formats.md#scale-rules): used for indexer keys (pool store) and indexer queries. Formulas
// from dsakit/formats.h.
#pragma once

#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {

// formats.h's quantize_e4m3(x, s) = f32_to_e4m3(x / s) of four values for a power-of-two scale s,
// inv_s = 1 / s (then x · inv_s is x / s exactly), packed little-endian (value j in byte j). The
// hardware conversion rounds to nearest even and saturates to ±448 as f32_to_e4m3 does; a NaN
// quotient gets the host's code, sign | 0x7F with the sign of a NaN x, else of the host's default
// NaN (negative), as quantize_e4m3_like_host.
__device__ __forceinline__ uint32_t quantize_e4m3x4_pow2(const float (&x)[4], float inv_s) {
  float r[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) r[j] = __fmul_rn(x[j], inv_s);
  uint16_t lo, hi;  // cvt puts its first operand in the upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(r[1]), "f"(r[0]));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(r[3]), "f"(r[2]));
  uint32_t codes = uint32_t(lo) | (uint32_t(hi) << 16);
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (isnan(r[j])) {
      const uint32_t sign = isnan(x[j]) ? (f32_bits(x[j]) >> 24) & 0x80u : 0x80u;
      codes = (codes & ~(0xFFu << (8 * j))) | ((sign | 0x7Fu) << (8 * j));
    }
  return codes;
}

// max(amax, |v[0]|, …, |v[3]|); fmaxf skips NaN, as the CPU backend's amax does.
__device__ __forceinline__ float amax_x4(float amax, const float (&v)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
  return amax;
}

// The power-of-two scale s of a vector spread over the warp, from each lane's amax of its values
// (all 32 lanes call it).
__device__ __forceinline__ float warp_pow2_scale(float lane_amax) {
  return indexer_fp8_scale(warp_max(lane_amax));
}

// x bf16 [d] -> codes [d] e4m3(x / s), returns s. All 32 lanes of the warp call it; a lane owns
// the groups of 4 values starting at 4·lane, 4·lane + 128, …; d is a multiple of 4.
__device__ __forceinline__ float warp_quantize_pow2(const bf16_t* x, int d, uint8_t* codes,
                                                    int lane) {
  float amax = 0.0f;
  for (int e = 4 * lane; e < d; e += 4 * kWarpSize) {
    float v[4];
    load_bf16x4(x + e, v);
    amax = amax_x4(amax, v);
  }
  const float scale = warp_pow2_scale(amax), inv_scale = 1.0f / scale;
  for (int e = 4 * lane; e < d; e += 4 * kWarpSize) {
    float v[4];
    load_bf16x4(x + e, v);
    const uint32_t c = quantize_e4m3x4_pow2(v, inv_scale);
    const uint8_t q[4] = {uint8_t(c), uint8_t(c >> 8), uint8_t(c >> 16), uint8_t(c >> 24)};
    store_u8x4(codes + e, q);
  }
  return scale;
}

}  // namespace dsakit::cuda
