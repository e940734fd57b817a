#include "src/cuda/attention/dense_mha_schedule.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace dsakit::cuda::dense_mha {

static_assert(kDenseSm80Shape.block_m <= kDenseCostRows * kDenseMaxCostGroups &&
              dense_sm90_shape(128).block_m <= kDenseCostRows * kDenseMaxCostGroups &&
              dense_sm90_shape(256).block_m <= kDenseCostRows * kDenseMaxCostGroups);

namespace {

// dense_run_cost's terms: per group of kDenseCostRows rows of tile t, one past the last block
// its last row sees (at most t.block_end). Returns the group count.
int32_t group_ends(const DenseTile& t, DenseTileShape shape, int32_t (&seen)[kDenseMaxCostGroups]) {
  int32_t groups = 0;
  for (int32_t row = 0; row < t.q_len; row += kDenseCostRows) {
    const int32_t last = t.first_query_pos + std::min(t.q_len, row + kDenseCostRows) - 1;
    seen[groups++] = std::min(t.block_end, last / shape.block_n + 1);
  }
  return groups;
}

int32_t cost_of_blocks(const int32_t* seen, int32_t groups, int32_t b0, int32_t b1) {
  int32_t cost = 0;
  for (int32_t g = 0; g < groups; ++g) cost += std::max(0, std::min(b1, seen[g]) - b0);
  return cost;
}

}  // namespace

int32_t dense_run_cost(const DenseTile& t, int32_t block_begin, int32_t block_end,
                       DenseTileShape shape) {
  int32_t seen[kDenseMaxCostGroups];
  const int32_t groups = group_ends(t, shape, seen);
  return cost_of_blocks(seen, groups, block_begin, block_end);
}

namespace {

// dense_makespan, stopping once a slot's load reaches `bound` (then returns that load). The
// slots are counted per load (loads[l]: slots at load l); each CTA goes to a least loaded slot,
// and the least load never falls, so `low` only moves up; the CTAs of one cost move a whole
// bucket of slots at a time. No load exceeds the average plus the costliest CTA (each CTA lands
// on a slot at or below the average), which sizes the buckets. `loads` is the caller's buffer,
// reused across calls.
int64_t makespan_within(std::vector<std::pair<int64_t, int64_t>>& cost_count, int64_t slots,
                        int64_t bound, std::vector<int64_t>& loads) {
  std::sort(cost_count.begin(), cost_count.end(),
            [](const auto& x, const auto& y) { return x.first > y.first; });
  slots = std::max<int64_t>(slots, 1);
  int64_t total = 0;
  for (const auto& [cost, count] : cost_count) total += cost * count;
  const int64_t max_cost = cost_count.empty() ? 0 : cost_count.front().first;
  loads.assign(size_t(total / slots + max_cost + 1), 0);
  loads[0] = slots;
  int64_t low = 0, longest = 0;
  for (auto [cost, count] : cost_count) {
    if (cost <= 0) continue;
    while (count > 0 && longest < bound) {
      while (loads[size_t(low)] == 0) ++low;
      const int64_t moved = std::min(count, loads[size_t(low)]);
      loads[size_t(low)] -= moved;
      loads[size_t(low + cost)] += moved;
      longest = std::max(longest, low + cost);
      count -= moved;
    }
  }
  return longest;
}

}  // namespace

int64_t dense_makespan(std::vector<std::pair<int64_t, int64_t>> cost_count, int64_t slots) {
  std::vector<int64_t> loads;
  return makespan_within(cost_count, slots, INT64_MAX, loads);
}

namespace {

// A whole tile and what the candidates need of it: its blocks, its units, and dense_run_cost's
// terms (group_ends).
struct WholeTile {
  DenseTile tile;
  int32_t blocks;
  int32_t cost;
  int32_t groups;
  int32_t seen[kDenseMaxCostGroups];
};

int32_t run_cost(const WholeTile& w, int32_t b0, int32_t b1) {
  return cost_of_blocks(w.seen, w.groups, b0, b1);
}

}  // namespace

