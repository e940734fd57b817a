// Lightning-indexer logits on Hopper (wgmma, warp-specialized), the contract of
// indexer_kernels.h's IndexerLogitsParams:
//   logits[t, p] = s_k[loc] · Σ_h gate[t,h] · ReLU(q8[t,h,:] · k8[loc,:]),
//   loc = kv_locs[kv_start[t] + p],  d_i = 128 (kDim), H_i = kHeads.
//
// The product is taken transposed, keys on M: Sᵀ[n, (r, h)] = k8[n, :] · q8[r, h, :] with
// A = 64 keys [64 x 128] and B = a consumer's (token, head) columns [128 x 128], both K-major
// 128-byte-swizzled shared-memory tiles, in one of two operand types (kOps):
//   kE4m3: the codes as stored (k32 e4m3 wgmmas, rows of 128 B, one swizzle atom wide);
//   kF16:  the codes widened to f16 by the producer (exact: every e4m3 value is an f16 value),
//          k16 f16 wgmmas, rows of 256 B laid out as two 128-byte atoms [atom][row][128 B].
// A thread's accumulator then holds two keys (rows g, g + 8 of its warp's 16) against 32 of the
// consumer's 128 columns (16 in each 64-column bank), so a token's head sum is kHeads / 4 gated
// ReLUs per key in registers plus a reduction over the 4 lanes q that share those keys, which
// the epilogue does.
//
// Work items: kCtaTokens consecutive rows of the batch (a row group; one request, normally) and
// part of the key tiles (key_splits items per row group when the row groups alone would leave SMs
// idle, indexer_logits_key_splits). The grid is persistent, one CTA per SM over its items in
// rounds, the longest items first (item_of); a CTA's threads in three roles:
//   consumers, WG c < kConsumers: own tokens [c·kWgTokens, (c + 1)·kWgTokens) (128 columns =
//     kWgTokens x kHeads) of the item and compute every tile with the same A operand: one chain
//     of N = 128 wgmmas (each k-step reads the keys' A tile once), then each lane's gated-ReLU sum
//     over its columns of each token, per key, into an epilogue stage (shared memory). The gates
//     are held in registers for the whole item. Every chain completes within the tile: ptxas
//     serializes the wgmmas (C7514) when an accumulator is still in flight across the loop's back
//     edge; the other groups' wgmmas fill the tensor pipe meanwhile.
//   producers (kProducers threads): per item its rows (CtaRows), query codes and gates into a
//     query buffer (kE4m3 has two: the next item's queries load while the current one computes;
//     an item of identity rows stages none; kE4m3's codes by TMA, the gates by cp.async), then the
//     key rows of every 64-key tile of positions [0, context) gathered by location into a kStages
//     ring that runs on across items, with each row's scale and a valid flag: kE4m3 by cp.async (16
//     B, completing on the stage's mbarrier), or — a producer warp's 32 rows being one run of a
//     page (consecutive locations in one page, as page tables lay positions out) — by one TMA box
//     of the key pool (LogitsLaunch::keys) counted on the same mbarrier; kF16 by 16-byte register
//     loads issued before the wait for the stage, widened and stored after it (st.shared, then a
//     proxy fence before the arrive).
//   finishers (kFinishers threads, the epilogue): per tile, the 4 lanes' partials of each
//     (token, key) summed, scaled, masked to the token's segment and stored, 128 bytes per
//     warp and token; they release the key stage (its scales) and the epilogue stage.
//   Consumers and finishers release an item's query buffer when done with it (q_empty).
// Moving the quad reduction and the stores off the consumers (DeepGEMM's fp8_mqa_logits design)
// leaves them the wgmmas and the gated sums, so kE4m3 fits a fourth consumer group at 104
// registers, with producers and finishers as two warps each of one warpgroup.
//
// Numerics: with kE4m3 the tensor cores sum the fp8 products in an accumulator that keeps fewer
// bits than fp32 (~1e-4 rel-L2 from fp32 arithmetic on the same codes, as DeepGEMM's kernel; still
// ~4.5e-5 when every k32 step is summed in fp32, docs/numerics.md). kF16 takes the f16 path
// (exact products, fp32 accumulation), the one the mma.sync kernel (indexer/logits_tc.cu)
// compiles to on sm_90 (F2FP.F16.E4M3 + HMMA.16816.F32): fp32-level logits at half kE4m3's peak
// tensor rate.
//
// Rows of a CTA with different kv_start (a request boundary) are taken one request after the
// other ("segments"): the tile loop runs per segment and stores only that segment's rows.
// Rows with ctx_len <= skip_ctx_at_most are not computed (the top-k identity shortcut).
//
// Shared memory (bytes, tiles 1024-aligned; kRowBytes = 128 · kElemBytes):
//   q      [kQBuffers][kCtaTokens * kHeads][kRowBytes]  query operand, row (r, h) = r * kHeads + h
//   keys   [kStages][64][kRowBytes]          key operand (8 / 16 KB a stage)
//   epi    f32 [kEpiStages][kCtaTokens][64][4]  the consumers' partial head sums
//   gate   f32 [kQBuffers][kCtaTokens * kHeads]; scale f32 [kStages][64]; valid u8 [kStages][64];
//   mbarriers q full/empty[kQBuffers], full/empty[kStages], epi full/empty[kEpiStages]; each
//   query buffer's rows (CtaRows); the finishers' positions seen per token, i32 [2][kCtaTokens]
//
// Invariants: page_size % 4 == 0 and 16-byte aligned key_pages / q8 (every key row and query
// row is 16-byte aligned: the launcher refuses other pools), 1 <= h_i == kHeads, width < 2^31
// (positions and tile counts are 32-bit).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/fast_divmod.h"
#include "src/cuda/common/hopper.cuh"
#include "src/cuda/common/kernel_trace.h"
#include "src/cuda/common/launch.h"
#include "src/cuda/common/tma.h"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda::indexer_sm90 {

