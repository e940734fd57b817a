// Rule mode of DESIGN.md §5: dense MHA iff all eight conditions hold; otherwise sparse MLA,
// naming the first condition that failed.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <sstream>

#include "dsakit/error.h"
#include "dsakit/plan.h"

namespace dsakit {

const char* to_string(AttentionPath path) {
  return path == AttentionPath::kDenseMha ? "dense_mha" : "sparse_mla";
}

const char* to_string(DispatchMode mode) {
  switch (mode) {
    case DispatchMode::kRule:
      return "rule";
    case DispatchMode::kCost:
      return "cost";
    case DispatchMode::kDense:
      return "dense";
    case DispatchMode::kSparse:
      return "sparse";
  }
  return "?";
}

DispatchMode parse_dispatch_mode(const std::string& name) {
  if (name == "rule") return DispatchMode::kRule;
  if (name == "cost") return DispatchMode::kCost;
  if (name == "dense") return DispatchMode::kDense;
  if (name == "sparse") return DispatchMode::kSparse;
  DSAKIT_FAIL(kInvalidArgument, "dispatch mode: expected rule, cost, dense or sparse, got '", name,
              "'");
}

DispatchPolicy DispatchPolicy::with_env() const {
  DispatchPolicy p = *this;
  if (const char* v = std::getenv("DSAKIT_DISPATCH"); v && *v) {
    try {
      p.mode = parse_dispatch_mode(v);
    } catch (const Error& e) {
      DSAKIT_FAIL(kInvalidArgument, "DSAKIT_DISPATCH: ", e.what());
    }
    p.overrides.push_back(std::string("DSAKIT_DISPATCH=") + v);
  }
  if (const char* v = std::getenv("DSAKIT_DENSE_KV_LEN_THRESHOLD"); v && *v) {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(v, &end, 10);
    DSAKIT_CHECK_ARG(errno == 0 && end && *end == 0 && n >= 0 && n <= INT32_MAX,
                     "DSAKIT_DENSE_KV_LEN_THRESHOLD: expected an integer in [0, 2^31), got '", v,
                     "'");
    p.threshold = n;
    p.overrides.push_back(std::string("DSAKIT_DENSE_KV_LEN_THRESHOLD=") + v);
  }
  return p;
}

namespace {

std::string suffix(const DispatchPolicy& policy) {
  if (policy.overrides.empty()) return "";
  std::string s = " [env:";
  for (const auto& o : policy.overrides) s += " " + o;
  return s + "]";
}

struct RuleCheck {
  int rule = 0;  // first failing rule, 0 if all pass
  std::string why;
};

// Whether the backend has a dense kernel for the model's head dims (empty list: any).
bool has_dense_instance(const Capabilities& caps, const ModelConfig& c) {
  if (caps.dense_head_dims.empty()) return true;
  const std::array<int, 3> dims{c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim};
  return std::find(caps.dense_head_dims.begin(), caps.dense_head_dims.end(), dims) !=
         caps.dense_head_dims.end();
}

// The eight conditions of §5 in order; the first one that fails decides.
RuleCheck check_rules(const Batch& b, const ModelConfig& c, KvLayout layout,
                      const Capabilities& caps, int64_t threshold, int64_t capacity) {
  std::ostringstream os;
  if (b.cuda_graph) return {1, "rule 1: CUDA graph capture/replay cannot branch on host lengths"};
  if (b.mode != ForwardMode::kExtend || b.speculative) {
    os << "rule 2: mode " << to_string(b.mode)
       << (b.speculative ? " with speculative decoding" : "") << " always uses sparse MLA";
    return {2, os.str()};
  }
  if (!caps.dense_mha) {
    os << "rule 3: no dense MHA path on " << caps.device_name;
    return {3, os.str()};
  }
  if (!has_dense_instance(caps, c)) {
    os << "rule 3: no dense MHA kernel for d_nope/d_rope/d_v = " << c.qk_nope_head_dim << "/"
       << c.qk_rope_head_dim << "/" << c.v_head_dim << " on " << caps.device_name;
    return {3, os.str()};
  }
  const int64_t max_len = b.max_kv_len();
  if (max_len > threshold) {
    os << "rule 4: max L_r = " << max_len << " > threshold " << threshold;
    return {4, os.str()};
  }
  if (layout != KvLayout::kBf16 && layout != KvLayout::kFp8Scaled && layout != KvLayout::kFp8Raw) {
    os << "rule 5: pool layout " << to_string(layout) << " has no dense gather";
    return {5, os.str()};
  }
  const int64_t total = b.total_kv_len();
  if (total > capacity) {
    os << "rule 6: sum L_r = " << total << " > chunk capacity " << capacity;
    return {6, os.str()};
  }
  if (b.context_parallel) return {7, "rule 7: prefill context parallelism is on"};
  if (b.hierarchical_sparse_cache)
    return {8, "rule 8: a host-offloaded sparse KV cache is attached"};
  os << "all 8 rules hold: max L_r = " << max_len << " <= threshold " << threshold
     << ", sum L_r = " << total << " <= " << capacity << ", " << to_string(layout) << " pool";
  return {0, os.str()};
}

}  // namespace

Plan plan_batch(const Batch& batch, const ModelConfig& config, KvLayout layout,
                const Capabilities& caps, const DispatchPolicy& policy) {
  const int64_t k = config.index_topk;
  const int64_t threshold = policy.threshold < 0 ? k : policy.threshold;
  DSAKIT_CHECK_ARG(threshold <= k || policy.allow_approximation, "dense threshold ", threshold,
                   " exceeds index_topk ", k,
                   ": dense MHA would attend to tokens the indexer drops (an approximation of the "
                   "model); opt in explicitly to allow it");
  DSAKIT_CHECK_ARG(policy.chunk_capacity >= 1, "chunk capacity: expected >= 1, got ",
                   policy.chunk_capacity);
  const int64_t max_len = batch.max_kv_len();

  Plan plan;
  plan.mode = policy.mode;
  std::ostringstream os;
  switch (policy.mode) {
    case DispatchMode::kSparse:
      plan.path = AttentionPath::kSparseMla;
      os << "forced sparse MLA (dispatch=sparse), max L_r = " << max_len;
      break;
    case DispatchMode::kDense: {
      DSAKIT_CHECK(
          caps.dense_mha && has_dense_instance(caps, config), kUnsupported,
          "dispatch=dense: no dense MHA kernel for d_nope/d_rope/d_v = ", config.qk_nope_head_dim,
          "/", config.qk_rope_head_dim, "/", config.v_head_dim, " on ", caps.device_name);
      DSAKIT_CHECK_ARG(max_len <= k || policy.allow_approximation,
                       "dispatch=dense: max L_r = ", max_len, " > index_topk ", k,
                       " makes dense an approximation of the model; opt in explicitly to allow it");
      plan.path = AttentionPath::kDenseMha;
      os << "forced dense MHA (dispatch=dense), max L_r = " << max_len;
      break;
    }
    case DispatchMode::kCost:
    case DispatchMode::kRule: {
      const RuleCheck c =
          check_rules(batch, config, layout, caps, threshold, policy.chunk_capacity);
      plan.rule = c.rule;
      plan.path = c.rule == 0 ? AttentionPath::kDenseMha : AttentionPath::kSparseMla;
      if (policy.mode == DispatchMode::kCost)
        os << "cost mode has no calibration profile, fell back to rule mode: ";
      os << (c.rule == 0 ? "dense MHA: " : "sparse MLA: ") << c.why;
      break;
    }
  }
  plan.approximate = plan.path == AttentionPath::kDenseMha && max_len > k;
  if (plan.approximate)
    os << " (APPROXIMATE: contexts longer than index_topk " << k << ", opted in)";
  plan.reason = os.str() + suffix(policy);
  return plan;
}

}  // namespace dsakit
