// Rule mode (docs/dispatch.md): dense MHA iff all eight conditions hold; otherwise sparse MLA,
// naming the first condition that failed.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <string>

#include <fmt/format.h>

#include "dsakit/error.h"
#include "dsakit/plan.h"

namespace dsakit {

const char* to_string(AttentionPath path) {
  switch (path) {
    case AttentionPath::kDenseMha:
      return "dense_mha";
    case AttentionPath::kSparseMla:
      return "sparse_mla";
    case AttentionPath::kMixed:
      return "mixed";
  }
  return "?";
}

bool dense_mha_available(const Capabilities& caps, const ModelConfig& c) {
  if (!caps.dense_mha) return false;
  if (caps.dense_head_dims.empty()) return true;  // any head dims (the CPU backend)
  const std::array<int, 3> dims{c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim};
  return std::find(caps.dense_head_dims.begin(), caps.dense_head_dims.end(), dims) !=
         caps.dense_head_dims.end();
}

AttentionPath Plan::path_of(int request) const {
  for (const auto& s : segments)
    if (request >= s.first_request && request < s.first_request + s.num_requests) return s.path;
  return path;
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
  if (const char* v = std::getenv("DSAKIT_PROFILE"); v && *v) {
    if (p.profile_path != v) {
      try {
        p = p.with_profile(v);
      } catch (const Error& e) {
        DSAKIT_FAIL(kInvalidArgument, "DSAKIT_PROFILE: ", e.what());
      }
    }
    p.overrides.push_back(std::string("DSAKIT_PROFILE=") + v);
  }
  return p;
}

DispatchPolicy DispatchPolicy::with_profile(const std::string& path) const {
  DispatchPolicy p = *this;
  p.profile = std::make_shared<const CostProfile>(CostProfile::load(path));
  p.profile_path = path;
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

// The eight conditions of rule mode (docs/dispatch.md), in order; the first that fails decides.
// `why` is filled only when asked (cost mode calls this on every plan and needs the rule alone).
RuleCheck check_rules(const Batch& b, const ModelConfig& c, KvLayout layout,
                      const Capabilities& caps, int64_t threshold, int64_t capacity,
                      bool explain = true) {
  auto fail = [&]<typename... Args>(int rule, fmt::format_string<Args...> what, Args&&... args) {
    RuleCheck r{rule, {}};
    if (explain) r.why = fmt::format(what, std::forward<Args>(args)...);
    return r;
  };
  if (b.cuda_graph)
    return fail(1, "rule 1: CUDA graph capture/replay cannot branch on host lengths");
  if (b.mode != ForwardMode::kExtend || b.speculative)
    return fail(2, "rule 2: mode {}{} always uses sparse MLA", to_string(b.mode),
                b.speculative ? " with speculative decoding" : "");
  if (!caps.dense_mha) return fail(3, "rule 3: no dense MHA path on {}", caps.device_name);
  if (!dense_mha_available(caps, c))
    return fail(3, "rule 3: no dense MHA kernel for d_nope/d_rope/d_v = {}/{}/{} on {}",
                c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, caps.device_name);
  const int64_t max_len = b.max_kv_len();
  if (max_len > threshold)
    return fail(4, "rule 4: max L_r = {} > threshold {}", max_len, threshold);
  if (layout != KvLayout::kBf16 && layout != KvLayout::kFp8Scaled && layout != KvLayout::kFp8Raw)
    return fail(5, "rule 5: pool layout {} has no dense gather", to_string(layout));
  const int64_t total = b.total_kv_len();
  if (total > capacity) return fail(6, "rule 6: sum L_r = {} > chunk capacity {}", total, capacity);
  if (b.context_parallel) return fail(7, "rule 7: prefill context parallelism is on");
  if (b.hierarchical_sparse_cache)
    return fail(8, "rule 8: a host-offloaded sparse KV cache is attached");
  return fail(0, "all 8 rules hold: max L_r = {} <= threshold {}, sum L_r = {} <= {}, {} pool",
              max_len, threshold, total, capacity, to_string(layout));
}

std::string fmt_ms(double ms) {
  return ms < 1 ? fmt::format("{:.3f} ms", ms) : fmt::format("{:.2f} ms", ms);
}

// Cost mode with a profile: the engine-state rules (1-3, 5, 7, 8) still decide whether dense is
// possible at all; among the exact choices (requests with L_r <= threshold, dense runs within
// the chunk capacity) the cheapest predicted plan wins: the whole batch dense, the whole batch
// sparse, or runs of requests each on its cheaper path.
Plan plan_by_cost(const Batch& b, const ModelConfig& c, KvLayout layout, const Capabilities& caps,
                  const DispatchPolicy& policy, int64_t threshold) {
  DSAKIT_CHECK_ARG(policy.min_split_gain >= 0 && policy.min_split_gain < 1,
                   "min_split_gain: expected a fraction in [0, 1), got ", policy.min_split_gain);
  const CostEntry& entry = policy.profile->find(CostKey::of(caps.device_name, c, layout));
  Plan plan;
  plan.mode = DispatchMode::kCost;
  const int n = b.num_requests();
  auto cost = [&](AttentionPath p, int first, int count) {
    return entry.predict_ms(p, CostFeatures::of(b, c, first, count));
  };
  plan.predicted_sparse_ms = cost(AttentionPath::kSparseMla, 0, n);
  const RuleCheck state = check_rules(b, c, layout, caps, INT64_MAX, INT64_MAX, /*explain=*/false);
  if (state.rule != 0) {
    plan.rule = state.rule;
    plan.path = AttentionPath::kSparseMla;
    plan.predicted_ms = plan.predicted_sparse_ms;
    plan.reason =
        "cost mode: sparse MLA: " + check_rules(b, c, layout, caps, INT64_MAX, INT64_MAX).why;
    return plan;
  }
  auto len = [&](int r) { return int64_t(b.prefix_lens[size_t(r)]) + b.extend_lens[size_t(r)]; };
  auto dense_ok = [&](int first, int count) {
    int64_t total = 0;
    for (int r = first; r < first + count; ++r) {
      if (len(r) > threshold) return false;
      total += len(r);
    }
    return total <= policy.chunk_capacity;
  };
  if (dense_ok(0, n)) plan.predicted_dense_ms = cost(AttentionPath::kDenseMha, 0, n);

  // Runs: each request on its cheaper allowed path alone, consecutive equal paths merged.
  std::vector<PlanSegment> runs;
  double runs_ms = 0;
  if (policy.allow_split && n > 1) {
    for (int r = 0; r < n; ++r) {
      AttentionPath p = AttentionPath::kSparseMla;
      if (len(r) <= threshold &&
          cost(AttentionPath::kDenseMha, r, 1) < cost(AttentionPath::kSparseMla, r, 1))
        p = AttentionPath::kDenseMha;
      if (!runs.empty() && runs.back().path == p)
        ++runs.back().num_requests;
      else
        runs.push_back({r, 1, p});
    }
    for (const auto& s : runs) {
      if (s.path == AttentionPath::kDenseMha && !dense_ok(s.first_request, s.num_requests)) {
        runs.clear();  // a dense run over the chunk capacity: no split
        break;
      }
      runs_ms += cost(s.path, s.first_request, s.num_requests);
    }
    if (runs.size() < 2) runs.clear();
  }

  const bool dense =
      plan.predicted_dense_ms >= 0 && plan.predicted_dense_ms <= plan.predicted_sparse_ms;
  const double whole = dense ? plan.predicted_dense_ms : plan.predicted_sparse_ms;
  std::string& why = plan.reason;
  auto out = std::back_inserter(why);
  why = "cost mode: ";
  if (!runs.empty() && runs_ms < whole * (1 - policy.min_split_gain)) {
    plan.path = AttentionPath::kMixed;
    plan.segments = runs;
    plan.predicted_ms = runs_ms;
    fmt::format_to(out, "split into {} runs (", runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto& s = runs[i];
      fmt::format_to(out, "{}{} r{}", i ? ", " : "",
                     s.path == AttentionPath::kDenseMha ? "dense" : "sparse", s.first_request);
      if (s.num_requests > 1) fmt::format_to(out, "-{}", s.first_request + s.num_requests - 1);
    }
    fmt::format_to(out, ") predicted {} < whole batch ", fmt_ms(runs_ms));
  } else {
    plan.path = dense ? AttentionPath::kDenseMha : AttentionPath::kSparseMla;
    plan.predicted_ms = whole;
    if (!runs.empty() && runs_ms < whole)
      fmt::format_to(out, "a split into {} runs predicted {} saves less than {:g}%; ", runs.size(),
                     fmt_ms(runs_ms), 100 * policy.min_split_gain);
    why += dense ? "dense MHA predicted " : "sparse MLA predicted ";
  }
  fmt::format_to(out, "dense {}, sparse {}",
                 plan.predicted_dense_ms >= 0 ? fmt_ms(plan.predicted_dense_ms) : "not exact",
                 fmt_ms(plan.predicted_sparse_ms));
  if (plan.predicted_dense_ms < 0) {
    const int32_t max_len = b.max_kv_len();
    if (max_len > threshold)
      fmt::format_to(out, " (max L_r = {} > {})", max_len, threshold);
    else
      fmt::format_to(out, " (sum L_r = {} > chunk capacity {})", b.total_kv_len(),
                     policy.chunk_capacity);
  }
  fmt::format_to(out, "; profile {} {} H={} {}", entry.key.device, entry.key.model, entry.key.heads,
                 entry.key.layout);
  return plan;
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
  std::string why;
  switch (policy.mode) {
    case DispatchMode::kSparse:
      plan.path = AttentionPath::kSparseMla;
      why = fmt::format("forced sparse MLA (dispatch=sparse), max L_r = {}", max_len);
      break;
    case DispatchMode::kDense: {
      DSAKIT_CHECK(
          dense_mha_available(caps, config), kUnsupported,
          "dispatch=dense: no dense MHA kernel for d_nope/d_rope/d_v = ", config.qk_nope_head_dim,
          "/", config.qk_rope_head_dim, "/", config.v_head_dim, " on ", caps.device_name);
      DSAKIT_CHECK_ARG(max_len <= k || policy.allow_approximation,
                       "dispatch=dense: max L_r = ", max_len, " > index_topk ", k,
                       " makes dense an approximation of the model; opt in explicitly to allow it");
      plan.path = AttentionPath::kDenseMha;
      why = fmt::format("forced dense MHA (dispatch=dense), max L_r = {}", max_len);
      break;
    }
    case DispatchMode::kCost:
      if (policy.profile) {
        plan = plan_by_cost(batch, config, layout, caps, policy, threshold);
        why = std::move(plan.reason);
        break;
      }
      [[fallthrough]];
    case DispatchMode::kRule: {
      const RuleCheck c =
          check_rules(batch, config, layout, caps, threshold, policy.chunk_capacity);
      plan.rule = c.rule;
      plan.path = c.rule == 0 ? AttentionPath::kDenseMha : AttentionPath::kSparseMla;
      if (policy.mode == DispatchMode::kCost)
        why = "cost mode has no calibration profile, fell back to rule mode: ";
      why += c.rule == 0 ? "dense MHA: " : "sparse MLA: ";
      why += c.why;
      break;
    }
  }
  if (plan.segments.empty()) plan.segments.push_back({0, batch.num_requests(), plan.path});
  plan.approximate = false;
  for (const auto& seg : plan.segments)
    if (seg.path == AttentionPath::kDenseMha)
      for (int r = seg.first_request; r < seg.first_request + seg.num_requests; ++r)
        plan.approximate |= batch.prefix_lens[size_t(r)] + batch.extend_lens[size_t(r)] > k;
  if (plan.approximate)
    fmt::format_to(std::back_inserter(why),
                   " (APPROXIMATE: contexts longer than index_topk {}, opted in)", k);
  why += suffix(policy);
  plan.reason = std::move(why);
  return plan;
}

}  // namespace dsakit
