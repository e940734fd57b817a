// positions_to_locations: top-k positions [T, k] -> pool locations [T, k]:
// out[t, j] = kv_locs[kv_start[t] + pos] for pos = positions[t, j] in [0, ctx_len[t]) whose
// kv_locs index is in range, else -1 (kv_locs null: kv_start[t] + pos, the identity). One
// thread per entry, grid-stride.
#include <algorithm>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    positions_to_locations_kernel(const PositionsToLocationsParams p) {
  const int64_t total = p.tokens * p.k;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * kThreads) {
    const int64_t t = i / p.k;
    const int32_t pos = p.positions[i];
    const int64_t j = int64_t(p.kv_start[t]) + pos;
    const bool valid = pos >= 0 && pos < p.ctx_len[t] && j >= 0 && j < p.n_kv;
    p.out[i] = !valid ? -1 : p.kv_locs != nullptr ? p.kv_locs[j] : int32_t(j);
  }
}

}  // namespace

cudaError_t launch_positions_to_locations(const PositionsToLocationsParams& p,
                                          cudaStream_t stream) {
  const int64_t total = p.tokens * p.k;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>(ceil_div(total, kThreads), 65536);
  positions_to_locations_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
