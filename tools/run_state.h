// What `dsakit run` sets up and produces, shared by its pieces: run_command.cc (lengths, set-up,
// the schedule, the report), run_verify.cc (--verify) and run_file.cc (--save / --inputs).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/config.h"
#include "dsakit/driver.h"
#include "dsakit/layer.h"
#include "dsakit/pool.h"
#include "dsakit/safetensors.h"
#include "tools/harness.h"

namespace dsakit::cli {

// Per request: the prompt (cached prefix included) and its cached prefix; the decode steps after
// every prompt.
struct RunLengths {
  std::vector<int32_t> prompt, prefix;
  int decode_steps = 0;
  // Positions each request holds at the end: prompt + decode steps.
  std::vector<int32_t> total() const {
    std::vector<int32_t> t(prompt);
    for (auto& x : t) x += decode_steps;
    return t;
  }
};

// A run's inputs, pools and layer, and what it produced. Not copyable: the layer refers to the
// pools and the backend.
struct RunState {
  ModelConfig cfg;
  RunLengths len;
  SafetensorsFile in_file;  // --inputs (empty without)
  std::unique_ptr<Backend> be;
  TokenStore tokens;
  Tensor kv_b_proj_host, kv_b_proj;  // bf16 [H*(d_nope+d_v), d_c]: host and device copies
  Fp8KvBProj kv_b_proj_fp8_host;     // --fp8-weights: kv_b_proj's FP8 form (host), else empty
  Tensor kv_b_proj_codes, kv_b_proj_scales;  // its device copies
  KvPoolDesc kd;
  PagedKvPool kv_pool;
  IndexKeyPool index_pool;
  std::vector<std::vector<int32_t>> tables;  // page table per request
  std::unique_ptr<DsaAttention> layer;
  RunOutputs out;
  size_t prefix_steps = 0;  // out.steps that stored the cached prefix (setup, not results)
  double wall_ms = 0;       // the steps' wall time

  RunState() = default;
  RunState(const RunState&) = delete;
  RunState& operator=(const RunState&) = delete;
};

// The steps of a run through `forward`: the cached prefix (one call, its rows then marked not
// run), the rest of each prompt in --chunk pieces, then the decode steps, into `out`.
struct StepsResult {
  size_t prefix_steps = 0;  // out.steps that stored the cached prefix
  double wall_ms = 0;       // the steps' wall time
};
struct RunOptions;
// The options checked before anything is read or allocated.
void check_run_options(const RunOptions& options);
// The run's lengths, from --inputs (read into in_file) or the options; checked.
RunLengths run_lengths(const RunOptions& options, SafetensorsFile& in_file);
// The backend, the inputs, the pools with their page tables and the layer of a one-device run.
void set_up_run(const RunOptions& options, RunState& run);
// The pools (sized for run.tokens), page tables and layer of a run whose backend, inputs and
// kv_b_proj_host are set (the second half of set_up_run).
void set_up_layer(const RunOptions& options, RunState& run);
// The pool a run's flags describe (num_pages left 0).
KvPoolDesc run_pool_desc(const RunOptions& options, const ModelConfig& config);
// The layer options a run's flags ask for (stage times on).
LayerOptions run_layer_options(const RunOptions& options);
// run_steps through run.layer, into run.out (run.prefix_steps, run.wall_ms).
void run_layer_steps(const RunOptions& options, RunState& run);
StepsResult run_steps(const RunOptions& options, const RunLengths& lengths,
                      const ModelConfig& config, Backend& backend, const LayerForward& forward,
                      const std::vector<std::vector<int32_t>>& page_tables,
                      const TokenStore& tokens, RunOutputs& out);

}  // namespace dsakit::cli
