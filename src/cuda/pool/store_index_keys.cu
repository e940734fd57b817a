// store_index_keys: quantize indexer keys bf16 [n, d_i] into the index-key pool
// (store_rows.cuh: one warp per key).
#include "src/cuda/pool/store_rows.cuh"

namespace dsakit::cuda {
namespace {

__global__ void __launch_bounds__(kStoreThreads)
    store_index_keys_kernel(const StoreIndexKeysParams p) {
  store_index_keys_block(p, blockIdx.x);
}

}  // namespace

cudaError_t launch_store_index_keys(const StoreIndexKeysParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.d_i % 4 != 0 || p.page_size < 1) return cudaErrorInvalidValue;
  const int64_t blocks = ceil_div(p.n, kKeysPerStoreBlock);
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  store_index_keys_kernel<<<unsigned(blocks), kStoreThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
