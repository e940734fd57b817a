#include "src/cuda/attention/dense_mha_schedule.h"

#include <algorithm>

namespace dsakit::cuda::dense_mha {

DenseSchedule build_dense_schedule(const int32_t* cu_q, const int32_t* cu_kv, int num_requests,
                                   int64_t num_heads, int sm_count, int64_t partial_row_bytes,
                                   int64_t max_partial_bytes, DenseTileShape shape) {
  DenseSchedule s;
  std::vector<DenseTile> whole;
  int32_t max_blocks = 0;
  for (int r = 0; r < num_requests; ++r) {
    const int32_t q_begin = cu_q[r], extend = cu_q[r + 1] - q_begin;
    const int32_t prefix = cu_kv[r + 1] - cu_kv[r] - extend;
    for (int32_t i0 = 0; i0 < extend; i0 += shape.block_m) {
      const int32_t q_len = std::min(shape.block_m, extend - i0);
      const int32_t blocks = (prefix + i0 + q_len + shape.block_n - 1) / shape.block_n;
      whole.push_back({q_begin + i0, q_len, cu_kv[r], prefix + i0, 0, blocks, 0});
      max_blocks = std::max(max_blocks, blocks);
    }
  }
  const auto blocks_of = [](const DenseTile& t) { return t.block_end - t.block_begin; };
  int32_t per_split = max_blocks;
  if (int64_t(whole.size()) * num_heads < int64_t(sm_count) &&
      int64_t(max_blocks) * shape.block_n >= kDenseMinSplitRows) {
    // Partial slots: parts x (query rows x heads), indexed by the row as o is.
    const int64_t slot_bytes = int64_t(cu_q[num_requests]) * num_heads * partial_row_bytes;
    for (per_split = 1; per_split < max_blocks; ++per_split) {
      int64_t working = 0;
      for (const DenseTile& t : whole) working += (blocks_of(t) + per_split - 1) / per_split;
      const int64_t parts = (max_blocks + per_split - 1) / per_split;
      if (working * num_heads <= int64_t(shape.ctas_per_sm) * sm_count &&
          parts * slot_bytes <= max_partial_bytes)
        break;
    }
  }
  if (per_split < max_blocks) {
    // Tiles over more than one run are split; each split tile's rows (q * H + h, contiguous)
    // join the merge, in runs of rows with one part count.
    int32_t merged = 0;
    for (const DenseTile& t : whole) {
      const int32_t runs = (blocks_of(t) + per_split - 1) / per_split;
      if (runs == 1) {
        DenseTile x = t;
        x.part = kDenseWholeTile;
        s.tiles.push_back(x);
        continue;
      }
      for (int32_t part = 0; part < runs; ++part) {
        DenseTile x = t;
        x.block_begin = part * per_split;
        x.block_end = std::min(t.block_end, x.block_begin + per_split);
        x.part = part;
        s.tiles.push_back(x);
      }
      s.parts = std::max(s.parts, int(runs));
      const int64_t row_begin = int64_t(t.q_begin) * num_heads;
      const auto rows = int32_t(t.q_len * num_heads);
      MergeSegment* last = s.merge_segments.empty() ? nullptr : &s.merge_segments.back();
      if (last == nullptr || last->parts != runs ||
          last->row_begin + (merged - last->merged_begin) != row_begin)
        s.merge_segments.push_back({row_begin, merged, runs});
      merged += rows;
    }
    s.merged_rows = merged;
    if (s.merge_segments.size() > size_t(kMergeMaxSegments)) s = DenseSchedule{};
  }
  if (s.tiles.empty()) s.tiles = std::move(whole);
  std::stable_sort(s.tiles.begin(), s.tiles.end(), [&](const DenseTile& x, const DenseTile& y) {
    return blocks_of(x) > blocks_of(y);
  });
  return s;
}

}  // namespace dsakit::cuda::dense_mha
