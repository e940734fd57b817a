// Drivers over the layer: whole prompts fed as chunked extends, decode steps, and the host-side
// token store they slice from (docs/layer.md). Used by the CLI, the benchmarks and the tests
// (which fabricate their inputs with tools/harness.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dsakit/layer.h"

namespace dsakit {

// Per-position layer inputs of a set of requests, on the host. Row of (request r, position p)
// is offset(r) + p, offset(r) = Σ_{r' < r} length(r'). Shapes as LayerInputs with T = rows.
struct TokenStore {
  std::vector<int32_t> lengths;  // positions held per request
  Tensor q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w;

  int64_t rows() const;
  int64_t offset(int r) const;
  // Rows `rows` (in order) copied into new host tensors on `backend`'s device.
  struct DeviceInputs {
    Tensor q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w;
    LayerInputs view() const;
  };
  DeviceInputs slice(Backend& backend, const std::vector<int64_t>& rows) const;
};

// One step of a run: the batch that was sent and what came back.
struct StepRecord {
  Batch batch;
  Plan plan;
  std::vector<int64_t> rows;  // TokenStore rows of the step's new tokens, in batch order
  std::vector<StageTime> stages;
};

// Outputs gathered back into TokenStore row order (host, f32); rows never run hold NaN.
struct RunOutputs {
  Tensor o;     // f32 [rows, H, d_v]
  Tensor lse;   // f32 [rows, H]
  Tensor topk;  // i32 [rows, index_topk] positions (-1 padded; all -1 for dense-path rows)
  std::vector<uint8_t> ran;  // [rows] 1 where the row was computed
  std::vector<StepRecord> steps;
};

struct RunSchedule {
  std::vector<int32_t> begin;  // first position to run per request (cached prefix length)
  std::vector<int32_t> end;    // one past the last position to run
  int chunk = 0;               // tokens per request per step; <= 0: everything in one step
  ForwardMode mode = ForwardMode::kExtend;
};

// Runs the schedule through `layer`: step s sends, for every request with positions left,
// the next min(chunk, left) positions as an extend (or decode) over the cached prefix. Results
// are written into `out` (allocated by the first call: pass the same RunOutputs to accumulate
// several schedules). `progress` (optional) is called after each step with (done, total) tokens.
void run_schedule(DsaAttention& layer, const std::vector<std::vector<int32_t>>& page_tables,
                  const TokenStore& tokens, const RunSchedule& schedule, RunOutputs& out,
                  const std::function<void(int64_t, int64_t)>& progress = {});

// The same over any forward with the DsaAttention::forward contract: `requests[i]` is the
// TokenStore request of the step's batch entry i (a DcpRank keeps its own page tables and
// finds a request's by it). Outputs are read back on `backend`.
using LayerForward = std::function<LayerResult(
    const Batch& batch, const std::vector<int32_t>& requests, const LayerInputs& inputs)>;
void run_schedule(const ModelConfig& config, Backend& backend, const LayerForward& forward,
                  const std::vector<std::vector<int32_t>>& page_tables, const TokenStore& tokens,
                  const RunSchedule& schedule, RunOutputs& out,
                  const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace dsakit
