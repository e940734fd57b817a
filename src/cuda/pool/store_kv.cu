// store_kv: quantize n latent tokens (c_kv bf16 [n, d_c], k_pe bf16 [n, d_rope]) into their pool
// rows, one block per token (store_rows.cuh); store_tokens: that and store_index_keys in one
// launch (blocks [0, n) the latent rows, the rest the indexer keys).
#include "src/cuda/common/dispatch.h"
#include "src/cuda/pool/store_rows.cuh"

namespace dsakit::cuda {
namespace {

template <KvLayout kLayout>
__global__ void __launch_bounds__(kStoreThreads) store_kv_kernel(const StoreKvParams p) {
  store_kv_row<kLayout>(p, blockIdx.x);
}

template <KvLayout kLayout>
__global__ void __launch_bounds__(kStoreThreads)
    store_tokens_kernel(const StoreKvParams kv, const StoreIndexKeysParams keys) {
  if (blockIdx.x < kv.n)
    store_kv_row<kLayout>(kv, blockIdx.x);
  else
    store_index_keys_block(keys, blockIdx.x - kv.n);
}

bool store_kv_accepts(const StoreKvParams& p) {
  return p.n <= INT32_MAX && p.row.d_c % kFp8TileSize == 0 && p.row.d_rope % 8 == 0;
}

bool store_index_keys_accepts(const StoreIndexKeysParams& p) {
  return p.d_i % 4 == 0 && p.page_size >= 1;
}

}  // namespace

cudaError_t launch_store_kv(const StoreKvParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (!store_kv_accepts(p)) return cudaErrorInvalidValue;
  const bool known = dispatch_kv_layout(p.row.layout, [&](auto layout) {
    store_kv_kernel<decltype(layout)::value><<<unsigned(p.n), kStoreThreads, 0, stream>>>(p);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

cudaError_t launch_store_tokens(const StoreKvParams& kv, const StoreIndexKeysParams& keys,
                                cudaStream_t stream) {
  if (!store_kv_accepts(kv) || !store_index_keys_accepts(keys)) return cudaErrorInvalidValue;
  const int64_t blocks = kv.n + ceil_div(keys.n, kKeysPerStoreBlock);
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const bool known = dispatch_kv_layout(kv.row.layout, [&](auto layout) {
    store_tokens_kernel<decltype(layout)::value>
        <<<unsigned(blocks), kStoreThreads, 0, stream>>>(kv, keys);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace dsakit::cuda
