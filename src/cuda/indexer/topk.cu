// Per-row top-k (docs/design.md, "Top-k"): the k largest of logits[row, 0 … n), n = ctx_len[row];
// ties go to the lower position; NaN ranks below every number; output ascending positions,
// -1 padded. Rows with n <= k select every position without reading the logits.
//
// One block of kThreads (256, 512 or 1024; topk_threads_for) per row, on order-preserving uint32
// keys (one per float):
//   A. one read of the row: each key goes to shared memory (when the row fits, kSmemKeys) and its
//      top kCoarseBits bits into a shared histogram; one block scan finds the coarse bin B that
//      holds the k-th largest key and how many of B's keys are needed;
//   B. each warp, over its contiguous span of positions, counts the keys above B and appends B's
//      keys (key, position) to a candidate list that reuses the histogram's space;
//   C. radix select over the candidates' remaining 20 bits (8, 8, 4 per pass, a 256-bin shared
//      histogram fed by warp-aggregated atomics) finds the k-th largest key K and how many keys
//      equal to K are needed (`need`; the keys above K are k - need). When B holds more keys than
//      the list takes (kMaxCandidates: many near-equal scores), C runs over the whole row
//      instead and B only counts;
//   D. compaction in position order with no block-wide scans: the per-warp counts of keys taken
//      (> K) and keys == K (from B and the candidates, or from one more pass over the row) are
//      scanned by one warp; then each warp writes its positions at its offset, 32 at a time by
//      ballot, taking a key == K only while fewer than `need` precede it. The output is ascending
//      with no sort; every count is order-independent: the same bits every run.
#include <algorithm>
#include <atomic>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/launch.h"
#include "src/cuda/common/radix_select.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kCoarseBits = 12;
constexpr int kCoarseBins = 1 << kCoarseBits;
constexpr int kCoarseShift = 32 - kCoarseBits;
constexpr int kRadixBits = 8;  // the fine passes take bits [12, 20), [4, 12) and [0, 4)
constexpr int kFinePasses = (kCoarseShift + kRadixBits - 1) / kRadixBits;

// Positions whose keys the block keeps in shared memory (a 160 KB row): longer rows re-read
// the logits in passes B–D.
constexpr int kSmemKeys = 40 * 1024;

