#include "src/cuda/attention/dense_mha_schedule.h"

#include <algorithm>
#include <cstdint>
#include <utility>

namespace dsakit::cuda::dense_mha {

static_assert(kDenseSm80Shape.block_m <= kDenseCostRows * kDenseMaxCostGroups &&
              dense_sm90_shape(128).block_m <= kDenseCostRows * kDenseMaxCostGroups &&
              dense_sm90_shape(256).block_m <= kDenseCostRows * kDenseMaxCostGroups);
// A row half is one cost group: its units are the whole tile's group terms.
static_assert(dense_sm90_shape(128).short_tile_rows == kDenseCostRows &&
              dense_sm90_shape(256).short_tile_rows == kDenseCostRows);

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

// A whole tile (or a row half of one) and what the candidates need of it: its blocks, its units,
// and dense_run_cost's terms (group_ends).
struct WholeTile {
  DenseTile tile;
  int32_t blocks;
  int32_t cost;
  int32_t groups;
  int32_t seen[kDenseMaxCostGroups];
};

WholeTile whole_tile(const DenseTile& t, DenseTileShape shape) {
  WholeTile w{t, t.block_end, 0, 0, {}};
  w.groups = group_ends(w.tile, shape, w.seen);
  w.cost = cost_of_blocks(w.seen, w.groups, 0, w.blocks);
  return w;
}

int32_t run_cost(const WholeTile& w, int32_t b0, int32_t b1) {
  return cost_of_blocks(w.seen, w.groups, b0, b1);
}

// A piece of a candidate schedule: a whole tile or a row half of one, cut into runs of `run`
// blocks (its blocks: left whole).
struct Piece {
  const WholeTile* tile;
  int32_t run;
  int32_t runs() const { return (tile->blocks + run - 1) / run; }
  bool operator==(const Piece&) const = default;
};

}  // namespace