DenseSchedule build_dense_schedule(const int32_t* cu_q, const int32_t* cu_kv, int num_requests,
                                   int64_t num_heads, int sm_count, int64_t partial_row_bytes,
                                   int64_t max_partial_bytes, DenseTileShape shape) {
  DenseSchedule s;
  std::vector<WholeTile> whole;
  size_t num_whole = 0;
  for (int r = 0; r < num_requests; ++r)
    num_whole += size_t((cu_q[r + 1] - cu_q[r] + shape.block_m - 1) / shape.block_m);
  whole.reserve(num_whole);
  int32_t max_blocks = 0, max_cost = 0;
  for (int r = 0; r < num_requests; ++r) {
    const int32_t q_begin = cu_q[r], extend = cu_q[r + 1] - q_begin;
    const int32_t prefix = cu_kv[r + 1] - cu_kv[r] - extend;
    for (int32_t i0 = 0; i0 < extend; i0 += shape.block_m) {
      const int32_t q_len = std::min(shape.block_m, extend - i0);
      const int32_t blocks = (prefix + i0 + q_len + shape.block_n - 1) / shape.block_n;
      WholeTile w{{q_begin + i0, q_len, cu_kv[r], prefix + i0, 0, blocks, 0}, blocks, 0, 0, {}};
      w.groups = group_ends(w.tile, shape, w.seen);
      w.cost = run_cost(w, 0, blocks);
      whole.push_back(w);
      max_blocks = std::max(max_blocks, blocks);
      max_cost = std::max(max_cost, w.cost);
    }
  }
  const int64_t slots = int64_t(shape.ctas_per_sm) * std::max(sm_count, 1);
  s.few_waves = int64_t(whole.size()) * num_heads < kDenseSplitWaves * slots;
  // Blocks per run of each whole tile in the chosen schedule (its blocks: whole); a tile's runs
  // are ceil(blocks / run), the last may be shorter.
  std::vector<int32_t> best_run(whole.size());
  for (size_t i = 0; i < whole.size(); ++i) best_run[i] = whole[i].blocks;
  const auto runs_of = [&](size_t i, int32_t run) { return (whole[i].blocks + run - 1) / run; };
  if (s.few_waves && int64_t(max_blocks) * shape.block_n >= kDenseMinSplitRows) {
    // Candidates: every tile costing more than max_cost / k (k in kDenseSplitCandidates) cut
    // into ceil(cost / (max_cost / k)) runs of equal block counts (fewer where it has fewer
    // blocks); the first of the least estimated time wins, the whole schedule unless a split
    // beats it.
    const int64_t slot_bytes = int64_t(cu_q[num_requests]) * num_heads * partial_row_bytes;
    std::vector<std::pair<int64_t, int64_t>> ctas;
    for (const WholeTile& w : whole) ctas.emplace_back(kDenseCtaCost + w.cost, num_heads);
    std::vector<int64_t> loads;
    int64_t best_time = makespan_within(ctas, slots, INT64_MAX, loads);
    std::vector<int32_t> run(whole.size()), previous = best_run;
    for (const int32_t k : kDenseSplitCandidates) {
      const int32_t max_run_cost = (max_cost + k - 1) / k;
      int32_t parts = 1;
      for (size_t i = 0; i < whole.size(); ++i) {
        const WholeTile& w = whole[i];
        if (w.cost <= max_run_cost) {
          run[i] = w.blocks;
          continue;
        }
        const int32_t wanted = std::min(w.blocks, (w.cost + max_run_cost - 1) / max_run_cost);
        run[i] = (w.blocks + wanted - 1) / wanted;
        parts = std::max(parts, runs_of(i, run[i]));
      }
      if (run == previous) continue;
      previous = run;
      if (parts == 1 || parts * slot_bytes > max_partial_bytes) continue;
      // Its least possible time first: the costliest CTA, or all of them spread evenly.
      ctas.clear();
      int64_t longest = 0, total = 0;
      for (size_t i = 0; i < whole.size(); ++i)
        for (int32_t b0 = 0; b0 < whole[i].blocks; b0 += run[i]) {
          const int64_t cost = kDenseCtaCost + run_cost(whole[i], b0, b0 + run[i]);
          ctas.emplace_back(cost, num_heads);
          longest = std::max(longest, cost);
          total += cost * num_heads;
        }
      if (std::max(longest, (total + slots - 1) / slots) + kDenseMergeCost >= best_time) continue;
      const int64_t time =
          makespan_within(ctas, slots, best_time - kDenseMergeCost, loads) + kDenseMergeCost;
      if (time < best_time) {
        best_time = time;
        best_run = run;
        s.parts = parts;
      }
    }
  }
  if (s.parts > 1) {
    // Each split tile's rows (q * H + h, contiguous) join the merge, in runs of rows with one
    // part count; more segments than one merge launch takes: the whole tiles instead.
    int32_t merged = 0;
    for (size_t i = 0; i < whole.size(); ++i) {
      const int32_t runs = runs_of(i, best_run[i]);
      if (runs == 1) continue;
      const DenseTile& t = whole[i].tile;
      const int64_t row_begin = int64_t(t.q_begin) * num_heads;
      MergeSegment* last = s.merge_segments.empty() ? nullptr : &s.merge_segments.back();
      if (last == nullptr || last->parts != runs ||
          last->row_begin + (merged - last->merged_begin) != row_begin)
        s.merge_segments.push_back({row_begin, merged, runs});
      merged += int32_t(t.q_len * num_heads);
    }
    s.merged_rows = merged;
    if (s.merge_segments.size() > size_t(kMergeMaxSegments)) {
      s.parts = 1;
      s.merge_segments.clear();
      s.merged_rows = 0;
      for (size_t i = 0; i < whole.size(); ++i) best_run[i] = whole[i].blocks;
    }
  }
  // The tiles with their units, costliest first (stable: ties in batch order).
  std::vector<std::pair<int64_t, DenseTile>> costed;
  costed.reserve(whole.size() * size_t(s.parts));
  for (size_t i = 0; i < whole.size(); ++i) {
    const WholeTile& w = whole[i];
    const int32_t run = best_run[i], runs = runs_of(i, run);
    if (runs == 1) {
      costed.emplace_back(w.cost, w.tile);
      if (s.parts > 1) costed.back().second.part = kDenseWholeTile;
      continue;
    }
    for (int32_t part = 0; part < runs; ++part) {
      DenseTile x = w.tile;
      x.block_begin = part * run;
      x.block_end = std::min(w.blocks, x.block_begin + run);
      x.part = part;
      costed.emplace_back(run_cost(w, x.block_begin, x.block_end), x);
    }
  }
  std::stable_sort(costed.begin(), costed.end(),
                   [](const auto& x, const auto& y) { return x.first > y.first; });
  s.tiles.reserve(costed.size());
  for (const auto& [cost, tile] : costed) s.tiles.push_back(tile);
  return s;
}

}  // namespace dsakit::cuda::dense_mha