template <int kHeads_, LogitsOperands kOps_>
struct LogitsConfig {
  static constexpr int kHeads = kHeads_;
  static constexpr LogitsOperands kOps = kOps_;
  static constexpr bool kF16 = kOps == LogitsOperands::kF16;
  static constexpr int kDim = 128;                 // d_i: codes per vector
  static constexpr int kChunks = kDim / 16;        // 16-byte chunks of codes per vector
  static constexpr int kElemBytes = kF16 ? 2 : 1;  // also the 128-byte swizzle atoms per row
  static constexpr int kKeys = 64;                 // keys per tile (wgmma M)
  static constexpr int kWgCols = 128;              // (token, head) columns per consumer
  static constexpr int kBankCols = 64;             // columns per wgmma chain (N)
  static constexpr int kWgTokens = kWgCols / kHeads;
  static constexpr int kBankTokens = kBankCols / kHeads;
  // Warpgroups: kConsumers of wgmma, then kProducers threads staging the tiles and kFinishers
  // finishing them (the epilogue), either two warps each in one warpgroup (kE4m3: a fourth
  // consumer fits beside them) or a warpgroup each (kF16: the producer widens the codes too).
  static constexpr int kConsumers = kF16 ? 3 : 4;
  static constexpr int kProducers = kF16 ? 128 : 64, kFinishers = kProducers;
  static constexpr int kRoleWgs = (kProducers + kFinishers) / 128;
  static constexpr int kCtaTokens = kConsumers * kWgTokens;
  static constexpr int kKStep = kF16 ? 16 : 32;  // the wgmma's K (elements)
  static constexpr int kKSteps = kDim / kKStep;  // wgmma steps per tile
  // kE4m3 at H_i 32 takes one stage less: its 16 KB epilogue stages need the room.
  static constexpr int kStages = kF16 ? 6 : kHeads == 64 ? 8 : 7;
  // Query buffers: kE4m3 loads the next work item's queries while the current one computes
  // (64 KB each); kF16's 96-128 KB operand fits once.
  static constexpr int kQBuffers = kF16 ? 1 : 2;
  static constexpr int kThreads = (kConsumers + kRoleWgs) * 128;
  // setmaxnreg moves registers within the CTA's launch allocation (kThreads x kEntryRegs under
  // __launch_bounds__(kThreads, 1): 64K registers, 8 per thread the granule): the consumers
  // hold two banks' accumulators (64) and their gates (32); a kF16 producer holds half a row's
  // codes (64) across the wait for its stage.
  static constexpr int kEntryRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kConsumerRegs = kF16 ? 120 : 104;
  static constexpr int kProducerRegs = kF16 ? 80 : 64;  // kE4m3: the finishers' too
  static constexpr int kFinisherRegs = kF16 ? 40 : 64;
  static_assert(kConsumers * kConsumerRegs +
                    (kRoleWgs == 1 ? kProducerRegs : kProducerRegs + kFinisherRegs) <=
                kEntryRegs * (kConsumers + kRoleWgs));
  static_assert(kRoleWgs == 2 || kProducerRegs == kFinisherRegs, "one warpgroup, one budget");
  static_assert(kProducers % 64 == 0 && kFinishers % 64 == 0 && kRoleWgs >= 1);
  static_assert(kCtaTokens % (kFinishers / kKeys) == 0, "finishers split the tokens evenly");
  static_assert(kBankCols % kHeads == 0 && kHeads % 8 == 0, "heads tile a bank's 64 columns");

  static constexpr int kCtaRows = kCtaTokens * kHeads;  // query operand rows
  static constexpr int kTileBytes = kKeys * kDim * kElemBytes;
  // A tile's head sums as the consumers leave them: f32 [kCtaTokens][kKeys][4], the partial of
  // quad lane q at [token][key][q].
  static constexpr int kEpiStageBytes = kCtaTokens * kKeys * 16;
  static constexpr int kQBytes = kCtaRows * kDim * kElemBytes;  // one query buffer
  static constexpr int kQ = 0;
  static constexpr int kKeysOff = kQ + kQBuffers * kQBytes;
  static constexpr int kEpi = kKeysOff + kStages * kTileBytes;
  // The arrays after the epilogue stages, at most 4 epilogue barriers each side.
  static constexpr int kSmallBytes = kQBuffers * (4 * kCtaRows + 16 + 16 * kCtaTokens) +
                                     5 * kStages * kKeys + 16 * kStages + 64 + 8 * kCtaTokens + 8;
  // As many epilogue stages as fit, at most 4.
  static constexpr int kEpiStages = std::min(4, (227 * 1024 - kSmallBytes - kEpi) / kEpiStageBytes);
  static constexpr int kGate = kEpi + kEpiStages * kEpiStageBytes;  // f32 [kQBuffers][kCtaRows]
  static constexpr int kScale = kGate + kQBuffers * 4 * kCtaRows;
  static constexpr int kValid = kScale + 4 * kStages * kKeys;
  static constexpr int kBars = (kValid + kStages * kKeys + 7) / 8 * 8;
  static constexpr int kBarQFull = kBars;                       // + 8 * query buffer
  static constexpr int kBarQEmpty = kBarQFull + 8 * kQBuffers;  // + 8 * query buffer
  static constexpr int kBarFull = kBarQEmpty + 8 * kQBuffers;   // + 8 * stage
  static constexpr int kBarEmpty = kBarFull + 8 * kStages;      // + 8 * stage
  static constexpr int kBarEpiFull = kBarEmpty + 8 * kStages;   // + 8 * epilogue stage
  static constexpr int kBarEpiEmpty = kBarEpiFull + 8 * kEpiStages;
  static constexpr int kRowPlan = kBarEpiEmpty + 8 * kEpiStages;        // CtaRows [kQBuffers]
  static constexpr int kSeen = kRowPlan + kQBuffers * 16 * kCtaTokens;  // i32 [2][kCtaTokens]
  static constexpr int kSmemBytes = kSeen + 8 * kCtaTokens;
  static_assert(kKeysOff % 1024 == 0 && kTileBytes % 1024 == 0);
  static_assert(kEpiStages >= 2 && kSmemBytes - kGate <= kSmallBytes);
  static_assert(kSmemBytes <= 227 * 1024);

  // Byte offset of 16-byte chunk c (0 .. 8 · kElemBytes) of operand row n in a tile of `rows` rows.
  __device__ static uint32_t chunk_offset(int rows, int n, int c) {
    return uint32_t((c / 8) * rows * 128) + sm90::swizzled_chunk(n, c % 8);
  }
};

