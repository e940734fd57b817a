// Whole-layer timing shared by `dsakit bench` and `dsakit calibrate`: a shape (requests with a
// cached prefix and new tokens), its pools and random inputs on a backend, and the median time
// of one DsaAttention::forward per dispatch policy, the policies interleaved round by round so
// drift hits them alike.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/config.h"
#include "dsakit/cost_model.h"
#include "dsakit/layer.h"
#include "dsakit/plan.h"

namespace dsakit::cli {

// A batch to time: request r has prefix[r] cached positions (stored before timing, re-read by
// every call) and extend[r] new tokens (stored by every call at the same locations).
struct BenchShape {
  std::string kind;  // "fresh" | "prefix" | "mixed"
  std::vector<int32_t> prefix, extend;

  std::string label() const;  // "T=1024", "P=1984 E=64", "[P+E, ...]"
  int64_t tokens() const;
  int64_t max_len() const;
};

// One policy's result on a shape.
struct PolicyTiming {
  // Median time of forward() by Backend::time_ms (CUDA: events, from an idle stream).
  double ms = 0;
  // Median host time until forward() returns (no sync): close to ms when the host, not the GPU,
  // sets the pace.
  double enqueue_ms = 0;
  int runs = 0;                          // timed calls behind the median
  Plan plan;                             // the plan the calls took
  std::map<std::string, double> stages;  // median per-stage ms (same-named stages summed)
};

// FLOPs of one call through `path` over a batch with these features (docs/design.md#benchmarks
// counts: attention, indexer and projections; a mixed plan sums its segments).
double layer_flops(const ModelConfig& config, AttentionPath path, const CostFeatures& f);
double plan_flops(const ModelConfig& config, const Batch& batch, const Plan& plan);

// A policy to time and the layers it runs on: the bench's (LayerBenchOptions::sparse_form), or,
// with masked_form, layers fixed to the masked-MHA form (LayerBench::has_masked_form()).
struct TimedPolicy {
  DispatchPolicy policy;
  bool masked_form = false;
};

// What the timed layers are given beyond the shape.
struct LayerBenchOptions {
  // The layers also take kv_b_proj in its FP8 checkpoint form (LayerOptions::kv_b_proj_fp8,
  // random block-scaled weights); only fp8 / fp8-raw pools use it.
  bool fp8_weights = false;
  SparseRows sparse_rows = SparseRows::kAuto;  // LayerOptions::sparse_rows
  SparseForm sparse_form = SparseForm::kAuto;  // LayerOptions::sparse_form
};

class LayerBench {
 public:
  LayerBench(Backend& backend, ModelConfig config, KvLayout layout, uint64_t seed,
             LayerBenchOptions options = {});
  ~LayerBench();

  const ModelConfig& config() const { return config_; }
  KvLayout layout() const { return layout_; }
  // Whether the layers' dense path reads FP8 weights (asked for, and the pool is FP8).
  bool fp8_weights() const { return options_.fp8_weights && layout_ != KvLayout::kBf16; }
  // The layers' sparse_rows and sparse_form as they run (DSAKIT_SPARSE_ROWS / _FORM applied
  // once a shape is prepared).
  SparseRows sparse_rows() const;
  SparseForm sparse_form() const;
  // The rows' group: "deepseek-v3.2 H=16 fp8", then " w8" where the layers read FP8 weights,
  // " pool" / " staged" where an fp8 pool's sparse_rows is not auto, and " mla" / " masked-mha"
  // where the sparse form is fixed (not auto).
  std::string group() const;

  // Whether prepared shapes also have layers fixed to the masked-MHA form (TimedPolicy::
  // masked_form): the backend has the masked dense kernel for the config.
  bool has_masked_form() const;

  // Allocates pools and random inputs for `shape` (up to 3 rotated sets while one set stays
  // under 1 GiB, else 1) and stores the cached prefixes. Replaces the previous shape.
  void prepare(const BenchShape& shape);
  const Batch& batch() const;

  // Times each policy: one untimed round, then rounds in which each policy runs 4 calls in a
  // row (the first, after a switch of path, is dropped) until `runs` timed calls each or
  // `budget_ms` of wall time is spent (at least `min_runs`), then (if `stages`) a few calls
  // with per-stage timing. Stops early, with what it has, when *stop becomes true.
  std::vector<PolicyTiming> time(const std::vector<TimedPolicy>& policies, int runs, int min_runs,
                                 double budget_ms, bool stages,
                                 const std::atomic<bool>* stop = nullptr);

 private:
  struct State;
  Backend& be_;
  ModelConfig config_;
  KvLayout layout_;
  uint64_t seed_;
  LayerBenchOptions options_;
  std::unique_ptr<State> state_;
};

// Parses "deepseek-v3.2:8,glm-5:4" (preset or config.json path, optional ":tp", default 1).
std::vector<ModelConfig> parse_model_list(const std::string& text);

}  // namespace dsakit::cli
