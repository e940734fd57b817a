// The dense MHA kernels' work list (host side): query tiles of <= block_m rows per request, each
// over the kv blocks its rows see, split over several CTAs when the grid would leave SMs idle.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "src/cuda/attention/dense_mha_params.h"
#include "src/cuda/attention/merge_kernels.h"

namespace dsakit::cuda::dense_mha {

struct DenseSchedule {
  std::vector<DenseTile> tiles;  // costliest first (dense_run_cost); ties in batch order
  // > 1: split-KV. A split tile's runs write partial slots 0..runs-1 (runs <= parts), merged
  // afterwards over merge_segments (rows q * H + h of the split tiles, merged_rows in all);
  // whole tiles (part kDenseWholeTile) write o and lse.
  int parts = 1;
  std::vector<MergeSegment> merge_segments;
  int32_t merged_rows = 0;
  // The whole tiles' CTAs fill fewer than kDenseSplitWaves waves: the launcher then runs the
  // grid heaviest first over all heads (the L2 grouping of dense_head_group gains nothing when
  // the whole grid is in flight at once), the order the split's cost model assumes.
  bool few_waves = false;
};

// The split's cost model, in units of one 64-row group's MMAs over one kv block (the kernels'
// tensor-core work per block and 64 query rows; block_n rows of the kernel's shape):
//   a CTA costs kDenseCtaCost (its prologue, pipeline fill and epilogue) plus its run's units
//   (dense_run_cost); CTAs go to SMs in grid order as slots free up (ctas_per_sm per SM), so a
//   heaviest-first grid finishes at its longest-first list schedule (dense_makespan); a split
//   adds kDenseMergeCost (the partials' round trip and the merge launch). docs/perf.md has the
//   measurements behind the constants.
inline constexpr int32_t kDenseCostRows = 64;
inline constexpr int kDenseMaxCostGroups = 2;  // row groups per tile: block_m <= 128
inline constexpr int64_t kDenseCtaCost = 2;
inline constexpr int64_t kDenseMergeCost = 4;
// Splits are considered only on grids of fewer whole-tile CTAs than this many waves, with a
// tile over >= kDenseMinSplitRows kv rows (shorter ones measured slower split, docs/perf.md),
// the costliest tile into k runs for each k of kDenseSplitCandidates (at most kDenseMaxSplit).
inline constexpr int64_t kDenseSplitWaves = 2;
inline constexpr int32_t kDenseMinSplitRows = 1024;
inline constexpr int32_t kDenseSplitCandidates[] = {2, 3, 4, 6, 8, 12, 16};
inline constexpr int64_t kDenseMaxSplit =
    kDenseSplitCandidates[sizeof(kDenseSplitCandidates) / sizeof(kDenseSplitCandidates[0]) - 1];

// Units of kv blocks [block_begin, block_end) for tile t's rows: per group of kDenseCostRows
// query rows, the blocks of that range its last row sees.
int32_t dense_run_cost(const DenseTile& t, int32_t block_begin, int32_t block_end,
                       DenseTileShape shape);

// Longest-first list schedule of CTAs given as (cost, count) over `slots` CTA slots: the load of
// the slot that finishes last.
int64_t dense_makespan(std::vector<std::pair<int64_t, int64_t>> cost_count, int64_t slots);

// Tiles of `shape` for requests cu_q / cu_kv (host prefix sums [num_requests + 1]) and
// `num_heads` heads on a device with `sm_count` SMs. Without a split every tile covers all of its
// rows' kv blocks. On grids of few waves (DenseSchedule::few_waves) whose longest tile covers
// >= kDenseMinSplitRows kv rows, a long tile would set the kernel's time while other SMs idle:
// candidates cut every tile costing more than max_cost / k (k in kDenseSplitCandidates, max_cost
// the costliest tile's units) into runs of equal block counts (a tile's last run may be
// shorter), the others stay whole; the candidate of the least estimated time (the cost model
// above) wins if it beats the whole schedule, among those whose partial slots (parts x T x H
// rows of partial_row_bytes) fit max_partial_bytes. More than kMergeMaxSegments merge segments:
// no split. Invariant: for every tile, its runs' block ranges are disjoint, non-empty and cover
// [0, blocks).
DenseSchedule build_dense_schedule(const int32_t* cu_q, const int32_t* cu_kv, int num_requests,
                                   int64_t num_heads, int sm_count, int64_t partial_row_bytes,
                                   int64_t max_partial_bytes,
                                   DenseTileShape shape = kDenseSm80Shape);

// The merge of a split schedule (s.parts > 1): its segments and row count into p.
inline void set_merge_rows(const DenseSchedule& s, MergePartialsParams& p) {
  p.parts = s.parts;
  p.num_segments = int(s.merge_segments.size());
  p.merged_rows = s.merged_rows;
  for (size_t i = 0; i < s.merge_segments.size(); ++i) p.segments[i] = s.merge_segments[i];
}

// The K / V bytes the wgmma kernel's CTAs in flight together should read: a third of the 50 MB
// L2 of Hopper's H100 / H200, leaving the rest to Q, the outputs and the k_pe rows.
inline constexpr int64_t kDenseHeadGroupBytes = int64_t(16) << 20;

// The wgmma kernel's head group (dense_sm90_cta_work): the most heads that divide num_heads and
// keep their K / V rows (num_kv x (d_nope + d_v) bf16 each) within kDenseHeadGroupBytes, at
// least 1. A divisor, because a smaller last group starts its heaviest tiles after the lightest
// of the group before it.
inline int dense_head_group(int64_t num_kv, int64_t num_heads, int d_nope, int d_v) {
  const int64_t head_bytes = num_kv * (d_nope + d_v) * 2;
  int64_t group = head_bytes > 0 ? kDenseHeadGroupBytes / head_bytes : num_heads;
  group = group < 1 ? 1 : group > num_heads ? num_heads : group;
  while (num_heads % group != 0) --group;
  return int(group);
}

// The split partials' budget for num_kv key rows of num_heads heads: the size of the bf16 K/V
// buffers the caller already holds (the max_partial_bytes cuda_dense_mha passes).
inline int64_t dense_partials_budget_bytes(int64_t num_kv, int64_t num_heads, int d_nope, int d_v) {
  return num_kv * num_heads * (d_nope + d_v) * 2;
}

// Upper bound of the device scratch one cuda_dense_mha call takes: the partials' budget and a
// tile list too long for the launch parameters (one tile per query row at most without a split,
// T <= num_kv; a split cuts whole tiles of fewer than kDenseSplitWaves x ctas_per_sm (<= 2) x
// sm_count CTAs into at most kDenseMaxSplit runs each).
inline int64_t dense_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope, int d_v,
                                   int sm_count) {
  const int64_t split_tiles = kDenseMaxSplit * kDenseSplitWaves * 2 * int64_t(sm_count);
  const int64_t max_tiles = num_kv > split_tiles ? num_kv : split_tiles;
  return dense_partials_budget_bytes(num_kv, num_heads, d_nope, d_v) +
         max_tiles * int64_t(sizeof(DenseTile));
}

}  // namespace dsakit::cuda::dense_mha
