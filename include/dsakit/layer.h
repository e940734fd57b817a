// One DSA attention layer at the attention-backend boundary (docs/design.md, docs/layer.md):
// store the new tokens' latent KV and index keys into the pools, plan, run the chosen path.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/plan.h"
#include "dsakit/pool.h"
#include "dsakit/tensor.h"

namespace dsakit {

namespace detail {
struct DeviceBatchIndex;  // src/layer/paths.h
}  // namespace detail

// Per-call inputs, on the layer backend's device; T new tokens in batch (request) order.
struct LayerInputs {
  TensorView q_nope;  // bf16 [T, H, d_nope]
  TensorView q_pe;    // bf16 [T, H, d_rope]   RoPE applied
  TensorView c_kv;    // bf16 [T, d_c]         normalized latent KV
  TensorView k_pe;    // bf16 [T, d_rope]      RoPE applied
  TensorView idx_q;   // bf16 [T, H_i, d_i]
  TensorView idx_k;   // bf16 [T, d_i]
  TensorView idx_w;   // f32  [T, H_i]
};

struct StageTime {
  std::string stage;  // store, plan, gather, up_proj_kv, dense_mha, indexer_topk, absorb, ...
  double ms = 0;
};

struct LayerResult {
  Tensor o;     // [T, H, d_v]: bf16 (or LayerOptions::output_dtype)
  Tensor lse;   // f32 [T, H], natural log
  Tensor topk;  // i32 [T, index_topk] positions within each request (sparse path or a mixed
                // plan, whose dense rows hold -1; undefined for the dense path)
  Plan plan;
  std::vector<StageTime> stages;  // filled when LayerOptions::time_stages
};

// How the sparse path reads an fp8 / fp8-raw pool (docs/layer.md#staged-rows).
enum class SparseRows : uint8_t {
  kAuto,    // staged where the backend prefers bf16 rows (Capabilities::sparse_prefers_bf16_rows,
            // not for fp8-raw pools up to sparse_reads_fp8_raw_heads heads), bf16 holds the
            // pool's values (bf16_holds_pool_values) and the batch reads each context row often
            // enough (detail::kStagedRowMinReads); else the pool
  kPool,    // sparse_mla reads the pool's rows
  kStaged,  // the batch's context rows are copied to a bf16 pool first (gather_kv), sparse_mla
            // reads the copy; kInvalidArgument where bf16 does not hold the pool's values
};
const char* to_string(SparseRows rows);              // "auto" | "pool" | "staged"
SparseRows parse_sparse_rows(const std::string& s);  // throws naming the accepted names

struct LayerOptions {
  double sm_scale = 0;                // 0: ModelConfig::softmax_scale()
  DType output_dtype = DType::kBF16;  // bf16 or f32
  DispatchPolicy policy;
  // Time each stage with Backend::time_ms (CUDA: events on the stream, from an idle device;
  // CPU: wall time) into LayerResult::stages.
  bool time_stages = false;
  // Upper bound on workspace_bytes() of one forward call; 0: no limit. A call over the limit
  // throws Error(kResource) before anything is stored or computed. Under sparse_form kAuto a
  // plan whose masked-MHA form would exceed it takes the MLA form instead.
  int64_t max_workspace_bytes = 0;
  // kv_b_proj as the FP8 checkpoint holds it (optional; on the backend's device; the same weights
  // as the bf16 kv_b_proj, which the sparse path and bf16 pools still use). With an fp8 or
  // fp8-raw pool and a backend with Capabilities::fp8_up_proj, the dense path's K/V
  // up-projection multiplies the pool's codes and scales by these as stored
  // (Backend::up_proj_kv_fp8): no dequantized copy of either, and W exactly as the checkpoint
  // defines it (docs/layer.md#fp8-weights).
  Fp8BlockWeights kv_b_proj_fp8;
  // The sparse path's fp8 pool reads; DSAKIT_SPARSE_ROWS (auto | pool | staged), read when the
  // layer is constructed, overrides it. Staged or not, the values read are the same.
  SparseRows sparse_rows = SparseRows::kAuto;
  // The sparse path's attention (SparseForm, in plan.h); DSAKIT_SPARSE_FORM (auto | mla |
  // masked-mha), read when the layer is constructed, overrides it. kAuto: cost mode picks the
  // cheaper form per batch where its profile prices both (Plan::sparse_form says which), kMla
  // in the other modes and on backends without the masked kernel. kMaskedMha on such a backend
  // is Error(kUnsupported) then. DcpSimulation's ranks run kMla (their top-k merge needs MLA's
  // partial results).
  SparseForm sparse_form = SparseForm::kAuto;
};

// Checks layer inputs against the config for T new tokens on `device` (throws naming the tensor).
void check_layer_inputs(const ModelConfig& config, Device device, const LayerInputs& inputs,
                        int64_t num_tokens);

// Caller-given output tensors for forward(), e.g. an engine's own buffers or the static outputs
// of a captured CUDA graph. Each one is optional (ndim == 0: the call allocates it) and is
// checked like the inputs (shape, dtype, device, contiguous) before anything is written.
struct LayerOutputs {
  TensorView o;     // [T, H, d_v] of LayerOptions::output_dtype
  TensorView lse;   // f32 [T, H]
  TensorView topk;  // i32 [T, index_topk]: written only when some request takes the sparse path
};
// Checks the given outputs of a call over T new tokens (throws naming the tensor).
void check_layer_outputs(const ModelConfig& config, Device device, DType output_dtype,
                         const LayerOutputs& outputs, int64_t num_tokens);

// A batch validated and planned by one layer, with its index arrays already on the layer's
// device (DsaAttention::prepare). forward() over it builds and uploads nothing: once a call of
// the same shapes has warmed the backend's memory, such a forward can be captured into a CUDA
// graph (with LayerOutputs the graph owns) and replayed while the PreparedBatch lives.
class PreparedBatch {
 public:
  PreparedBatch() = default;
  bool defined() const { return state_ != nullptr; }
  const Batch& batch() const;  // throw kInvalidArgument when !defined()
  const Plan& plan() const;

