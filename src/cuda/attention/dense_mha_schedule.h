// The dense MHA kernels' work list (host side): query tiles of <= block_m rows per request, each
// over the kv blocks its rows see, split over several CTAs when the grid would leave SMs idle.
#pragma once

#include <cstdint>
#include <vector>

#include "src/cuda/attention/dense_mha_params.h"
#include "src/cuda/attention/merge_kernels.h"

namespace dsakit::cuda::dense_mha {

struct DenseSchedule {
  std::vector<DenseTile> tiles;  // heaviest (most kv blocks) first; ties in batch order
  // > 1: split-KV. A split tile's runs write partial slots 0..runs-1 (runs <= parts), merged
  // afterwards over merge_segments (rows q * H + h of the split tiles, merged_rows in all);
  // whole tiles (part kDenseWholeTile) write o and lse.
  int parts = 1;
  std::vector<MergeSegment> merge_segments;
  int32_t merged_rows = 0;
};

// A split pays only when it shortens a long tile (docs/perf.md): a tile over fewer kv rows than
// this is never split.
inline constexpr int32_t kDenseMinSplitRows = 1024;

// Tiles of `shape` for requests cu_q / cu_kv (host prefix sums [num_requests + 1]) and
// `num_heads` heads on a device with `sm_count` SMs. Without a split every tile covers all of its
// rows' kv blocks. When tiles x heads < sm_count (a short extend over a long prefix with few
// heads per rank) and the longest tile covers >= kDenseMinSplitRows kv rows, that tile would set
// the kernel's time on a mostly idle GPU: the blocks of every tile longer than one run are cut
// into runs of one length (a tile's last run may be shorter), the smallest that keeps the CTAs
// within shape.ctas_per_sm per SM (the kernel's occupancy) and the partial slots (parts x T x H
// rows of partial_row_bytes) within max_partial_bytes; the other tiles stay whole and need no
// merge. No run length meeting both, or more than kMergeMaxSegments merge segments: no split.
// Invariant: for every tile, its runs' block ranges are disjoint, non-empty and cover
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
// T <= num_kv; a split keeps tiles x parts x heads within twice the SMs, the most any kernel's
// shape.ctas_per_sm allows).
inline int64_t dense_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope, int d_v,
                                   int sm_count) {
  const int64_t max_tiles = num_kv > 2 * int64_t(sm_count) ? num_kv : 2 * int64_t(sm_count);
  return dense_partials_budget_bytes(num_kv, num_heads, d_nope, d_v) +
         max_tiles * int64_t(sizeof(DenseTile));
}

}  // namespace dsakit::cuda::dense_mha
