// topk_to_kv_mask: top-k positions [T, k] -> dense_mha's kv_mask bits [T, words]: bit p % 32 of
// word p / 32 of row t set exactly for the positions p in row t with 0 <= p < words * 32 (-1
// padding and any other position skipped: the kernel never writes outside the mask). One CTA per
// row: the row's words are built in shared memory (kWindowWords at a time, every position of the
// row read once per window) and then stored whole, so every word is written once.
#include <algorithm>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWindowWords = 4096;  // 16 KiB of shared memory: positions < 131,072 in one pass

__global__ void __launch_bounds__(kThreads) topk_to_kv_mask_kernel(const TopkToKvMaskParams p) {
  __shared__ uint32_t window[kWindowWords];
  const int64_t t = blockIdx.x;
  const int32_t* positions = p.positions + t * p.k;
  uint32_t* row = p.mask + t * p.words;
  for (int64_t w0 = 0; w0 < p.words; w0 += kWindowWords) {
    const int n = int(p.words - w0 < kWindowWords ? p.words - w0 : kWindowWords);
    for (int i = threadIdx.x; i < n; i += kThreads) window[i] = 0u;
    __syncthreads();
    const int64_t lo = w0 * 32, hi = (w0 + n) * 32;  // positions of this window
    for (int j = threadIdx.x; j < p.k; j += kThreads) {
      const int64_t pos = positions[j];
      if (pos >= lo && pos < hi) atomicOr(&window[(pos - lo) / 32], 1u << (pos % 32));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kThreads) row[w0 + i] = window[i];
    __syncthreads();
  }
}

}  // namespace

cudaError_t launch_topk_to_kv_mask(const TopkToKvMaskParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.words == 0) return cudaSuccess;
  if (p.tokens > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  topk_to_kv_mask_kernel<<<unsigned(p.tokens), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
