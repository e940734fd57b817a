// The dispatcher (DESIGN.md §5): for a batch, choose dense MHA or sparse MLA and say why.
// The planner knows no kernel: it reads the batch, the pool layout, the model config and the
// backend's Capabilities only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/pool.h"

namespace dsakit {

enum class AttentionPath : uint8_t { kDenseMha, kSparseMla };
const char* to_string(AttentionPath path);  // "dense_mha" | "sparse_mla"

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

  // Applies DSAKIT_DISPATCH and DSAKIT_DENSE_KV_LEN_THRESHOLD from the environment (validated:
  // a malformed value throws Error(kInvalidArgument) naming the variable).
  DispatchPolicy with_env() const;
};

struct Plan {
  AttentionPath path = AttentionPath::kSparseMla;
  DispatchMode mode = DispatchMode::kRule;
  int rule = 0;              // the deciding rule of §5 (1-8), 0 when forced or all passed
  bool approximate = false;  // dense over contexts longer than index_topk (opt-in)
  std::string reason;        // one line naming the deciding rule and its numbers
};

// Throws Error(kInvalidArgument) for a policy that cannot be honoured (e.g. a threshold above
// index_topk without allow_approximation, forced dense on a backend without a dense path).
Plan plan_batch(const Batch& batch, const ModelConfig& config, KvLayout layout,
                const Capabilities& caps, const DispatchPolicy& policy);

}  // namespace dsakit