 private:
  friend class DsaAttention;
  struct State;
  std::shared_ptr<const State> state_;
};

class DsaAttention {
 public:
  // kv_b_proj: bf16 [H*(d_nope+d_v), d_c] on the backend's device. The pools must share one
  // page size and have enough pages; they outlive the layer.
  DsaAttention(ModelConfig config, Backend& backend, PagedKvPool& kv_pool, IndexKeyPool& index_pool,
               TensorView kv_b_proj, LayerOptions options = {});

  const ModelConfig& config() const { return config_; }
  double sm_scale() const { return sm_scale_; }
  Backend& backend() const { return backend_; }
  const LayerOptions& options() const { return options_; }
  // Replaces the dispatch policy (DSAKIT_PROFILE, when set, is read here and at construction,
  // not per call).
  void set_policy(const DispatchPolicy& policy);

  // The dispatcher's decision for `batch` (validates the batch against the pools).
  Plan plan(const Batch& batch) const;

  // Bytes of device memory one forward call over the valid `batch` allocates when it takes
  // `path`: the outputs, the index arrays, the path's intermediates (dense: gathered and
  // up-projected K/V of all Σ L_r positions; sparse: top-k, locations, q_abs, o_lat) and the
  // scratch the backend reports for its ops (dense_mha_scratch_bytes; the indexer's blocks,
  // IndexerBlocks, at most indexer_block_bytes()). Kernel-internal scratch of fixed size
  // (per-thread tiles, f32 staging of bf16 operands) is not included.
  int64_t workspace_bytes(const Batch& batch, AttentionPath path) const;
  // The same for a plan (a mixed plan: its largest segment's intermediates, the index arrays of
  // the batch and of every segment, and the whole batch's outputs).
  int64_t workspace_bytes(const Batch& batch, const Plan& plan) const;
  // (With LayerOptions::sparse_form kAuto, the sparse path's bytes are the larger of its two
  // forms'; a plan's are those of the form it chose.)

  // Validates everything (batch, page tables, input shapes) before the first write; then stores
  // the new tokens, plans and runs. A rejected call leaves both pools untouched.
  LayerResult forward(const Batch& batch, const LayerInputs& inputs);
  // The same, writing into the given outputs (LayerResult's tensors then view them).
  LayerResult forward(const Batch& batch, const LayerInputs& inputs, const LayerOutputs& outputs);

  // Validates and plans `batch` (as plan()) and uploads its index arrays, for forward() calls
  // that neither plan nor copy from the host (CUDA-graph capture and replay).
  PreparedBatch prepare(const Batch& batch) const;
  // forward() over a batch prepared by this layer: the plan and index arrays it holds.
  LayerResult forward(const PreparedBatch& batch, const LayerInputs& inputs,
                      const LayerOutputs& outputs = {});

 private:
  // The dense or the sparse path over the requests `bi` indexes (their new tokens are already
  // stored; `dev` is bi on the device); `in`, o, lse and topk hold exactly their rows. topk may
  // be empty for the dense path. forward() runs a mixed plan's segments through it one by one.
  // Checks the inputs, outputs and workspace of a call over `batch` planned as `plan`.
  void check_call(const Batch& batch, const Plan& plan, const LayerInputs& in,
                  const LayerOutputs& out) const;
  int64_t workspace_bytes(const Batch& batch, AttentionPath path, SparseForm form) const;
  // Stores the new tokens and runs the prepared plan into res (whose plan is set).
  LayerResult run(const PreparedBatch::State& state, const LayerInputs& in,
                  const LayerOutputs& out);
  // batch: the requests bi indexes (it decides the sparse path's staged rows); form: the plan's.
  void run_path(AttentionPath path, SparseForm form, const Batch& batch, const BatchIndex& bi,
                const detail::DeviceBatchIndex& dev, const LayerInputs& in, const TensorView& o,
                const TensorView& lse, const TensorView& topk,
                const std::function<void(const char*, const std::function<void()>&)>& stage);

  ModelConfig config_;
  Backend& backend_;
  PagedKvPool& kv_pool_;
  IndexKeyPool& index_pool_;
  TensorView kv_b_proj_;
  LayerOptions options_;
  double sm_scale_ = 0;
};

}  // namespace dsakit
