// indexer_quantize_q: idx_q bf16 [T·H_i, d_i] -> q8 e4m3 [T·H_i, d_i] and the head gate
// g = idx_w · H_i^-0.5 · d_i^-0.5 · s_q (docs/design.md#lightning-indexer). One warp per
// (token, head).
#include "src/cuda/common/quantize.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRowsPerBlock = kThreads / kWarpSize;

__global__ void __launch_bounds__(kThreads) quantize_q_kernel(const QuantizeQParams p) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize;
  if (row >= p.rows) return;  // warp-uniform
  const int lane = threadIdx.x % kWarpSize;
  const float s_q = warp_quantize_pow2(p.idx_q + row * p.d_i, p.d_i, p.q8 + row * p.d_i, lane);
  if (lane == 0) p.gate[row] = p.idx_w[row] * p.head_scale * s_q;
}

}  // namespace

cudaError_t launch_indexer_quantize_q(const QuantizeQParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.d_i % 4 != 0) return cudaErrorInvalidValue;
  const int64_t blocks = ceil_div(p.rows, kRowsPerBlock);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  quantize_q_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
