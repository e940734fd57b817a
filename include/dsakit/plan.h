// The dispatcher (docs/dispatch.md): for a batch, choose dense MHA or sparse MLA and say why.
// The planner knows no kernel: it reads the batch, the pool layout, the model config and the
// backend's Capabilities only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/cost_model.h"
#include "dsakit/pool.h"

namespace dsakit {

// kMixed: cost mode split the batch into runs of requests, each through its own path
// (Plan::segments).
enum class AttentionPath : uint8_t { kDenseMha, kSparseMla, kMixed };
const char* to_string(AttentionPath path);  // "dense_mha" | "sparse_mla" | "mixed"

enum class DispatchMode : uint8_t {
  kRule,    // the engines' eight-condition rule (default)
  kCost,    // per-device cost model (needs a calibration profile; falls back to rule)
  kDense,   // forced dense MHA (still refused where it would be wrong or impossible)
  kSparse,  // forced sparse MLA
};
const char* to_string(DispatchMode mode);
DispatchMode parse_dispatch_mode(const std::string& name);  // rule | cost | dense | sparse

struct DispatchPolicy {
  DispatchMode mode = DispatchMode::kRule;
  int64_t threshold = -1;  // max L_r for dense; -1: index_topk
  bool allow_approximation =
      false;                        // permit dense with L_r > index_topk (not the model's function)
  int64_t chunk_capacity = 131072;  // max Σ L_r the dense path may materialize
  std::vector<std::string> overrides;  // environment overrides applied (echoed in the reason)
  // Cost mode's calibration (dsakit calibrate); null: cost mode falls back to rule mode.
  std::shared_ptr<const CostProfile> profile;
  std::string profile_path;  // file `profile` was read from, if any
  bool allow_split = true;   // cost mode may run a batch as dense and sparse sub-batches
  // ... when the split is predicted at least this fraction cheaper than the best whole path:
  // each run pays index handling and launches the profile does not model (docs/dispatch.md,
  // cost mode, has the measurements behind the default). In [0, 1).
  double min_split_gain = 0.05;

  // Applies DSAKIT_DISPATCH, DSAKIT_DENSE_KV_LEN_THRESHOLD and DSAKIT_PROFILE from the
  // environment (validated: a malformed value or an unreadable/stale profile throws
  // Error(kInvalidArgument) naming the variable). The profile is read once per path: a policy
  // already holding the file named by DSAKIT_PROFILE keeps it.
  DispatchPolicy with_env() const;
  // Reads the profile at `path` into the policy (throws like CostProfile::load).
  DispatchPolicy with_profile(const std::string& path) const;
};

// How the sparse path attends to the indexer's top-k (docs/layer.md#masked-mha): the same
// function either way (attention of each query over its selected positions).
enum class SparseForm : uint8_t {
  kMla,        // absorbed MLA over the selected pool rows (sparse_mla): work ∝ Σ_t min(ctx_t, k)
  kMaskedMha,  // the top-k as dense_mha's kv_mask over the up-projected K/V of every context row:
               // causal work (∝ Σ_t ctx_t) at dense MHA's cheaper per-pair cost; backends with
               // masked_mha_available()
  kAuto,       // (an option, never a plan's form) cost mode picks the form per batch where its
               // profile prices both and the backend has the masked kernel; kMla otherwise
};
// cost_model.h defaults its SparseForm parameters to SparseForm{}: the MLA form.
static_assert(SparseForm{} == SparseForm::kMla);
const char* to_string(SparseForm form);              // "mla" | "masked-mha" | "auto"
SparseForm parse_sparse_form(const std::string& s);  // throws naming the accepted names

// A run of consecutive requests that takes one path.
struct PlanSegment {
  int first_request = 0;
  int num_requests = 0;
  AttentionPath path = AttentionPath::kSparseMla;
};

struct Plan {
  AttentionPath path = AttentionPath::kSparseMla;
  DispatchMode mode = DispatchMode::kRule;
  int rule = 0;  // the deciding rule (1-8, docs/dispatch.md), 0 when forced or all passed
  bool approximate = false;  // dense over contexts longer than index_topk (opt-in)
  std::string reason;        // one line naming the deciding rule and its numbers
  // Runs of requests in batch order with their paths: one segment covering the batch unless
  // path == kMixed.
  std::vector<PlanSegment> segments;
  // The form the plan's sparse segments take (kMla or kMaskedMha; the layer's option unless it
  // is kAuto, which cost mode resolves).
  SparseForm sparse_form = SparseForm::kMla;
  // Cost mode with a profile: predicted ms of the whole batch through each path (-1: that path
  // is not allowed), the sparse path in the MLA form and, where the profile prices it and the
  // form may be taken, in the masked-MHA form; and of the chosen plan.
  double predicted_dense_ms = -1, predicted_sparse_ms = -1, predicted_masked_ms = -1,
         predicted_ms = -1;

  AttentionPath path_of(int request) const;  // the path request `request` takes
};

// Whether `caps` has a dense MHA kernel for the model's head dims (rule 3).
bool dense_mha_available(const Capabilities& caps, const ModelConfig& config);

// Whether `caps` can run the sparse path in the masked-MHA form for the model's head dims
// (Capabilities::dense_kv_mask and a dense kernel for them).
bool masked_mha_available(const Capabilities& caps, const ModelConfig& config);

// Throws Error(kInvalidArgument) for a policy that cannot be honoured (e.g. a threshold above
// index_topk without allow_approximation, forced dense on a backend without a dense path).
// `form` is the layer's LayerOptions::sparse_form: a fixed form is the plan's (kMaskedMha where
// masked_mha_available is false: Error(kUnsupported)); kAuto lets cost mode with a profile that
// prices the masked form choose, among batches whose Σ L_r fits the chunk capacity (the form
// materializes K/V of every position, as the dense path does), and is kMla otherwise.
Plan plan_batch(const Batch& batch, const ModelConfig& config, KvLayout layout,
                const Capabilities& caps, const DispatchPolicy& policy,
                SparseForm form = SparseForm::kMla);

}  // namespace dsakit
