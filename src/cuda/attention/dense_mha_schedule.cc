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
    // Partial slots: parts x (query rows x heads), every tile's rows in every slot.
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
  if (per_split >= max_blocks) {
    s.tiles = std::move(whole);
  } else {
    s.parts = (max_blocks + per_split - 1) / per_split;
    for (const DenseTile& t : whole)
      for (int32_t part = 0; part < s.parts; ++part) {
        DenseTile x = t;
        x.block_begin = std::min(t.block_end, part * per_split);
        x.block_end = std::min(t.block_end, x.block_begin + per_split);
        x.part = part;
        s.tiles.push_back(x);
      }
  }
  std::stable_sort(s.tiles.begin(), s.tiles.end(), [&](const DenseTile& x, const DenseTile& y) {
    return blocks_of(x) > blocks_of(y);
  });
  return s;
}

}  // namespace dsakit::cuda::dense_mha