// What the launcher derives from IndexerLogitsParams: kE4m3's tensor maps of the query codes and
// of the key pool's codes, bytes, 128-byte swizzled (kF16 widens the codes in registers and
// leaves them unset), and the division of a pool location by page_size.
struct LogitsLaunch {
  CUtensorMap q8;        // [row_end * h_i rows][128 B] boxes of [256 rows][128 B]
  CUtensorMap keys;      // [num_pages][page_size rows][128 B] boxes of [1][32 rows][128 B]
  FastDivmod page_size;  // location / page_size: its page (locations < 2^31)
  bool keys_by_tma;      // `keys` is set: kE4m3 loads a half tile that is a page run by TMA
};

// ReLU that keeps NaN (max.NaN): a NaN score stays NaN, as in the other logits kernels.
__device__ __forceinline__ float relu_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

// The CTA's rows as read once from kv_start / ctx_len.
template <int kRows>
struct CtaRows {
  int64_t start[kRows];  // kv_start of the row's request
  int64_t ctx[kRows];    // visible positions clamped to [0, width]; -1: not computed
};

// Segment `seg` of the CTA's computed rows: the first computed row whose kv_start differs from
// every earlier computed row's opens a segment. Returns false past the last one; else its
// kv_start and the farthest context of its rows.
template <int kRows>
__device__ __forceinline__ bool cta_segment(const CtaRows<kRows>& rows, int seg, int64_t& start,
                                            int64_t& limit) {
  int found = -1;
  for (int r = 0; r < kRows; ++r) {
    if (rows.ctx[r] < 0) continue;
    bool first = true;
    for (int s = 0; s < r; ++s) first &= !(rows.ctx[s] >= 0 && rows.start[s] == rows.start[r]);
    if (first && ++found == seg) {
      start = rows.start[r];
      limit = 0;
      for (int s = r; s < kRows; ++s)
        if (rows.ctx[s] >= 0 && rows.start[s] == start) limit = max(limit, rows.ctx[s]);
      return true;
    }
  }
  return false;
}

// Work items per row group over the key tiles. The persistent grid has one CTA per SM, and
// each item costs about kItemOverheadTiles tiles' time beyond its own tiles (its row plan and
// queries, its segments' first gathered tiles; measured on the H200, docs/perf.md). The count
// chosen minimizes the grid's time as whole rounds of `sms` items, each round as long as an item
// over ceil(max_tiles / splits) tiles plus that overhead; ties go to fewer splits. A split pays
// only where the row groups alone leave SMs idle (a short chunk of rows, the driver's narrow row
// blocks of a long prompt).
inline int indexer_logits_key_splits(int64_t groups, int64_t max_tiles, int sms) {
  constexpr int64_t kItemOverheadTiles = 9, kMostSplits = 64;
  int best = 1;
  int64_t best_cost = INT64_MAX;
  for (int64_t splits = 1; splits <= std::min(max_tiles, kMostSplits); ++splits) {
    const int64_t rounds = (groups * splits + sms - 1) / sms;
    const int64_t cost = rounds * ((max_tiles + splits - 1) / splits + kItemOverheadTiles);
    if (cost < best_cost) best = int(splits), best_cost = cost;
  }
  return best;
}

// Trace slots of a CTA (a DSAKIT_KERNEL_TRACE build, kernel_trace.h): its entry and each role's
// end, then eight per work item k < 31 from kTraceItem0 + 8 k, in LogitsTraceItemEvent order.
enum LogitsTraceSlot : int {
  kTraceEntry,
  kTraceProducerEnd,
  kTraceConsumerEnd,
  kTraceFinisherEnd,
  kTraceItem0 = 8
};
enum LogitsTraceItemEvent : int {
  kTraceStageBegin,    // producer thread 0: the item's staging starts (before its buffer's wait)
  kTraceStageEnd,      // producer thread 0: the staging is issued
  kTraceFirstIssued,   // producer thread 0: the item's first key tile is issued
  kTraceLastIssued,    // producer thread 0: its last key tile is issued
  kTraceQueriesReady,  // consumer thread 0: the item's query buffer is full
  kTraceFirstReady,    // consumer thread 0: its first key tile is full
  kTraceLastDone,      // consumer thread 0: its last tile's partials are handed on
  kTraceFinished,      // finisher thread 0: its last tile is stored
};
// Kernel tag of this kernel's trace records.
constexpr int64_t kLogitsTraceTag = 1;

// Named barriers (0 is __syncthreads): the finishers' kFinishers threads, the producers'.
constexpr int kFinisherBarrier = 1, kProducerBarrier = 2;

