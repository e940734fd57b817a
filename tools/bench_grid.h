// The shapes `dsakit bench` and `dsakit calibrate` time: the bench grids (quick, small, full,
// with the --fresh / --prefixes / --extends / --no-mixed overrides) and the compact calibration
// grid (docs/benchmarks.md, docs/dispatch.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/config.h"
#include "dsakit/plan.h"
#include "tools/measure.h"

namespace dsakit::cli {

struct BenchOptions;

// A bench grid: fresh prompts, every cached prefix with every extend, and mixed batches.
struct BenchGrid {
  std::vector<int32_t> fresh, prefixes, extends;
  std::vector<BenchShape> mixed;

  static BenchGrid named(const std::string& name);  // quick | small | full
  std::vector<BenchShape> shapes(bool with_mixed) const;
};

// The shapes of a bench run: the options' grid (default: full on CUDA, small on the CPU) with
// their overrides; throws Error(kInvalidArgument) for an empty grid or a shape over 2^20 tokens.
std::vector<BenchShape> bench_shapes(const BenchOptions& options, Device device);

// The calibration grid for a model with this index_topk; `long_prompts` adds fresh prompts of 2, 4
// and 8 index_topk (the masked-MHA form against MLA on both sides of their crossover; seconds per
// call on a CPU).
std::vector<BenchShape> calibration_shapes(int index_topk, bool long_prompts);

// Whether `mode` may run this shape (forced dense only where it is exact and compiled).
bool mode_allowed(DispatchMode mode, const BenchShape& shape, const ModelConfig& config,
                  const Capabilities& caps);

}  // namespace dsakit::cli
