// Per-row top-k (docs/design.md, "Top-k"): the k largest of logits[row, 0 … n), n = ctx_len[row];
// ties go to the lower position; NaN ranks below every number; output ascending positions,
// -1 padded. Rows with n <= k select every position without reading the logits.
//
// One 1024-thread block per row:
//   1. the row's order-preserving uint32 keys (one per float) go to shared memory when the row
//      fits (kSmemKeys), else every pass reads the logits again;
//   2. radix select, 8 bits per pass from the top (4 passes, a 256-bin shared histogram fed by
//      warp-aggregated atomics: lanes with the same digit add once): finds the k-th largest key
//      K and how many keys equal to K are needed (`need`; the keys above K are k - need);
//   3. compaction in position order with no block-wide scans: each warp owns a contiguous span
//      of positions, counts the keys it takes (> K) and its keys == K; one warp scans the 32
//      counts; then each warp writes its positions at its offset, 32 at a time by ballot, taking
//      a key == K only while fewer than `need` precede it. The output is ascending with no sort;
//      counts are order-independent: the same bits every run.
#include <algorithm>
#include <atomic>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/launch.h"
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

// Adds 1 to hist[digit] for every lane of the warp that passes `active`, one atomic per
// distinct digit (lanes with the same digit are counted by their lowest lane).
__device__ __forceinline__ void warp_histogram_add(int* hist, uint32_t digit, bool active) {
  const unsigned voting = __ballot_sync(0xFFFFFFFFu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(voting, digit);
  if ((threadIdx.x % kWarpSize) == unsigned(__ffs(peers) - 1))
    atomicAdd(&hist[digit], __popc(peers));
}

// Positions whose keys the block keeps in shared memory (a 160 KB row): longer rows re-read
// the logits in every pass.
constexpr int kSmemKeys = 40 * 1024;

__global__ void __launch_bounds__(kThreads) topk_kernel(const TopkParams p, int smem_keys) {
  __shared__ int hist[kBins];
  __shared__ RadixState state;
  __shared__ int warp_taken[kThreads / kWarpSize], warp_equal[kThreads / kWarpSize];
  extern __shared__ uint32_t keys_s[];  // [smem_keys]

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
  const bool in_smem = n <= smem_keys;
  if (in_smem)
    for (int64_t i = threadIdx.x; i < n; i += kThreads) keys_s[i] = order_key(x[i]);
  const auto key_at = [&](int64_t i) { return in_smem ? keys_s[i] : order_key(x[i]); };

  if (threadIdx.x == 0) state = RadixState{0u, p.k};
  for (int shift = 32 - kRadixBits; shift >= 0; shift -= kRadixBits) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) hist[b] = 0;
    __syncthreads();  // hist zeroed; keys staged; state from the previous pass visible
    const uint32_t prefix = state.prefix;
    const uint32_t high_mask = shift + kRadixBits >= 32 ? 0u : ~0u << (shift + kRadixBits);
    // Whole warps iterate together (the aggregation votes across the warp).
    for (int64_t base = 0; base < n; base += kThreads) {
      const int64_t i = base + threadIdx.x;
      const uint32_t key = i < n ? key_at(i) : 0u;
      warp_histogram_add(hist, (key >> shift) & (kBins - 1), i < n && (key & high_mask) == prefix);
    }
    __syncthreads();  // histogram complete
    if (threadIdx.x < kWarpSize) select_bin(hist, shift, &state);
    __syncthreads();  // state updated before anyone reads it or clears hist
  }
  const uint32_t threshold = state.prefix;
  const int need = state.need;

  // Compaction: warp w owns positions [w·span, (w+1)·span).
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  constexpr int kWarps = kThreads / kWarpSize;
  const int64_t span = (n + kWarps - 1) / kWarps;
  const int64_t begin = min(n, warp * span), end = min(n, begin + span);
  int taken = 0, equal = 0;
  for (int64_t i = begin + lane; i < end; i += kWarpSize) {
    const uint32_t key = key_at(i);
    taken += key > threshold;
    equal += key == threshold;
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    taken += __shfl_xor_sync(0xFFFFFFFFu, taken, offset);
    equal += __shfl_xor_sync(0xFFFFFFFFu, equal, offset);
  }
  if (lane == 0) {
    warp_taken[warp] = taken;
    warp_equal[warp] = equal;
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scans of the per-warp counts, in place
    const int t = warp_taken[lane], e = warp_equal[lane];
    int t_incl = t, e_incl = e;
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int tv = __shfl_up_sync(0xFFFFFFFFu, t_incl, offset);
      const int ev = __shfl_up_sync(0xFFFFFFFFu, e_incl, offset);
      if (lane >= offset) t_incl += tv, e_incl += ev;
    }
    __syncwarp();
    warp_taken[lane] = t_incl - t;  // greater keys before this warp's span
    warp_equal[lane] = e_incl - e;  // equal keys before it
  }
  __syncthreads();
  // This warp's first output slot: the greater keys before it plus the equal keys taken before it.
  int equal_seen = warp_equal[warp];
  int slot = warp_taken[warp] + min(equal_seen, need);
  const unsigned below = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += kWarpSize) {
    const int64_t i = base + lane;
    const uint32_t key = i < end ? key_at(i) : 0u;
    const bool is_equal = i < end && key == threshold;
    const unsigned eq = __ballot_sync(0xFFFFFFFFu, is_equal);
    const bool take =
        (i < end && key > threshold) || (is_equal && equal_seen + __popc(eq & below) < need);
    const unsigned took = __ballot_sync(0xFFFFFFFFu, take);
    if (take) out[slot + __popc(took & below)] = int32_t(i);
    slot += __popc(took);
    equal_seen += __popc(eq);
  }
}

}  // namespace

cudaError_t launch_topk(const TopkParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX || p.k < 1) return cudaErrorInvalidValue;
  // Shared memory for the longest row's keys (none when every row is the identity).
  const int smem_keys =
      p.logits == nullptr || p.width <= p.k ? 0 : int(std::min<int64_t>(p.width, kSmemKeys));
  const size_t smem = size_t(smem_keys) * sizeof(uint32_t);
  static std::atomic<uint64_t> smem_set{0};
  const cudaError_t err = opt_in_dynamic_smem(reinterpret_cast<const void*>(&topk_kernel),
                                              int(kSmemKeys * sizeof(uint32_t)), smem_set);
  if (err != cudaSuccess) return err;
  topk_kernel<<<unsigned(p.rows), kThreads, smem, stream>>>(p, smem_keys);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
