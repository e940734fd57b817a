// The row-gather bound of the sparse MLA kernels: how fast one SM can pull the selected pool rows
// of a token (by location, in blocks of 64) from L2 into shared memory when nothing else runs.
// Each CTA (one per token and head group, 256 threads) streams its token's rows through a
// three-stage shared-memory ring with 16-byte cp.async (zero-filled for invalid slots, the same
// validity rules as the kernels) and touches nothing else.
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/row_gather.h"
#include "src/cuda/common/device_utils.cuh"

namespace dsakit::bench {
namespace {

constexpr int kThreads = 256, kBlock = 64, kStages = 3;  // 3 x 64 bf16 rows fit 227 KB

__global__ void __launch_bounds__(kThreads) row_gather_kernel(RowGatherParams p) {
  extern __shared__ __align__(128) char ring[];
  const int64_t t = p.num_tokens - 1 - blockIdx.x / p.ctas_per_token;
  const int num_slots = p.topk_length ? min(max(p.topk_length[t], 0), p.topk) : p.topk;
  const int chunks_per_row = p.row_bytes / 16;
  const int chunks = kBlock * chunks_per_row;
  const int32_t* slots = p.indices + t * p.topk;
  const uint32_t base = cuda::smem_addr(ring);
  for (int block = 0; block * kBlock < num_slots; ++block) {
    const uint32_t stage = base + (block % kStages) * chunks * 16;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      const int row = c / chunks_per_row, slot = block * kBlock + row;
      const int64_t loc = slot < num_slots ? int64_t(slots[slot]) : int64_t(-1);
      const bool ok = loc >= 0 && loc < p.num_locations;
      cuda::cp_async_16(stage + c * 16,
                        p.pool + (ok ? loc : 0) * p.row_bytes + (c % chunks_per_row) * 16, ok);
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<kStages - 1>();
  }
  cuda::cp_async_wait<0>();
}

}  // namespace

size_t row_gather_smem_bytes(int row_bytes) {
  return size_t(kStages) * kBlock * row_bytes;
}

cudaError_t launch_row_gather(const RowGatherParams& p, cudaStream_t stream) {
  const size_t smem = row_gather_smem_bytes(p.row_bytes);
  cudaError_t err = cudaFuncSetAttribute(row_gather_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  row_gather_kernel<<<unsigned(p.num_tokens * p.ctas_per_token), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::bench