DenseSchedule build_dense_schedule(const int32_t* cu_q, const int32_t* cu_kv, int num_requests,
                                   int64_t num_heads, int sm_count, int64_t partial_row_bytes,
                                   int64_t max_partial_bytes, DenseTileShape shape) {
  DenseSchedule s;
  // The whole tiles, and each one's two row halves where the kernel splits short tiles' blocks
  // (halves[2i], halves[2i + 1]: rows [0, short_tile_rows) and the rest; unused where tile i is
  // short already). Both vectors are sized before any Piece points into them.
  std::vector<WholeTile> whole, halves;
  size_t num_whole = 0;
  for (int r = 0; r < num_requests; ++r)
    num_whole += size_t((cu_q[r + 1] - cu_q[r] + shape.block_m - 1) / shape.block_m);
  whole.reserve(num_whole);
  const int32_t half_rows = shape.short_tile_rows;
  const auto blocks_seen = [&](int32_t first_query_pos, int32_t q_len) {
    return (first_query_pos + q_len + shape.block_n - 1) / shape.block_n;
  };
  int32_t max_blocks = 0, max_cost = 0;
  for (int r = 0; r < num_requests; ++r) {
    const int32_t q_begin = cu_q[r], extend = cu_q[r + 1] - q_begin;
    const int32_t prefix = cu_kv[r + 1] - cu_kv[r] - extend;
    for (int32_t i0 = 0; i0 < extend; i0 += shape.block_m) {
      const int32_t q_len = std::min(shape.block_m, extend - i0), pos = prefix + i0;
      whole.push_back(
          whole_tile({q_begin + i0, q_len, cu_kv[r], pos, 0, blocks_seen(pos, q_len), 0}, shape));
      max_blocks = std::max(max_blocks, whole.back().blocks);
      max_cost = std::max(max_cost, whole.back().cost);
    }
  }
  const int64_t slots = int64_t(shape.ctas_per_sm) * std::max(sm_count, 1);
  s.few_waves = int64_t(whole.size()) * num_heads < kDenseSplitWaves * slots;
  const bool halvable = s.few_waves && half_rows > 0 && half_rows < shape.block_m;
  if (halvable) {
    halves.resize(2 * whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      const DenseTile& t = whole[i].tile;
      if (t.q_len <= half_rows) continue;
      const int32_t pos = t.first_query_pos + half_rows, rest = t.q_len - half_rows;
      halves[2 * i] = whole_tile({t.q_begin, half_rows, t.kv_begin, t.first_query_pos, 0,
                                  blocks_seen(t.first_query_pos, half_rows), 0},
                                 shape);
      halves[2 * i + 1] = whole_tile(
          {t.q_begin + half_rows, rest, t.kv_begin, pos, 0, blocks_seen(pos, rest), 0}, shape);
    }
  }
  std::vector<Piece> best;
  best.reserve(whole.size());
  for (const WholeTile& w : whole) best.push_back({&w, w.blocks});
  if (s.few_waves) {
    // Candidates, for each k in kDenseSplitCandidates: every tile costing more than max_cost / k
    // cut into ceil(cost / (max_cost / k)) runs of equal block counts (fewer where it has fewer
    // blocks) or, where the kernel takes short tiles, first into its row halves, each then cut
    // the same way if it still costs more. The first of the least estimated time wins, the
    // whole schedule unless a candidate beats it. Runs (split-KV) need a tile over >=
    // kDenseMinSplitRows kv rows and partial slots within max_partial_bytes; row halves need
    // neither (no partials, no merge).
    const bool may_split = int64_t(max_blocks) * shape.block_n >= kDenseMinSplitRows;
    const int64_t slot_bytes = int64_t(cu_q[num_requests]) * num_heads * partial_row_bytes;
    std::vector<std::pair<int64_t, int64_t>> ctas;
    for (const WholeTile& w : whole) ctas.emplace_back(kDenseCtaCost + w.cost, num_heads);
    std::vector<int64_t> loads;
    int64_t best_time = makespan_within(ctas, slots, INT64_MAX, loads);
    std::vector<Piece> plan, previous = best;
    for (const int32_t k : kDenseSplitCandidates)
      for (const bool halve : {false, true}) {
        if (halve && !halvable) continue;
        const int32_t max_run_cost = (max_cost + k - 1) / k;
        int32_t parts = 1;
        const auto add = [&](const WholeTile& w) {
          int32_t run = w.blocks;
          if (w.cost > max_run_cost) {
            const int32_t wanted = std::min(w.blocks, (w.cost + max_run_cost - 1) / max_run_cost);
            run = (w.blocks + wanted - 1) / wanted;
          }
          plan.push_back({&w, run});
          parts = std::max(parts, plan.back().runs());
        };
        plan.clear();
        for (size_t i = 0; i < whole.size(); ++i) {
          if (halve && whole[i].cost > max_run_cost && whole[i].tile.q_len > half_rows) {
            add(halves[2 * i]);
            add(halves[2 * i + 1]);
          } else {
            add(whole[i]);
          }
        }
        if (plan == previous) continue;
        previous = plan;
        if (parts > 1 && (!may_split || parts * slot_bytes > max_partial_bytes)) continue;
        // Its least possible time first: the costliest CTA, or all of them spread evenly.
        const int64_t merge = parts > 1 ? kDenseMergeCost : 0;
        ctas.clear();
        int64_t longest = 0, total = 0;
        for (const Piece& piece : plan)
          for (int32_t b0 = 0; b0 < piece.tile->blocks; b0 += piece.run) {
            const int64_t cost = kDenseCtaCost + run_cost(*piece.tile, b0, b0 + piece.run);
            ctas.emplace_back(cost, num_heads);
            longest = std::max(longest, cost);
            total += cost * num_heads;
          }
        if (std::max(longest, (total + slots - 1) / slots) + merge >= best_time) continue;
        const int64_t time = makespan_within(ctas, slots, best_time - merge, loads) + merge;
        if (time < best_time) {
          best_time = time;
          best = plan;
          s.parts = parts;
        }
      }
  }
  if (s.parts > 1) {
    // Each split piece's rows (q * H + h, contiguous) join the merge, in runs of rows with one
    // part count; more segments than one merge launch takes: the whole tiles instead.
    int32_t merged = 0;
    for (const Piece& piece : best) {
      const int32_t runs = piece.runs();
      if (runs == 1) continue;
      const DenseTile& t = piece.tile->tile;
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
      best.clear();
      for (const WholeTile& w : whole) best.push_back({&w, w.blocks});
    }
  }
  // The pieces' tiles with their units, costliest first (stable: ties in batch order).
  std::vector<std::pair<int64_t, DenseTile>> costed;
  costed.reserve(best.size() * size_t(s.parts));
  for (const Piece& piece : best) {
    const WholeTile& w = *piece.tile;
    const int32_t runs = piece.runs();
    if (runs == 1) {
      costed.emplace_back(w.cost, w.tile);
      if (s.parts > 1) costed.back().second.part = kDenseWholeTile;
      continue;
    }
    for (int32_t part = 0; part < runs; ++part) {
      DenseTile x = w.tile;
      x.block_begin = part * piece.run;
      x.block_end = std::min(w.blocks, x.block_begin + piece.run);
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
