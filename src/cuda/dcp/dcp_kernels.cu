// Context-parallelism kernels (docs/layer.md).
//
// select_rows: dst[i] = src[rows[i]] as bytes. A group of threads per output row (a warp, or the
// whole 256-thread block for rows of 512 moves or more), grid-stride over rows; each move is the
// widest of 16, 8, 4, 2, 1 bytes that divides the row size and both base addresses. A row index
// outside [0, n) writes nothing.
//
// merge_topk: one block per row t over its n = shards * c candidates, held in dynamic shared
// memory as 64-bit keys, larger = better:
//   invalid (position < 0)  -> 0
//   valid                   -> ordered(score) << 32 | (0xFFFFFFFF - position)
// ordered() maps floats to uint32 in float order (-0 and +0 share one key, as a float comparison
// treats them) with every NaN at 1: below -inf (0x007FFFFF), above an invalid candidate. With
// distinct positions the keys of a row are distinct, so the best k are one set: higher score
// first, ties to the lower position.
//   1. load the positions (keys without their score half) and count the valid ones;
//   2. count > k only: the scores fill in the high halves, and a radix select over the valid
//      keys, 8 bits per pass from the top (256-bin shared histogram), finds the prefix of the
//      k-th best key and how many keys with that prefix are still needed; it stops early once
//      every key with the prefix is needed;
//   3. compaction: the keys above the prefix, and the needed ones equal to it (count <= k: every
//      valid key), give their positions to `chosen` (warp-aggregated atomic slots);
//   4. bitonic sort of the chosen positions (padded with 0xFFFFFFFF to a power of two),
//      ascending, written with -1 padding.
// Slots and the equal-prefix quota are taken in a run-dependent order, but the chosen set is
// not: either every key with the final prefix is taken, or the select ran to the last bit and
// the keys equal to the threshold are equal keys (one position). The sort then fixes the order,
// so the same input gives the same bits.
#include <algorithm>
#include <atomic>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/launch.h"
#include "src/cuda/common/radix_select.cuh"
#include "src/cuda/dcp/dcp_kernels.h"

