// Per-row top-k (docs/design.md, "Top-k"): the k largest of logits[row, 0 … n), n = ctx_len[row];
// ties go to the lower position; NaN ranks below every number; output ascending positions,
// -1 padded. Rows with n <= k select every position without reading the logits.
//
// One 1024-thread block per row:
//   1. radix select on the order-preserving uint32 key of each float, 8 bits per pass from the
//      top (4 passes, shared-memory histogram of 256 bins): finds the k-th largest key K and
//      how many keys equal to K are needed (`need`; the keys above K are k - need);
//   2. compaction in position order, blockDim positions at a time: a position is taken if its
//      key is > K, or == K and fewer than `need` equal keys precede it. Two block-wide exclusive
//      scans (cub::BlockScan) give the equal-key rank and the output slot, so the output is
//      ascending with no sort. Histogram counts are order-independent: same bits every run.
#include <cub/block/block_scan.cuh>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/radix_select.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kRadixBits = 8;
constexpr int kBins = 1 << kRadixBits;

// Larger float -> larger key. NaN -> 0, below -inf (0x007FFFFF); -0 and +0 share one key, as a
// float comparison treats them (ties then go to the lower position).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = f32_bits(x);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0u;
  if (magnitude == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct RadixState {
  uint32_t prefix;  // key bits chosen so far
  int need;         // how many of the keys matching `prefix` are still to be selected
};

// Warp 0 picks the bin (scanning digits from the top) that holds the need-th largest key among
// those matching the prefix, and updates the state. hist: [kBins] counts.
__device__ __forceinline__ void select_bin(const int* hist, int shift, RadixState* state) {
  static_assert(kBins == kRadixBins, "one 8-bit digit per pass");
  RadixBin bin;
  if (find_radix_bin(hist, state->need, bin)) {
    state->prefix |= uint32_t(bin.digit) << shift;
    state->need -= bin.above;
  }
}

__global__ void __launch_bounds__(kThreads) topk_kernel(const TopkParams p) {
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int hist[kBins];
  __shared__ RadixState state;

  const int64_t row = blockIdx.x;
  int32_t* out = p.out + row * int64_t(p.k);
  // A row seeing at most k positions is the identity and reads no logits (p.logits may be null
  // when every row is); a longer one reads at most width entries.
  const int64_t ctx = max(int64_t(p.ctx_len[row]), int64_t(0));
  const int64_t n = ctx <= p.k ? ctx : min(ctx, p.width);
  if (n <= p.k) {
    for (int j = threadIdx.x; j < p.k; j += kThreads) out[j] = j < n ? j : -1;
    return;
  }
  const float* x = p.logits + row * p.width;

  if (threadIdx.x == 0) state = RadixState{0u, p.k};
  for (int shift = 32 - kRadixBits; shift >= 0; shift -= kRadixBits) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();  // hist zeroed; state from the previous pass visible
    const uint32_t prefix = state.prefix;
    const uint32_t high_mask = shift + kRadixBits >= 32 ? 0u : ~0u << (shift + kRadixBits);
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const uint32_t key = order_key(x[i]);
      if ((key & high_mask) == prefix) atomicAdd(&hist[(key >> shift) & (kBins - 1)], 1);
    }
    __syncthreads();  // histogram complete
    if (threadIdx.x < kWarpSize) select_bin(hist, shift, &state);
    __syncthreads();  // state updated before anyone reads it or clears hist
  }
  const uint32_t threshold = state.prefix;
  const int need = state.need;

  int taken = 0, equal_seen = 0;  // block-uniform running totals
  for (int64_t base = 0; base < n && taken < p.k; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const uint32_t key = i < n ? order_key(x[i]) : 0u;
    const int greater = i < n && key > threshold;
    const int equal = i < n && key == threshold;
    int equal_before, equal_total;
    BlockScan(scan_storage).ExclusiveSum(equal, equal_before, equal_total);
    __syncthreads();  // scan_storage is reused
    const int take = greater || (equal && equal_seen + equal_before < need);
    int slot, taken_total;
    BlockScan(scan_storage).ExclusiveSum(take, slot, taken_total);
    __syncthreads();
    slot += taken;
    if (take && slot < p.k) out[slot] = int32_t(i);
    taken += taken_total;
    equal_seen += equal_total;
  }
  for (int j = taken + threadIdx.x; j < p.k; j += kThreads) out[j] = -1;  // never when n > k
}

}  // namespace

cudaError_t launch_topk(const TopkParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX || p.k < 1) return cudaErrorInvalidValue;
  topk_kernel<<<unsigned(p.rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
