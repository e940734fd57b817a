// Launcher of merge_partials (docs/layer.md, context parallelism; split-KV): W partial attention
// results merged by lse.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda {

// Rows of one split-KV segment: rows [row_begin, row_begin + n) of o / lse and of every slot,
// merged over slots 0 .. parts-1, where n runs to the next segment's merged_begin (the last
// segment's to merged_rows).
struct MergeSegment {
  int64_t row_begin;
  int32_t merged_begin;  // rows of the segments before this one: the launch's index of row_begin
  int32_t parts;         // 1 .. MergePartialsParams::parts
};

// Segments one launch carries in its parameters.
inline constexpr int kMergeMaxSegments = 128;

struct MergePartialsParams {
  const void* o_parts;     // [parts, rows, d], rows = T * H; bf16 if o_parts_bf16 else f32
  const float* lse_parts;  // [parts, rows] natural log; +inf = the part saw no valid key
  void* o;                 // [rows, d] f32 if o_f32 else bf16
  float* lse;              // [rows]
  bool o_f32;
  int64_t rows;
  int parts;
  int d;
  bool o_parts_bf16;  // bf16 parts are widened exactly: they merge as f32 parts of those values
  // 0: every row over all `parts` slots. Else only the rows of segments[0 .. num_segments) are
  // merged (the others are neither read nor written), merged_rows of them in all.
  int num_segments = 0;
  int32_t merged_rows = 0;
  MergeSegment segments[kMergeMaxSegments] = {};
};

// The row (of o / lse) that the launch's index i merges and its slot count; false past the
// last merged row. With segments: a binary search for the last one with merged_begin <= i.
__host__ __device__ inline bool merged_row(const MergePartialsParams& p, int64_t i, int64_t& row,
                                           int& parts) {
  if (p.num_segments == 0) {
    row = i, parts = p.parts;
    return i < p.rows;
  }
  if (i >= p.merged_rows) return false;
  int lo = 0, hi = p.num_segments - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.segments[mid].merged_begin <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  row = p.segments[lo].row_begin + (i - p.segments[lo].merged_begin);
  parts = p.segments[lo].parts;
  return true;
}

cudaError_t launch_merge_partials(const MergePartialsParams& p, cudaStream_t stream);

}  // namespace dsakit::cuda