// Larger float -> larger key. NaN -> 0, below -inf (0x007FFFFF); -0 and +0 share one key, as a
// float comparison treats them (ties then go to the lower position).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = f32_bits(x);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0u;
  if (magnitude == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct Candidate {
  uint32_t key;
  int32_t pos;
};
// The candidate list lives in the coarse histogram's bytes once B is known.
constexpr int kMaxCandidates = kCoarseBins * int(sizeof(int)) / int(sizeof(Candidate));

struct RadixState {
  uint32_t prefix;  // key bits chosen so far
  int need;         // how many of the keys matching `prefix` are still to be selected
  int matching;     // keys matching `prefix` after the coarse pass (the size of bin B)
};

template <int kThreads>
struct TopkShared {
  static constexpr int kWarps = kThreads / kWarpSize;
  union {
    int coarse_hist[kCoarseBins];          // pass A
    Candidate candidates[kMaxCandidates];  // passes B-D, when B's keys fit
  };
  int hist[kFinePasses][kRadixBins];  // pass C, one histogram per pass (zeroed up front)
  int warp_prefix[kWarps];            // the coarse bin scan
  int warp_taken[kWarps], warp_equal[kWarps];
  int num_candidates;
  RadixState state;
};

// Adds 1 to hist[digit] for every lane of the warp that passes `active`, one atomic per
// distinct digit (lanes with the same digit are counted by their lowest lane).
__device__ __forceinline__ void warp_histogram_add(int* hist, uint32_t digit, bool active) {
  const unsigned voting = __ballot_sync(0xFFFFFFFFu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(voting, digit);
  if ((threadIdx.x % kWarpSize) == unsigned(__ffs(peers) - 1))
    atomicAdd(&hist[digit], __popc(peers));
}

// After pass A (the coarse histogram complete and visible): the bin B holding the k-th largest
// key. Thread t owns the kPer bins just below kCoarseBins − t·kPer, so the block's exclusive scan
// of the per-thread sums counts the keys above each thread's bins. Ends with a barrier after
// which `state` holds B and every read of the histogram is done (its space may be reused).
template <int kThreads>
__device__ __forceinline__ void select_coarse_bin(TopkShared<kThreads>& sh, int k) {
  constexpr int kPer = kCoarseBins / kThreads;
  static_assert(kPer % 4 == 0 && kCoarseBins % kThreads == 0, "int4 reads of whole bins");
  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  const int lowest = kCoarseBins - (int(threadIdx.x) + 1) * kPer;  // this thread's lowest bin
  int count[kPer], local = 0;
#pragma unroll
  for (int j = 0; j < kPer; j += 4) {
    const int4 c = *reinterpret_cast<const int4*>(&sh.coarse_hist[lowest + j]);
    count[j] = c.x, count[j + 1] = c.y, count[j + 2] = c.z, count[j + 3] = c.w;
    local += c.x + c.y + c.z + c.w;
  }
  const int inclusive = warp_inclusive_sum(local);
  if (lane == kWarpSize - 1) sh.warp_prefix[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int s = lane < TopkShared<kThreads>::kWarps ? sh.warp_prefix[lane] : 0;
    const int before = warp_inclusive_sum(s) - s;
    __syncwarp();
    if (lane < TopkShared<kThreads>::kWarps) sh.warp_prefix[lane] = before;
  }
  __syncthreads();
  int above = sh.warp_prefix[warp] + inclusive - local;
  if (above < k && k <= above + local) {  // exactly one thread: its bins hold the k-th key
#pragma unroll
    for (int j = kPer - 1; j >= 0; --j) {
      if (above < k && k <= above + count[j])
        sh.state = RadixState{uint32_t(lowest + j) << kCoarseShift, k - above, count[j]};
      above += count[j];
    }
  }
  __syncthreads();
}

// Pass C over `count` keys key_of(j) (only those matching the state's prefix in the bits above
// a pass take part): radix passes of 8, 8 and 4 bits below the coarse digit leave the whole k-th
// key in state.prefix. Starts after a barrier that made the keys, the state and the zeroed
// histograms visible; ends with one.
template <int kThreads, typename KeyOf>
__device__ __forceinline__ void select_fine_bits(TopkShared<kThreads>& sh, int64_t count,
                                                 KeyOf key_of) {
  int pass = 0;
#pragma unroll 1
  for (int high = kCoarseShift; high > 0; ++pass) {  // bits [high - bits, high) this pass
    const int bits = min(kRadixBits, high), shift = high - bits;
    int* hist = sh.hist[pass];
    const uint32_t prefix = sh.state.prefix, decided = ~0u << high;
    // Whole warps iterate together (the aggregation votes across the warp).
    for (int64_t base = 0; base < count; base += kThreads) {
      const int64_t j = base + threadIdx.x;
      const uint32_t key = j < count ? key_of(j) : 0u;
      warp_histogram_add(hist, (key >> shift) & ((1u << bits) - 1u),
                         j < count && (key & decided) == prefix);
    }
    __syncthreads();  // histogram complete
    if (threadIdx.x < kWarpSize) {
      RadixBin bin;
      if (find_radix_bin(hist, sh.state.need, bin)) {
        sh.state.prefix |= uint32_t(bin.digit) << shift;
        sh.state.need -= bin.above;
      }
    }
    __syncthreads();  // state updated before anyone reads it
    high = shift;
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads) topk_kernel(const TopkParams p, int smem_keys) {
  constexpr int kWarps = TopkShared<kThreads>::kWarps;
  __shared__ TopkShared<kThreads> sh;
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
  const auto key_at = [&](int64_t i) { return in_smem ? keys_s[i] : order_key(x[i]); };
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;

  // A. One read of the row: keys to shared memory, their coarse digits counted.
  for (int b = threadIdx.x; b < kCoarseBins; b += kThreads) sh.coarse_hist[b] = 0;
  for (int b = threadIdx.x; b < kRadixBins; b += kThreads)
    for (int pass = 0; pass < kFinePasses; ++pass) sh.hist[pass][b] = 0;
  if (threadIdx.x == 0) sh.num_candidates = 0;
  __syncthreads();
  constexpr int kLoads = 4;  // loads in flight per thread
  for (int64_t base = 0; base < n; base += int64_t(kThreads) * kLoads) {
    float v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      v[u] = i < n ? __ldg(x + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t i = base + u * kThreads + threadIdx.x;
      if (i >= n) break;
      const uint32_t key = order_key(v[u]);
      if (in_smem) keys_s[i] = key;
      atomicAdd(&sh.coarse_hist[key >> kCoarseShift], 1);
    }
  }
  __syncthreads();  // histogram complete, keys staged
  select_coarse_bin(sh, p.k);
  const uint32_t coarse = sh.state.prefix >> kCoarseShift;
  const bool listed = sh.state.matching <= kMaxCandidates;

  // B. Warp w owns positions [w·span, (w+1)·span): it counts the keys above B and lists B's keys.
  const int64_t span = (n + kWarps - 1) / kWarps;
  const int64_t begin = min(n, warp * span), end = min(n, begin + span);
  const unsigned below = (1u << lane) - 1u;
  if (listed) {
    int above = 0;
    for (int64_t base = begin; base < end; base += kWarpSize) {  // whole warps (ballots)
      const int64_t i = base + lane;
      const uint32_t key = i < end ? key_at(i) : 0u;
      const uint32_t digit = key >> kCoarseShift;
      above += i < end && digit > coarse;
      const bool in_bin = i < end && digit == coarse;
      const unsigned list = __ballot_sync(0xFFFFFFFFu, in_bin);
      if (list == 0u) continue;
      const int leader = __ffs(list) - 1;
      int first = 0;
      if (lane == leader) first = atomicAdd(&sh.num_candidates, __popc(list));
      first = __shfl_sync(0xFFFFFFFFu, first, leader);
      if (in_bin) sh.candidates[first + __popc(list & below)] = Candidate{key, int32_t(i)};
    }
    above = warp_sum(above);
    if (lane == 0) {
      sh.warp_taken[warp] = above;
      sh.warp_equal[warp] = 0;
    }
    __syncthreads();  // candidates listed, counts of keys above B written
    // C over the list, then the candidates' share of D's per-warp counts.
    const int listed_count = sh.num_candidates;
    select_fine_bits(sh, listed_count, [&](int64_t j) { return sh.candidates[j].key; });
    const uint32_t threshold = sh.state.prefix;
    for (int j = threadIdx.x; j < listed_count; j += kThreads) {
      const Candidate c = sh.candidates[j];
      const int owner = int(c.pos / span);
      if (c.key > threshold) atomicAdd(&sh.warp_taken[owner], 1);
      if (c.key == threshold) atomicAdd(&sh.warp_equal[owner], 1);
    }
  } else {
    // C over the whole row (the keys outside B do not match the coarse prefix), then D's counts.
    select_fine_bits(sh, n, key_at);
    const uint32_t threshold = sh.state.prefix;
    int taken = 0, equal = 0;
    for (int64_t i = begin + lane; i < end; i += kWarpSize) {
      const uint32_t key = key_at(i);
      taken += key > threshold;
      equal += key == threshold;
    }
    taken = warp_sum(taken);
    equal = warp_sum(equal);
    if (lane == 0) {
      sh.warp_taken[warp] = taken;
      sh.warp_equal[warp] = equal;
    }
  }
  __syncthreads();  // per-warp counts complete
  const uint32_t threshold = sh.state.prefix;
  const int need = sh.state.need;

  // D. Exclusive scans of the per-warp counts, in place, then the ordered writes.
  if (warp == 0) {
    const int t = lane < kWarps ? sh.warp_taken[lane] : 0;
    const int e = lane < kWarps ? sh.warp_equal[lane] : 0;
    const int t_before = warp_inclusive_sum(t) - t, e_before = warp_inclusive_sum(e) - e;
    __syncwarp();
    if (lane < kWarps) {
      sh.warp_taken[lane] = t_before;  // keys taken (> K) before this warp's span
      sh.warp_equal[lane] = e_before;  // keys == K before it
    }
  }
  __syncthreads();
  // This warp's first output slot: the greater keys before it plus the equal keys taken before it.
  int equal_seen = sh.warp_equal[warp];
  int slot = sh.warp_taken[warp] + min(equal_seen, need);
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

template <int kThreads>
cudaError_t run_topk(const TopkParams& p, cudaStream_t stream) {
  // Shared memory for the longest row's keys (none when every row is the identity).
  const int smem_keys =
      p.logits == nullptr || p.width <= p.k ? 0 : int(std::min<int64_t>(p.width, kSmemKeys));
  const size_t smem = size_t(smem_keys) * sizeof(uint32_t);
  static std::atomic<uint64_t> smem_set{0};
  const cudaError_t err = opt_in_dynamic_smem(reinterpret_cast<const void*>(&topk_kernel<kThreads>),
                                              int(kSmemKeys * sizeof(uint32_t)), smem_set);
  if (err != cudaSuccess) return err;
  topk_kernel<kThreads><<<unsigned(p.rows), kThreads, smem, stream>>>(p, smem_keys);
  return cudaGetLastError();
}

}  // namespace

// 256 threads while a row's keys are few (more rows resident per SM), 1024 once they are many
// (docs/perf.md, the top-k rows per block size).
int topk_threads_for(int64_t width) {
  return width <= 8192 ? 256 : 1024;
}

cudaError_t launch_topk(const TopkParams& p, int threads, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX || p.k < 1) return cudaErrorInvalidValue;
  switch (threads == 0 ? topk_threads_for(p.width) : threads) {
    case 256:
      return run_topk<256>(p, stream);
    case 512:
      return run_topk<512>(p, stream);
    case 1024:
      return run_topk<1024>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dsakit::cuda
