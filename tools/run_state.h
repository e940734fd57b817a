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

}  // namespace dsakit::cli