template <int kHeads, LogitsOperands kOps>
__global__ void __launch_bounds__(LogitsConfig<kHeads, kOps>::kThreads, 1)
    indexer_logits_sm90_kernel(const __grid_constant__ IndexerLogitsParams p,
                               const __grid_constant__ LogitsLaunch launch, int key_splits) {
  using C = LogitsConfig<kHeads, kOps>;
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t base = smem_addr(smem);
  const auto bar_q_full = [&](int b) { return base + C::kBarQFull + 8 * b; };
  const auto bar_q_empty = [&](int b) { return base + C::kBarQEmpty + 8 * b; };
  const auto bar_full = [&](int s) { return base + C::kBarFull + 8 * s; };
  const auto bar_empty = [&](int s) { return base + C::kBarEmpty + 8 * s; };
  const auto bar_epi_full = [&](int s) { return base + C::kBarEpiFull + 8 * s; };
  const auto bar_epi_empty = [&](int s) { return base + C::kBarEpiEmpty + 8 * s; };
  float* scale_s = reinterpret_cast<float*>(smem + C::kScale);
  uint8_t* valid_s = smem + C::kValid;
  using Rows = CtaRows<C::kCtaTokens>;
  // Query buffer b's rows and gates.
  const auto rows_of = [&](int b) -> Rows& {
    return reinterpret_cast<Rows*>(smem + C::kRowPlan)[b];
  };
  const auto gates_of = [&](int b) {
    return reinterpret_cast<float*>(smem + C::kGate) + b * C::kCtaRows;
  };

  // Work items w = 0 .. groups · splits − 1: row group groups − 1 − w / splits (last to first:
  // later rows of a prefill see longer contexts, so the long items go first) and part w % splits
  // of each segment's tiles. The grid is persistent: round r gives CTA b item r · G + b, or
  // r · G + G − 1 − b in odd rounds (G = gridDim.x), so a CTA's long and short items balance.
  // Every role walks the same items; item k of a CTA uses query buffer k % kQBuffers.
  const int64_t num_rows = p.row_end - p.row_begin;
  const int64_t groups = (num_rows + C::kCtaTokens - 1) / C::kCtaTokens;
  const int splits = key_splits;
  const int64_t items = groups * splits;
  struct Item {
    int64_t row0;  // first batch row (relative to row_begin) of the row group
    int split;
  };
  // Item k of this CTA, false past its last.
  const auto item_of = [&](int k, Item& it) {
    const int64_t g = gridDim.x, b = blockIdx.x;
    const int64_t w = int64_t(k) * g + (k % 2 == 0 ? b : g - 1 - b);
    it.row0 = (groups - 1 - w / splits) * C::kCtaTokens;
    it.split = int(w % splits);
    return w < items;
  };
  // A work item's tiles [begin, end) of a segment whose rows see at most `limit` positions.
  const auto split_tiles = [&](int split, int64_t limit, int64_t& begin, int64_t& end) {
    const int64_t tiles = (limit + C::kKeys - 1) / C::kKeys, per = (tiles + splits - 1) / splits;
    begin = min(tiles, split * per);
    end = min(tiles, begin + per);
  };

  const auto item_stamp = [&](int k, LogitsTraceItemEvent e) {
    trace_stamp(p.trace, kTraceItem0 + 8 * k + e);
  };
  if (threadIdx.x == 0) trace_stamp(p.trace, kTraceEntry);
  if (threadIdx.x == 0) {
    // The producer's arrivals and its cp.async completions: a query buffer's gates and, with
    // kE4m3, a key stage's codes come by cp.async (kE4m3's query codes by TMA, counted in bytes).
    constexpr uint32_t kQFullArrivals = 2 * C::kProducers;
    constexpr uint32_t kFullArrivals = (C::kF16 ? 1 : 2) * C::kProducers;
    for (int b = 0; b < C::kQBuffers; ++b) {
      sm90::mbarrier_init(bar_q_full(b), kQFullArrivals);
      // Consumers and finishers, once done with the buffer's item (its rows, queries, gates).
      sm90::mbarrier_init(bar_q_empty(b), C::kConsumers * 128 + C::kFinishers);
    }
    for (int s = 0; s < C::kStages; ++s) {
      sm90::mbarrier_init(bar_full(s), kFullArrivals);
      // The consumers once their wgmmas have read the keys, the epilogue once it has the
      // stage's scales and valid flags.
      sm90::mbarrier_init(bar_empty(s), C::kConsumers * 128 + C::kFinishers);
    }
    for (int s = 0; s < C::kEpiStages; ++s) {
      sm90::mbarrier_init(bar_epi_full(s), C::kConsumers * 128);
      sm90::mbarrier_init(bar_epi_empty(s), C::kFinishers);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // Threads [128 kConsumers, + kProducers) stage the tiles (produce), the next kFinishers
  // finish them.
  const auto produce = [&] {
    // ---- producer --------------------------------------------------------------------------
    const int ptid = threadIdx.x - 128 * C::kConsumers;
    // kF16: 16 codes of operand row n (chunk `chunk` of its codes, loaded by the caller) widened
    // into two f16 chunks of a tile of `rows` rows.
    const auto store_f16 = [&](uint32_t tile, int rows, int n, int chunk, uint4 codes) {
      sm90::st_shared_u32x4(tile + C::chunk_offset(rows, n, 2 * chunk),
                            e4m3x8_to_f16(make_uint2(codes.x, codes.y)));
      sm90::st_shared_u32x4(tile + C::chunk_offset(rows, n, 2 * chunk + 1),
                            e4m3x8_to_f16(make_uint2(codes.z, codes.w)));
    };
    // Row r < kCtaTokens of an item as its producer thread ptid = r reads it: ctx_len and kv_start
    // loaded one item ahead (held in registers while the current item's tiles are staged), so
    // that stage_queries does not wait a global round trip for them.
    struct RowAhead {
      int32_t ctx = 0, start = 0;
      bool in_batch = false;
    };
    const auto load_row = [&](const Item& it) {
      RowAhead a;
      const int64_t out_row = it.row0 + ptid;
      if (ptid < C::kCtaTokens && out_row < num_rows) {
        const int64_t t = p.row_begin + out_row;
        a.ctx = p.ctx_len[t];
        a.start = p.kv_start[t];
        a.in_batch = true;
      }
      return a;
    };
    // Item k's rows, queries and gates into query buffer b, once the buffer's previous item is
    // done. Rows not computed get zero gates (and kF16 zero codes; kE4m3 loads their codes with
    // the others): their columns are never stored. Every global read is in flight before any of
    // its results is used: kE4m3's codes by TMA, gates by cp.async, kF16's codes kQLoads chunks
    // at a time.
    const auto stage_queries = [&](int k, int b, const Item& it, const RowAhead& ahead) {
      sm90::mbarrier_wait(bar_q_empty(b), ((k / C::kQBuffers) & 1) ^ 1);
      // Every producer thread is past the previous item (kQBuffers == 1: the same rows).
      sm90::named_barrier_sync(kProducerBarrier, C::kProducers);
      Rows& rows = rows_of(b);
      if (ptid < C::kCtaTokens) {
        const int64_t ctx = ahead.in_batch ? min(max(int64_t(ahead.ctx), int64_t(0)), p.width) : -1;
        rows.ctx[ptid] = ctx > p.skip_ctx_at_most ? ctx : -1;
        rows.start[ptid] = ahead.in_batch ? int64_t(ahead.start) : 0;
      }
      sm90::named_barrier_sync(kProducerBarrier, C::kProducers);
      bool any = false;  // an item of identity rows only computes nothing: no queries to stage
      for (int r = 0; r < C::kCtaTokens; ++r) any |= rows.ctx[r] >= 0;
      const uint32_t q_tile = base + C::kQ + b * C::kQBytes;
      if constexpr (C::kF16) {
        constexpr int kQChunks = C::kCtaRows * C::kChunks;
        // Chunk i of the item's query codes (operand row i / kChunks, chunk i % kChunks): its
        // source, q8 itself when it is not read (past the last chunk, or a row not computed).
        const auto query_source = [&](int i, bool& ok) {
          const int n = i / C::kChunks, r = n / kHeads, h = n % kHeads;
          ok = i < kQChunks && rows.ctx[r] >= 0;
          return ok ? p.q8 + ((p.row_begin + it.row0 + r) * kHeads + h) * C::kDim +
                          16 * (i % C::kChunks)
                    : p.q8;
        };
        constexpr int kQLoads = 4;  // chunks in flight per thread
        for (int i0 = any ? ptid : kQChunks; i0 < kQChunks; i0 += kQLoads * C::kProducers) {
          uint4 held[kQLoads];
#pragma unroll
          for (int u = 0; u < kQLoads; ++u) {
            bool ok;
            const uint8_t* src = query_source(i0 + u * C::kProducers, ok);
            held[u] = sm90::ld_global_nc_u32x4(src, ok);
          }
#pragma unroll
          for (int u = 0; u < kQLoads; ++u) {
            const int i = i0 + u * C::kProducers;
            if (i < kQChunks)
              store_f16(q_tile, C::kCtaRows, i / C::kChunks, i % C::kChunks, held[u]);
          }
        }
      } else if (any && ptid == 0) {
        // The item's kCtaRows operand rows are consecutive rows of q8 [T * h_i][128 B]: two TMA
        // boxes of 256 rows, swizzled as the wgmma reads them (rows past the batch arrive as
        // zeros; rows not computed are loaded and never stored).
        static_assert(C::kCtaRows % 256 == 0 && C::kQBytes < (1 << 20));
        sm90::mbarrier_expect_tx(bar_q_full(b), C::kQBytes);
        const int q_row0 = int((p.row_begin + it.row0) * kHeads);
#pragma unroll
        for (int j = 0; j < C::kCtaRows / 256; ++j)
          sm90::tma_load_2d(q_tile + j * 256 * 128, &launch.q8, bar_q_full(b), 0, q_row0 + 256 * j);
      }
      // Gates: 16 bytes (4 heads of one row) a chunk; the item's rows are consecutive batch
      // rows, so its gates are one run of kCtaRows floats.
      const uint32_t gate_dst = base + C::kGate + b * 4 * C::kCtaRows;
      for (int j = any ? ptid : C::kCtaRows / 4; j < C::kCtaRows / 4; j += C::kProducers) {
        const int r = 4 * j / kHeads;
        const bool ok = rows.ctx[r] >= 0;
        const float* src = ok ? p.gate + (p.row_begin + it.row0) * kHeads + 4 * j : p.gate;
        sm90::cp_async_16_prefetch(gate_dst + 16 * j, src, ok);
      }
      if constexpr (C::kF16) sm90::fence_proxy_async_shared();
      sm90::cp_async_mbarrier_arrive(bar_q_full(b));
      sm90::mbarrier_arrive(bar_q_full(b));
    };

    // Key tiles of every segment, in the order the consumers take them. Thread ptid stages row
    // ptid / kPerRow of a tile, chunks [kRowChunks (ptid % kPerRow), + kRowChunks) of its codes,
    // and (the row's first thread) its scale and valid flag. The location of the next tile's row
    // is loaded before waiting for its stage.
    constexpr int kPerRow = C::kProducers / C::kKeys, kRowChunks = C::kChunks / kPerRow;
    const int64_t page_bytes = int64_t(p.page_size) * (C::kDim + 4);
    const int row = ptid / kPerRow, chunk0 = kRowChunks * (ptid % kPerRow);
    // The location of this thread's row of the tile at tile0 as kv_locs holds it (-1 past the
    // segment); checked against the pool where it is first used, so that the load stays in
    // flight until then.
    const auto location = [&](int64_t start, int limit, int tile0) {
      const int pos = tile0 + row;
      const int64_t j = start + pos;
      int32_t loc = -1;
      if (pos < limit && j >= 0 && j < p.n_kv) loc = __ldg(p.kv_locs + j);
      return loc;
    };
    // kE4m3's page runs: a producer warp's rows, lane l on row 32 w + l (kPerRow == 1).
    constexpr int kRunRows = 32;
    static_assert(C::kF16 || (kPerRow == 1 && C::kKeys == 2 * kRunRows));
    int n = 0;  // tiles staged so far (all items and segments)
    Item it, it_next;
    bool have = item_of(0, it);
    RowAhead ahead = have ? load_row(it) : RowAhead{};
    for (int k = 0; have; ++k, it = it_next) {
      const int b = k % C::kQBuffers;
      if (ptid == 0) item_stamp(k, kTraceStageBegin);
      stage_queries(k, b, it, ahead);
      if (ptid == 0) item_stamp(k, kTraceStageEnd);
      const int item_first_tile = n;
      have = item_of(k + 1, it_next);
      if (have) ahead = load_row(it_next);
      const Rows& rows = rows_of(b);
      int64_t start, limit;
      for (int seg = 0; cta_segment(rows, seg, start, limit); ++seg) {
        int64_t begin, end;
        split_tiles(it.split, limit, begin, end);
        const int tile_end = int(end);
        int32_t next = begin < end ? location(start, int(limit), int(begin) * C::kKeys) : -1;
        for (int i = int(begin); i < tile_end; ++i, ++n) {
          const int32_t loc = next;
          if (i + 1 < tile_end) next = location(start, int(limit), (i + 1) * C::kKeys);
          const int stage = n % C::kStages;
          const bool ok = loc >= 0 && loc < p.num_locations;
          const int32_t page = ok ? int32_t(launch.page_size.div(uint32_t(loc))) : 0;
          const int32_t slot = ok ? loc - page * p.page_size : 0;
          const uint8_t* page_base = p.key_pages + page * page_bytes;
          const uint8_t* codes = page_base + int64_t(slot) * C::kDim;
          const float* scale =
              reinterpret_cast<const float*>(page_base + int64_t(p.page_size) * C::kDim) + slot;
          const uint32_t tile = base + C::kKeysOff + stage * C::kTileBytes;
          if constexpr (C::kF16) {
            // This thread's codes and the row's scale in flight before the wait for the stage.
            uint4 held[kRowChunks];
#pragma unroll
            for (int c = 0; c < kRowChunks; ++c)
              held[c] = sm90::ld_global_nc_u32x4(codes + 16 * (chunk0 + c), ok);
            const float row_scale = ok && chunk0 == 0 ? __ldg(scale) : 0.f;
            sm90::mbarrier_wait(bar_empty(stage), ((n / C::kStages) & 1) ^ 1);
#pragma unroll
            for (int c = 0; c < kRowChunks; ++c)
              store_f16(tile, C::kKeys, row, chunk0 + c, held[c]);
            if (chunk0 == 0) {
              scale_s[stage * C::kKeys + row] = row_scale;
              valid_s[stage * C::kKeys + row] = ok;
            }
            sm90::fence_proxy_async_shared();
          } else {
            // This warp's 32 rows by one TMA box when they are one run of a page: every
            // location valid and lane l's the first one's + l, the run inside the first one's
            // page. The box lands 128-byte swizzled as the cp.async path stores (the swizzle
            // follows the shared-memory address; the half tile starts 1024-byte aligned).
            const int lane_id = ptid % kWarpSize, run_index = ptid / kWarpSize;
            const int32_t first_loc = __shfl_sync(0xffffffffu, loc, 0);
            const int32_t first_page = __shfl_sync(0xffffffffu, page, 0);
            const int32_t first_slot = __shfl_sync(0xffffffffu, slot, 0);
            const bool run = launch.keys_by_tma &&
                             __all_sync(0xffffffffu, ok && loc == first_loc + lane_id) &&
                             first_slot + kRunRows <= p.page_size;
            const uint32_t run_tile = tile + uint32_t(run_index * kRunRows * C::kDim);
            sm90::mbarrier_wait(bar_empty(stage), ((n / C::kStages) & 1) ^ 1);
            if (run) {
              if (lane_id == 0) {
                sm90::mbarrier_expect_tx(bar_full(stage), kRunRows * C::kDim);
                sm90::tma_load_3d(run_tile, &launch.keys, bar_full(stage), 0, first_slot,
                                  first_page);
              }
            } else {
#pragma unroll
              for (int c = chunk0; c < chunk0 + kRowChunks; ++c)
                sm90::cp_async_16_prefetch(tile + sm90::swizzled_chunk(row, c), codes + 16 * c, ok);
            }
            if (chunk0 == 0) {
              sm90::cp_async_small<4>(base + C::kScale + 4 * (stage * C::kKeys + row), scale, ok);
              valid_s[stage * C::kKeys + row] = ok;
            }
            sm90::cp_async_mbarrier_arrive(bar_full(stage));
          }
          sm90::mbarrier_arrive(bar_full(stage));
          if (ptid == 0 && n == item_first_tile) item_stamp(k, kTraceFirstIssued);
        }
      }
      if (ptid == 0) item_stamp(k, kTraceLastIssued);
    }
    if (ptid == 0) trace_stamp(p.trace, kTraceProducerEnd);
    cp_async_wait<0>();
  };

  const auto finish = [&] {
    // ---- epilogue ----------------------------------------------------------------------------
    // Thread etid finishes key etid % 64 of every tile for the CTA tokens etid / 64 + j kTokStep:
    // the quad's four partials summed as the consumers' lanes would have ((0 + 1) + (2 + 3)),
    // times the key's scale, stored where the token's segment sees the position; a warp's 32
    // keys are one 128-byte store per token.
    constexpr int kTokStep = C::kFinishers / C::kKeys;
    const int etid = threadIdx.x - 128 * C::kConsumers - C::kProducers;
    // tok0 is 0 whenever kTokStep is 1 (etid < kFinishers); spelled out so the token loop's
    // indices are compile-time there.
    const int key = etid % C::kKeys, tok0 = kTokStep == 1 ? 0 : etid / C::kKeys;
    int n = 0, segments = 0;  // tiles and segments finished so far (all items)
    Item it;
    for (int k = 0; item_of(k, it); ++k) {
      const int b = k % C::kQBuffers;
      sm90::mbarrier_wait(bar_q_full(b), (k / C::kQBuffers) & 1);
      const Rows& rows = rows_of(b);
      // This thread's key in the logits row of its first token; token tok0 + j kTokStep is
      // j · token_step floats further.
      float* const out = p.logits + (it.row0 + tok0) * p.width + key;
      const int64_t token_step = kTokStep * p.width;
      int64_t start, limit;
      for (int seg = 0; cta_segment(rows, seg, start, limit); ++seg, ++segments) {
        // Positions of each CTA token seen in this segment (0: not its segment), one buffer per
        // segment parity: a thread rewrites it only after every thread passed the next
        // segment's barrier, so after they all finished reading it.
        int* seen = reinterpret_cast<int*>(smem + C::kSeen) + (segments % 2) * C::kCtaTokens;
        if (etid < C::kCtaTokens) {
          const bool in_seg = rows.ctx[etid] >= 0 && rows.start[etid] == start;
          seen[etid] = in_seg ? int(rows.ctx[etid]) : 0;
        }
        sm90::named_barrier_sync(kFinisherBarrier, C::kFinishers);
        int64_t begin, end;
        split_tiles(it.split, limit, begin, end);
        for (int i = int(begin); i < int(end); ++i, ++n) {
          const int stage = n % C::kStages, epi_stage = n % C::kEpiStages;
          sm90::mbarrier_wait(bar_epi_full(epi_stage), (n / C::kEpiStages) & 1);
          const float scale = scale_s[stage * C::kKeys + key];
          const bool ok = valid_s[stage * C::kKeys + key] != 0;
          sm90::mbarrier_arrive(bar_empty(stage));
          const float4* partials =
              reinterpret_cast<const float4*>(smem + C::kEpi + epi_stage * C::kEpiStageBytes);
          const int pos = i * C::kKeys + key;
#pragma unroll
          for (int j = 0; j < C::kCtaTokens / kTokStep; ++j) {
            const int cr = tok0 + j * kTokStep;
            const float4 v = partials[cr * C::kKeys + key];
            const float sum = ((v.x + v.y) + (v.z + v.w)) * scale;
            if (pos < seen[cr]) out[j * token_step + i * C::kKeys] = ok ? sum : -INFINITY;
          }
          sm90::mbarrier_arrive(bar_epi_empty(epi_stage));  // every partial read
        }
      }
      // fill_masked: positions [ctx, width) of the computed rows are -inf (split 0's work).
      if (p.fill_masked && it.split == 0) {
        for (int cr = 0; cr < C::kCtaTokens; ++cr) {
          if (rows.ctx[cr] < 0) continue;
          float* out = p.logits + (it.row0 + cr) * p.width;
          for (int64_t pos = rows.ctx[cr] + etid; pos < p.width; pos += C::kFinishers)
            out[pos] = -INFINITY;
        }
      }
      if (etid == 0) item_stamp(k, kTraceFinished);
      sm90::mbarrier_arrive(bar_q_empty(b));
    }
    if (etid == 0) trace_stamp(p.trace, kTraceFinisherEnd);
  };
  if (warp >= 4 * C::kConsumers) {
    // setmaxnreg is one instruction for all warps of a warpgroup (.sync.aligned).
    const bool producer = threadIdx.x < 128 * C::kConsumers + C::kProducers;
    if constexpr (C::kRoleWgs == 1) {
      sm90::setmaxnreg_dec<C::kProducerRegs>();
      if (producer)
        produce();
      else
        finish();
    } else if (producer) {
      sm90::setmaxnreg_dec<C::kProducerRegs>();
      produce();
    } else {
      sm90::setmaxnreg_dec<C::kFinisherRegs>();
      finish();
    }
    return;
  }

  // ---- consumers ------------------------------------------------------------------------------
  sm90::setmaxnreg_inc<C::kConsumerRegs>();
  // The warpgroup index through a shuffle, so that ptxas sees it warp-uniform and keeps the
  // query descriptors derived from it in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0), wwarp = warp % 4, g = lane / 4,
            q = lane % 4;
  constexpr int kT = C::kWgTokens;
  constexpr int kColBlocks = kHeads / 8;  // 8-column blocks per token
  // This thread's gates of the current item: columns 8 j + 2 q, + 1 of the group's 128.
  float2 gates[C::kWgCols / 8];
  uint32_t b_tile = 0;  // the group's query rows in the current item's buffer, atom 0

  // S of the tile at `keys` into acc, kKSteps chained N = 128 wgmmas committed as one batch over
  // both banks' 128 columns (bank b's 32 values at [32 b, 32 b + 32)), so that each k-step reads
  // the keys' A tile once. Step ks reads 32 bytes of each row at byte 32 (ks % 4) of atom ks / 4.
  const auto issue_chain = [&](float(&acc)[64], uint32_t keys) {
    const uint64_t desc_a0 = sm90::smem_desc_sw128(keys, 16, 1024);
    const uint64_t desc_b0 = sm90::smem_desc_sw128(b_tile, 16, 1024);
    sm90::fence_operands(acc);
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < C::kKSteps; ++ks) {
      // Descriptors address 16-byte units: the step's byte offset >> 4 added to the start.
      const int atom = ks / 4, offset = (ks % 4) * 32;
      const uint64_t desc_a = desc_a0 + uint64_t((atom * C::kKeys * 128 + offset) >> 4);
      const uint64_t desc_b = desc_b0 + uint64_t((atom * C::kCtaRows * 128 + offset) >> 4);
      if constexpr (C::kF16)
        sm90::wgmma_m64n128k16_ss<0, sm90::Ab::kF16>(acc, desc_a, desc_b, ks > 0);
      else
        sm90::wgmma_m64n128k32_e4m3_ss(acc, desc_a, desc_b, ks > 0);
    }
    sm90::wgmma_commit();
  };
  // This thread's accumulator rows g and g + 8 of its warp's 16: keys key_lo, key_hi of a tile.
  const int key_lo = 16 * wwarp + g, key_hi = key_lo + 8;
  // Bank b of a tile once its wgmmas have completed: this lane's gated-ReLU head sums over its
  // kHeads / 4 columns of each of the bank's tokens, for keys key_lo and key_hi, into the
  // epilogue stage at `partials` (a warp's 32 lanes write 128 contiguous bytes per key).
  const auto partial_bank = [&](float(&acc)[32], int b, float* partials) {
    sm90::fence_operands(acc);
    constexpr int kBT = C::kBankTokens;
#pragma unroll
    for (int rb = 0; rb < kBT; ++rb) {
      float lo = 0.f, hi = 0.f;
#pragma unroll
      for (int jb = 0; jb < kColBlocks; ++jb) {
        const int j = rb * kColBlocks + jb;
        const float2 gv = gates[b * (C::kBankCols / 8) + j];
        lo = fmaf(gv.x, relu_nan(acc[4 * j]), lo);
        lo = fmaf(gv.y, relu_nan(acc[4 * j + 1]), lo);
        hi = fmaf(gv.x, relu_nan(acc[4 * j + 2]), hi);
        hi = fmaf(gv.y, relu_nan(acc[4 * j + 3]), hi);
      }
      const int cr = wg * kT + b * kBT + rb;
      partials[(cr * C::kKeys + key_lo) * 4 + q] = lo;
      partials[(cr * C::kKeys + key_hi) * 4 + q] = hi;
    }
  };

  // Both banks' accumulators, bank b at [32 b, 32 b + 32).
  float acc[64];
  float(&acc0)[32] = *reinterpret_cast<float(*)[32]>(acc);
  float(&acc1)[32] = *reinterpret_cast<float(*)[32]>(acc + 32);
  int n = 0;
  Item it;
  for (int k = 0; item_of(k, it); ++k) {
    const int b = k % C::kQBuffers;
    sm90::mbarrier_wait(bar_q_full(b), (k / C::kQBuffers) & 1);
    if (threadIdx.x == 0) item_stamp(k, kTraceQueriesReady);
    const int item_first_tile = n;
    b_tile = base + C::kQ + uint32_t(b * C::kQBytes + wg * C::kWgCols * 128);
    const float* gate_s = gates_of(b);
#pragma unroll
    for (int j = 0; j < C::kWgCols / 8; ++j)
      gates[j] = *reinterpret_cast<const float2*>(gate_s + wg * C::kWgCols + 8 * j + 2 * q);
    const Rows& rows = rows_of(b);
    int64_t start, limit;
    for (int seg = 0; cta_segment(rows, seg, start, limit); ++seg) {
      int64_t begin, end;
      split_tiles(it.split, limit, begin, end);
      // The tile range through shuffles as well: uniform registers count the loop.
      const int tile_end = __shfl_sync(0xffffffffu, int(end), 0);
      for (int i = __shfl_sync(0xffffffffu, int(begin), 0); i < tile_end; ++i, ++n) {
        const int stage = n % C::kStages, epi_stage = n % C::kEpiStages;
        sm90::mbarrier_wait(bar_full(stage), (n / C::kStages) & 1);
        if (threadIdx.x == 0 && n == item_first_tile) item_stamp(k, kTraceFirstReady);
        const uint32_t keys_tile = base + C::kKeysOff + stage * C::kTileBytes;
        issue_chain(acc, keys_tile);
        float* partials = reinterpret_cast<float*>(smem + C::kEpi + epi_stage * C::kEpiStageBytes);
        sm90::mbarrier_wait(bar_epi_empty(epi_stage), ((n / C::kEpiStages) & 1) ^ 1);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(acc);
        sm90::mbarrier_arrive(bar_empty(stage));  // the chain has read the keys
        partial_bank(acc0, 0, partials);
        partial_bank(acc1, 1, partials);
        sm90::mbarrier_arrive(bar_epi_full(epi_stage));
      }
    }
    if (threadIdx.x == 0) item_stamp(k, kTraceLastDone);
    sm90::mbarrier_arrive(bar_q_empty(b));  // every chain of the item has read its queries
  }
  if (threadIdx.x == 0) trace_stamp(p.trace, kTraceConsumerEnd);
}

// Launch for H_i = kHeads with kOps operands; cudaErrorInvalidConfiguration when
// indexer_logits_sm90_accepts() does not hold (the caller checks it first and runs another kernel).
// key_splits: work items per row group, each over a contiguous part of the key tiles (every
// position is still written by one item, with the same sums: the logits do not depend on it); 0
// lets indexer_logits_key_splits choose for a device of `sms` streaming multiprocessors. The grid
// is min(items, sms) CTAs (the logits do not depend on it either).
template <int kHeads, LogitsOperands kOps>
cudaError_t run_indexer_logits_sm90(const IndexerLogitsParams& p, int key_splits, int sms,
                                    cudaStream_t stream) {
  using C = LogitsConfig<kHeads, kOps>;
  const int64_t rows = p.row_end - p.row_begin;
  if (rows <= 0 || p.width <= 0) return cudaSuccess;
  if (p.h_i != kHeads || !indexer_logits_sm90_accepts(p) || key_splits < 0 || sms < 1)
    return cudaErrorInvalidConfiguration;
  const int64_t groups = (rows + C::kCtaTokens - 1) / C::kCtaTokens;
  const int splits =
      key_splits > 0 ? key_splits
                     : indexer_logits_key_splits(groups, (p.width + C::kKeys - 1) / C::kKeys, sms);
  if (groups * splits > INT32_MAX) return cudaErrorInvalidValue;
  LogitsLaunch launch{};
  launch.page_size = FastDivmod(uint32_t(p.page_size));
  if constexpr (!C::kF16) {
    const uint64_t q_dims[2] = {128, uint64_t(p.row_end) * kHeads}, q_strides[1] = {128};
    const uint32_t q_box[2] = {128, 256};
    const cudaError_t status =
        make_tensor_map_u8_sw128(&launch.q8, p.q8, 2, q_dims, q_strides, q_box);
    if (status != cudaSuccess) return status;
    // The key pool's codes, page by page: row s of page g at key_pages + g·page_bytes + 128 s.
    // Without a map (pages shorter than a run, or TMA cannot address the pool) every row
    // comes by cp.async.
    const int64_t pages = p.num_locations / p.page_size;
    const uint64_t k_dims[3] = {128, uint64_t(p.page_size), uint64_t(pages)};
    const uint64_t k_strides[2] = {128, uint64_t(p.page_size) * (C::kDim + 4)};
    const uint32_t k_box[3] = {128, 32, 1};
    launch.keys_by_tma = p.page_tma && p.page_size >= 32 && pages <= INT32_MAX &&
                         make_tensor_map_u8_sw128(&launch.keys, p.key_pages, 3, k_dims, k_strides,
                                                  k_box) == cudaSuccess;
  }
  auto* kernel = &indexer_logits_sm90_kernel<kHeads, kOps>;
  static std::atomic<uint64_t> smem_set{0};
  cudaError_t status =
      opt_in_dynamic_smem(reinterpret_cast<const void*>(kernel), C::kSmemBytes, smem_set);
  if (status != cudaSuccess) return status;
  // Persistent: one CTA per SM (the one resident), each over its items.
  const int64_t ctas = std::min<int64_t>(groups * splits, sms);
  IndexerLogitsParams launched = p;
  launched.trace = trace_begin(int(ctas), stream);  // null but in a trace build
  kernel<<<unsigned(ctas), C::kThreads, C::kSmemBytes, stream>>>(launched, launch, splits);
  status = cudaGetLastError();
  if (status == cudaSuccess && launched.trace != nullptr) {
    const int64_t header[8] = {kLogitsTraceTag, ctas,      int64_t(kOps), kHeads,
                               p.row_begin,     p.row_end, p.width,       splits};
    trace_end(launched.trace, header, stream);
  }
  return status;
}

}  // namespace dsakit::cuda::indexer_sm90

// One row of DSAKIT_INDEXER_LOGITS_SM90_INSTANCES (src/cuda/attention/instances.h).
#define DSAKIT_INSTANTIATE_INDEXER_LOGITS_SM90(kHeads, kOps)                                       \
  template cudaError_t                                                                             \
  dsakit::cuda::indexer_sm90::run_indexer_logits_sm90<kHeads, dsakit::cuda::LogitsOperands::kOps>( \
      const dsakit::cuda::IndexerLogitsParams&, int, int, cudaStream_t);
