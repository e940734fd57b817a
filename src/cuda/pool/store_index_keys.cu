// store_index_keys: quantize indexer keys bf16 [n, d_i] into the index-key pool with the
// power-of-two scale of docs/formats.md#scale-rules. One warp per key (common/quantize.cuh).
// Location l:
//   page = l / page_size, slot = l % page_size, page_bytes = page_size * (d_i + 4);
//   codes at page * page_bytes + slot * d_i,
//   scale at page * page_bytes + page_size * d_i + 4 * slot.
#include "src/cuda/common/quantize.cuh"
#include "src/cuda/pool/kv_pool_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kKeysPerBlock = kThreads / kWarpSize;

__global__ void __launch_bounds__(kThreads) store_index_keys_kernel(const StoreIndexKeysParams p) {
  const int64_t key = int64_t(blockIdx.x) * kKeysPerBlock + threadIdx.x / kWarpSize;
  if (key >= p.n) return;  // warp-uniform
  const int32_t loc = p.locs[key];
  if (loc < 0 || loc >= p.num_locations) return;
  const int64_t page_bytes = int64_t(p.page_size) * (p.d_i + 4);
  uint8_t* page = p.pages + (loc / p.page_size) * page_bytes;
  const int slot = loc % p.page_size;
  const int lane = threadIdx.x % kWarpSize;
  const float scale =
      warp_quantize_pow2(p.keys + key * p.d_i, p.d_i, page + int64_t(slot) * p.d_i, lane);
  if (lane == 0) store_f32(page + int64_t(p.page_size) * p.d_i + 4 * slot, scale);
}

}  // namespace

cudaError_t launch_store_index_keys(const StoreIndexKeysParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.d_i % 4 != 0 || p.page_size < 1) return cudaErrorInvalidValue;
  const int64_t blocks = ceil_div(p.n, kKeysPerBlock);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  store_index_keys_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
