// The row-gather bound of the sparse MLA kernels: how fast one SM can pull the selected pool rows
// of a token (by location, in blocks of 64) from L2 into shared memory when nothing else runs.
// Each CTA (one per token and head group, 256 threads) streams its token's rows through a ring
// of as many 64-row stages as fit in shared memory (bf16 rows 3, 656-byte 5, fp8-raw 6; the row
// size a template argument, as in the kernels) with
// 16-byte cp.async (zero-filled for invalid slots, the same validity rules as the kernels),
// keeping all but one stage in flight, and touches nothing else. Warp w copies rows
// [8w, 8w + 8) of a block: lane r < 8 holds row 8w + r's location (loaded a block ahead), and at
// step i the lanes take consecutive 16-byte chunks 32i + lane of those rows (a few 128-byte lines
// per instruction, as the sparse kernels' producers copy).
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/row_gather.h"
#include "src/cuda/common/device_utils.cuh"

namespace dsakit::bench {
namespace {

constexpr int kThreads = 256, kBlock = 64, kWarpRows = kBlock / (kThreads / 32);
constexpr size_t kSmemLimit = 227 * 1024;

// The stages of a row size: as many 64-row blocks as fit, at most 6.
template <int kRowBytes>
constexpr int kStagesFor = kSmemLimit / (kBlock * kRowBytes) < 6
                               ? int(kSmemLimit / (kBlock * kRowBytes))
                               : 6;

template <int kRowBytes>
__global__ void __launch_bounds__(kThreads) row_gather_kernel(RowGatherParams p) {
  constexpr int kStages = kStagesFor<kRowBytes>, kRowChunks = kRowBytes / 16;
  constexpr int kWarpChunks = kWarpRows * kRowChunks;
  static_assert(kStages >= 2 && kRowBytes % 16 == 0);
  extern __shared__ __align__(128) char ring[];
  const int64_t t = p.num_tokens - 1 - blockIdx.x / p.ctas_per_token;
  const int num_slots = p.topk_length ? min(max(p.topk_length[t], 0), p.topk) : p.topk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* slots = p.indices + t * p.topk;
  // This lane's row (lane % 8) of the warp's eight in `block`, or -1 where it reads nothing.
  const auto location = [&](int block) -> int32_t {
    const int slot = block * kBlock + kWarpRows * warp + lane % kWarpRows;
    const int32_t loc = slot < num_slots ? slots[slot] : -1;
    return loc >= 0 && loc < p.num_locations ? loc : -1;
  };
  const uint32_t base = cuda::smem_addr(ring) + kWarpRows * warp * kRowBytes;
  int32_t loc = location(0);
  for (int block = 0; block * kBlock < num_slots; ++block) {
    const int32_t next = location(block + 1);
    const uint32_t stage = base + (block % kStages) * kBlock * kRowBytes;
#pragma unroll
    for (int i = 0; i < (kWarpChunks + 31) / 32; ++i) {
      const int f = 32 * i + lane, r = f / kRowChunks, c = f - r * kRowChunks;
      const int32_t row_loc = __shfl_sync(0xffffffffu, loc, r % kWarpRows);
      if (kWarpChunks % 32 == 0 || f < kWarpChunks)
        cuda::cp_async_16(stage + r * kRowBytes + 16 * c,
                          p.pool + int64_t(max(row_loc, 0)) * kRowBytes + 16 * c, row_loc >= 0);
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<kStages - 1>();
    loc = next;
  }
  cuda::cp_async_wait<0>();
}

template <int kRowBytes>
cudaError_t launch(const RowGatherParams& p, cudaStream_t stream) {
  const size_t smem = size_t(kStagesFor<kRowBytes>) * kBlock * kRowBytes;
  const cudaError_t err = cudaFuncSetAttribute(
      row_gather_kernel<kRowBytes>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  row_gather_kernel<kRowBytes>
      <<<unsigned(p.num_tokens * p.ctas_per_token), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_row_gather(const RowGatherParams& p, cudaStream_t stream) {
  switch (p.row_bytes) {  // the pool layouts' rows: bf16, 656-byte, fp8-raw
    case 1152:
      return launch<1152>(p, stream);
    case 656:
      return launch<656>(p, stream);
    case 576:
      return launch<576>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dsakit::bench
