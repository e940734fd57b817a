// One step of a most-significant-digit-first radix select, shared by the top-k kernels
// (indexer/topk.cu, dcp/dcp_kernels.cu): given the histogram of one 8-bit digit over the keys that
// match the digits chosen so far, find the bin holding the need-th largest of them.
#pragma once

#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {

inline constexpr int kRadixBins = 256;

struct RadixBin {
  int digit;  // the bin's digit value
  int above;  // keys in the bins of larger digits
  int count;  // keys in this bin
};

// Called by the 32 lanes of one warp (lane = threadIdx.x % 32); lane l reads the 8 bins of digits
// 255 − 8l … 248 − 8l (largest first). hist: [kRadixBins] counts, visible to the warp;
// 1 <= need <= Σ hist. Returns true in exactly one lane, the one owning the bin that holds the
// need-th largest key, and fills `bin` there. Every lane has read hist (and whatever the caller
// read before the call) before any lane returns, so the returning lane may write shared state.
__device__ __forceinline__ bool find_radix_bin(const int* hist, int need, RadixBin& bin) {
  static_assert(kRadixBins == 8 * kWarpSize, "a lane owns 8 bins");
  const int lane = int(threadIdx.x) % kWarpSize;
  int count[8], local = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    count[j] = hist[kRadixBins - 1 - 8 * lane - j];
    local += count[j];
  }
  const int inclusive = warp_inclusive_sum(local);
  // The shuffles converge the warp but do not order its shared-memory accesses: without this, a
  // lane's read before the call could race with the selecting lane's write after it (racecheck).
  __syncwarp();
  int above = inclusive - local;  // keys in the bins of the lanes before this one
  if (!(above < need && need <= inclusive)) return false;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (above + count[j] >= need) {
      bin = {kRadixBins - 1 - 8 * lane - j, above, count[j]};
      return true;
    }
    above += count[j];
  }
  return false;
}

}  // namespace dsakit::cuda