namespace dsakit::cuda {
namespace {

// ---- select_rows ---------------------------------------------------------------------------

constexpr int kSelectThreads = 256;
constexpr int64_t kBlockPerRowMoves = 512;  // rows of at least this many moves take a block

template <typename V, int kGroup>
__global__ void __launch_bounds__(kSelectThreads) select_rows_kernel(const SelectRowsParams p) {
  constexpr int kGroups = kSelectThreads / kGroup;
  const int group = int(threadIdx.x) / kGroup, lane = int(threadIdx.x) % kGroup;
  const int64_t moves = p.row_bytes / int64_t(sizeof(V));
  const V* src = static_cast<const V*>(p.src);
  V* dst = static_cast<V*>(p.dst);
  for (int64_t i = int64_t(blockIdx.x) * kGroups + group; i < p.m;
       i += int64_t(gridDim.x) * kGroups) {
    const int32_t r = p.rows[i];
    if (r < 0 || r >= p.n) continue;
    const V* from = src + int64_t(r) * moves;
    V* to = dst + i * moves;
    for (int64_t v = lane; v < moves; v += kGroup) to[v] = from[v];
  }
}

template <typename V>
cudaError_t launch_select_rows_as(const SelectRowsParams& p, cudaStream_t stream) {
  const int64_t moves = p.row_bytes / int64_t(sizeof(V));
  const bool block_per_row = moves >= kBlockPerRowMoves;
  const int64_t rows_per_block = block_per_row ? 1 : kSelectThreads / kWarpSize;
  const int64_t blocks = std::min<int64_t>(ceil_div(p.m, rows_per_block), 65536);
  if (block_per_row)
    select_rows_kernel<V, kSelectThreads><<<unsigned(blocks), kSelectThreads, 0, stream>>>(p);
  else
    select_rows_kernel<V, kWarpSize><<<unsigned(blocks), kSelectThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// ---- merge_topk ----------------------------------------------------------------------------

constexpr int kMergeMaxThreads = 1024;
constexpr int kRadixBits = 8;
constexpr int kBins = 1 << kRadixBits;
constexpr int kDefaultSmemBytes = 48 << 10;

// Dynamic shared memory of a row of n candidates with k to choose: n keys, then the chosen
// positions padded to a power of two (at most min(n, k) of them are chosen).
constexpr int merge_topk_smem_bytes(int n, int k) {
  int chosen_len = 1;
  while (chosen_len < std::min(n, k)) chosen_len <<= 1;
  return n * int(sizeof(uint64_t)) + chosen_len * int(sizeof(uint32_t));
}
constexpr int kMergeMaxSmemBytes =
    merge_topk_smem_bytes(kMergeTopkMaxCandidates, kMergeTopkMaxCandidates);  // 192 KiB

// Larger float -> larger key; -0 and +0 share one; every NaN -> 1 (-inf is 0x007FFFFF).
__device__ __forceinline__ uint32_t ordered(float x) {
  uint32_t u = f32_bits(x);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 1u;
  if (magnitude == 0u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct SelectState {
  unsigned long long prefix;  // key bits chosen so far (those at and above the last pass's shift)
  int need;                   // how many of the valid keys matching `prefix` are still to be taken
  int done;                   // every valid key matching `prefix` is to be taken
};

// Warp 0 picks the bin (digits from the top) that holds the need-th best key among the valid keys
// matching the prefix, and updates the state. hist: [kBins] counts.
__device__ __forceinline__ void select_bin(const int* hist, int shift, SelectState* state) {
  static_assert(kBins == kRadixBins, "one 8-bit digit per pass");
  RadixBin bin;
  if (find_radix_bin(hist, state->need, bin)) {
    state->prefix |= (unsigned long long)bin.digit << shift;
    state->need -= bin.above;
    state->done = bin.count == state->need;
  }
}

// Sorts v[0, len) ascending, len a power of two; the whole block takes part. Entry: v written
// and visible (after a barrier); exit: sorted and visible.
__device__ void bitonic_sort_ascending(uint32_t* v, int len) {
  for (int size = 2; size <= len; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int q = threadIdx.x; q < len / 2; q += blockDim.x) {
        const int lo = 2 * q - (q & (stride - 1));
        const int hi = lo + stride;
        const uint32_t a = v[lo], b = v[hi];
        // Ascending within blocks of `size` whose bit `size` is clear, descending elsewhere; the
        // last merge (size == len) is all ascending.
        if ((a > b) == ((lo & size) == 0)) {
          v[lo] = b;
          v[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

// Launch: one block per row, blockDim = min(1024, max(32, the power of two >= n, halved)),
// dynamic shared memory merge_topk_smem_bytes(n, k).
__global__ void __launch_bounds__(kMergeMaxThreads) merge_topk_kernel(const MergeTopkParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ int hist[kBins];
  __shared__ SelectState state;
  __shared__ int taken_total, equal_seen;  // compaction: chosen slots, equal-prefix keys met
  const int n = p.shards * p.c;
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);        // [n]
  uint32_t* chosen = reinterpret_cast<uint32_t*>(keys + n);  // [chosen_len]
  const int64_t t = blockIdx.x;
  int32_t* out = p.out + t * int64_t(p.k);
  const int lane = int(threadIdx.x) % kWarpSize;
  const unsigned lanes_below = (1u << lane) - 1u;

  // 1. Keys without scores; the count of valid candidates is block-uniform.
  int count = 0;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + int(threadIdx.x);
    bool valid = false;
    if (i < n) {
      const int w = i / p.c, j = i - w * p.c;
      const int32_t pos = p.positions[(int64_t(w) * p.tokens + t) * p.c + j];
      valid = pos >= 0;
      keys[i] = valid ? uint64_t(0xFFFFFFFFu - uint32_t(pos)) : 0u;
    }
    count += __syncthreads_count(valid);
  }
  if (threadIdx.x == 0) {
    // count <= k: prefix 0 over no bits matches every valid key, and all of them are needed.
    state = SelectState{0ull, p.k, count <= p.k};
    taken_total = 0;
    equal_seen = 0;
  }

  // 2. Radix select (count > k).
  int decided = 64;  // key bits below `decided` are not part of the prefix
  if (count > p.k) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      if (keys[i] == 0u) continue;
      const int w = i / p.c, j = i - w * p.c;
      keys[i] |= uint64_t(ordered(p.scores[(int64_t(w) * p.tokens + t) * p.c + j])) << 32;
    }
    for (int shift = 64 - kRadixBits; shift >= 0; shift -= kRadixBits) {
      for (int b = threadIdx.x; b < kBins; b += blockDim.x) hist[b] = 0;
      __syncthreads();  // hist zeroed; keys and state visible
      const uint64_t prefix = state.prefix;
      const uint64_t high_mask = shift + kRadixBits >= 64 ? 0ull : ~0ull << (shift + kRadixBits);
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t key = keys[i];
        if (key != 0u && (key & high_mask) == prefix)
          atomicAdd(&hist[int(key >> shift) & (kBins - 1)], 1);
      }
      __syncthreads();  // histogram complete
      if (threadIdx.x < kWarpSize) select_bin(hist, shift, &state);
      __syncthreads();  // state updated before anyone reads it or clears hist
      decided = shift;
      if (state.done) break;
    }
  }
  __syncthreads();  // state and counters visible

  // 3. Compaction: warp-aggregated slots; the trip count is uniform, so every ballot is full.
  const uint64_t mask = decided >= 64 ? 0ull : ~0ull << decided;
  const uint64_t prefix = state.prefix;
  const int need = state.need;
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + int(threadIdx.x);
    const uint64_t key = i < n ? keys[i] : 0u;
    bool take = key != 0u && (key & mask) > prefix;
    const bool equal = key != 0u && (key & mask) == prefix;
    const unsigned equal_lanes = __ballot_sync(0xFFFFFFFFu, equal);
    if (equal_lanes != 0u) {
      const int leader = __ffs(equal_lanes) - 1;
      int first = 0;
      if (lane == leader) first = atomicAdd(&equal_seen, __popc(equal_lanes));
      first = __shfl_sync(0xFFFFFFFFu, first, leader);
      take = take || (equal && first + __popc(equal_lanes & lanes_below) < need);
    }
    const unsigned take_lanes = __ballot_sync(0xFFFFFFFFu, take);
    if (take_lanes != 0u) {
      const int leader = __ffs(take_lanes) - 1;
      int first = 0;
      if (lane == leader) first = atomicAdd(&taken_total, __popc(take_lanes));
      first = __shfl_sync(0xFFFFFFFFu, first, leader);
      if (take) chosen[first + __popc(take_lanes & lanes_below)] = 0xFFFFFFFFu - uint32_t(key);
    }
  }

  // 4. The chosen positions ascending (exactly min(count, k) of them), -1 padded.
  const int m = min(count, p.k);
  int chosen_len = 1;
  while (chosen_len < m) chosen_len <<= 1;
  for (int j = m + int(threadIdx.x); j < chosen_len; j += blockDim.x) chosen[j] = 0xFFFFFFFFu;
  __syncthreads();  // chosen complete
  bitonic_sort_ascending(chosen, chosen_len);
  for (int j = threadIdx.x; j < p.k; j += blockDim.x) out[j] = j < m ? int32_t(chosen[j]) : -1;
}

}  // namespace

cudaError_t launch_select_rows(const SelectRowsParams& p, cudaStream_t stream) {
  if (p.m == 0 || p.row_bytes == 0) return cudaSuccess;
  if (p.m < 0 || p.n < 0 || p.row_bytes < 0) return cudaErrorInvalidValue;
  const uintptr_t alignment = reinterpret_cast<uintptr_t>(p.src) |
                              reinterpret_cast<uintptr_t>(p.dst) | uintptr_t(p.row_bytes);
  if ((alignment & 15u) == 0) return launch_select_rows_as<uint4>(p, stream);
  if ((alignment & 7u) == 0) return launch_select_rows_as<uint2>(p, stream);
  if ((alignment & 3u) == 0) return launch_select_rows_as<uint32_t>(p, stream);
  if ((alignment & 1u) == 0) return launch_select_rows_as<uint16_t>(p, stream);
  return launch_select_rows_as<uint8_t>(p, stream);
}

cudaError_t launch_merge_topk(const MergeTopkParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.tokens < 0 || p.tokens > INT32_MAX || p.shards < 1 || p.c < 1 || p.k < 1 ||
      int64_t(p.shards) * p.c > kMergeTopkMaxCandidates)
    return cudaErrorInvalidValue;
  const int n = p.shards * p.c;
  int len = 1;
  while (len < n) len <<= 1;
  const int threads = std::min(kMergeMaxThreads, std::max(kWarpSize, len / 2));
  const int smem = merge_topk_smem_bytes(n, p.k);
  if (smem > kDefaultSmemBytes) {
    static std::atomic<uint64_t> opted_in{0};
    const cudaError_t e = opt_in_dynamic_smem(reinterpret_cast<const void*>(merge_topk_kernel),
                                              kMergeMaxSmemBytes, opted_in);
    if (e != cudaSuccess) return e;
  }
  merge_topk_kernel<<<unsigned(p.tokens), unsigned(threads), size_t(smem), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
