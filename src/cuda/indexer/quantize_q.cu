// indexer_quantize_q: idx_q bf16 [T·H_i, d_i] -> q8 e4m3 [T·H_i, d_i] and the head gate
// g = idx_w · H_i^-0.5 · d_i^-0.5 · s_q (docs/design.md#lightning-indexer). One warp per
// (token, head) row; at d_i = 128 (both presets) a warp takes kRowsPerWarp rows and issues all
// their loads (8 bytes per lane per row) before the first reduction, so enough bytes are in
// flight to run at copy bandwidth.
#include "src/cuda/common/quantize.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kRowsPerWarp = 4;  // d_i = 128 kernel

__global__ void __launch_bounds__(kThreads) quantize_q_kernel(const QuantizeQParams p) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;  // warp-uniform
  const int lane = threadIdx.x % kWarpSize;
  const float s_q = warp_quantize_pow2(p.idx_q + row * p.d_i, p.d_i, p.q8 + row * p.d_i, lane);
  if (lane == 0) p.gate[row] = p.idx_w[row] * p.head_scale * s_q;
}

// d_i = 128: lane l holds values [4l, 4l + 4) of each of its warp's rows: one 8-byte load and one
// 4-byte store per row (the launcher checks idx_q 8-byte and q8 4-byte aligned; rows keep it).
__global__ void __launch_bounds__(kThreads) quantize_q128_kernel(const QuantizeQParams p) {
  constexpr int kDim = 128;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize) * kRowsPerWarp;
  const int lane = threadIdx.x % kWarpSize;
  uint2 raw[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    raw[r] = row0 + r < p.rows
                 ? __ldg(reinterpret_cast<const uint2*>(p.idx_q + (row0 + r) * kDim) + lane)
                 : make_uint2(0u, 0u);
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = row0 + r;
    if (row >= p.rows) break;  // warp-uniform
    const float v[4] = {f32_from_bits(raw[r].x << 16), f32_from_bits(raw[r].x & 0xFFFF0000u),
                        f32_from_bits(raw[r].y << 16), f32_from_bits(raw[r].y & 0xFFFF0000u)};
    const float s_q = warp_pow2_scale(amax_x4(0.0f, v));
    reinterpret_cast<uint32_t*>(p.q8 + row * kDim)[lane] = quantize_e4m3x4_pow2(v, 1.0f / s_q);
    if (lane == 0) p.gate[row] = p.idx_w[row] * p.head_scale * s_q;
  }
}

}  // namespace

cudaError_t launch_indexer_quantize_q(const QuantizeQParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.d_i % 4 != 0) return cudaErrorInvalidValue;
  const bool aligned = (reinterpret_cast<uintptr_t>(p.idx_q) % 8 == 0) &&
                       (reinterpret_cast<uintptr_t>(p.q8) % 4 == 0);
  if (p.d_i == 128 && aligned) {
    const int64_t blocks = ceil_div(p.rows, int64_t(kWarps) * kRowsPerWarp);
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    quantize_q128_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p);
  } else {
    const int64_t blocks = ceil_div(p.rows, kWarps);
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
    quantize_q_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
