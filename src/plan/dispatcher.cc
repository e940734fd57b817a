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

const char* to_string(SparseForm form) {
  switch (form) {
    case SparseForm::kMla:
      return "mla";
    case SparseForm::kMaskedMha:
      return "masked-mha";
    case SparseForm::kAuto:
      return "auto";
  }
  return "?";
}

SparseForm parse_sparse_form(const std::string& s) {
  for (SparseForm f : {SparseForm::kMla, SparseForm::kMaskedMha, SparseForm::kAuto})
    if (s == to_string(f)) return f;
  DSAKIT_FAIL(kInvalidArgument, "sparse form: expected 'auto', 'mla' or 'masked-mha', got '", s,
              "'");
}

bool masked_mha_available(const Capabilities& caps, const ModelConfig& c) {
  return caps.dense_kv_mask && dense_mha_available(caps, c);
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
// sparse, or runs of requests each on its cheaper path. Under SparseForm::kAuto that choice is
// made once per form the sparse path may take (MLA; masked MHA where the profile prices it, the
// engine state allows dense work and Σ L_r fits the chunk capacity), and the cheaper plan wins.
Plan plan_by_cost(const Batch& b, const ModelConfig& c, KvLayout layout, const Capabilities& caps,
                  const DispatchPolicy& policy, int64_t threshold, SparseForm form_option) {
  DSAKIT_CHECK_ARG(policy.min_split_gain >= 0 && policy.min_split_gain < 1,
                   "min_split_gain: expected a fraction in [0, 1), got ", policy.min_split_gain);
  const CostEntry& entry = policy.profile->find(CostKey::of(caps.device_name, c, layout));
  Plan plan;
  plan.mode = DispatchMode::kCost;
  const int n = b.num_requests();
  auto cost = [&](AttentionPath p, SparseForm f, int first, int count) {
    return entry.predict_ms(p, CostFeatures::of(b, c, first, count), f);
  };
  auto len = [&](int r) { return int64_t(b.prefix_lens[size_t(r)]) + b.extend_lens[size_t(r)]; };
  auto positions = [&](int first, int count) {
    int64_t total = 0;
    for (int r = first; r < first + count; ++r) total += len(r);
    return total;
  };
  const RuleCheck state = check_rules(b, c, layout, caps, INT64_MAX, INT64_MAX, /*explain=*/false);
  const bool masked_fixed = form_option == SparseForm::kMaskedMha;
  const bool may_mask =
      masked_fixed || (form_option == SparseForm::kAuto && state.rule == 0 &&
                       entry.prices_masked() && positions(0, n) <= policy.chunk_capacity);
  if (!masked_fixed)
    plan.predicted_sparse_ms = cost(AttentionPath::kSparseMla, SparseForm::kMla, 0, n);
  if (may_mask)
    plan.predicted_masked_ms = cost(AttentionPath::kSparseMla, SparseForm::kMaskedMha, 0, n);
  std::string& why = plan.reason;
  auto out = std::back_inserter(why);
  if (state.rule != 0) {
    plan.rule = state.rule;
    plan.path = AttentionPath::kSparseMla;
    plan.sparse_form = masked_fixed ? SparseForm::kMaskedMha : SparseForm::kMla;
    plan.predicted_ms = masked_fixed ? plan.predicted_masked_ms : plan.predicted_sparse_ms;
    why = fmt::format("cost mode: sparse {}: {}", masked_fixed ? "masked-MHA" : "MLA",
                      check_rules(b, c, layout, caps, INT64_MAX, INT64_MAX).why);
    return plan;
  }
  auto dense_ok = [&](int first, int count) {
    for (int r = first; r < first + count; ++r)
      if (len(r) > threshold) return false;
    return positions(first, count) <= policy.chunk_capacity;
  };
  if (dense_ok(0, n))
    plan.predicted_dense_ms = cost(AttentionPath::kDenseMha, SparseForm::kMla, 0, n);

  // One candidate plan per form the sparse path may take.
  struct Candidate {
    SparseForm form;
    double sparse_ms;
    std::vector<PlanSegment> runs;  // a split, or empty
    double runs_ms = 0, best_ms = 0;
    bool split = false;  // the runs are the plan
    bool dense = false;  // else: the whole batch dense (or sparse)
  };
  std::vector<Candidate> candidates;
  for (SparseForm f : {SparseForm::kMla, SparseForm::kMaskedMha}) {
    const double sparse_ms =
        f == SparseForm::kMla ? plan.predicted_sparse_ms : plan.predicted_masked_ms;
    if (sparse_ms < 0) continue;
    Candidate cand{f, sparse_ms, {}};
    // Runs: each request on its cheaper allowed path alone, consecutive equal paths merged.
    if (policy.allow_split && n > 1) {
      for (int r = 0; r < n; ++r) {
        AttentionPath p = AttentionPath::kSparseMla;
        if (len(r) <= threshold && cost(AttentionPath::kDenseMha, SparseForm::kMla, r, 1) <
                                       cost(AttentionPath::kSparseMla, f, r, 1))
          p = AttentionPath::kDenseMha;
        if (!cand.runs.empty() && cand.runs.back().path == p)
          ++cand.runs.back().num_requests;
        else
          cand.runs.push_back({r, 1, p});
      }
      for (const auto& s : cand.runs) {
        if (s.path == AttentionPath::kDenseMha && !dense_ok(s.first_request, s.num_requests)) {
          cand.runs.clear();  // a dense run over the chunk capacity: no split
          break;
        }
        cand.runs_ms += cost(s.path, f, s.first_request, s.num_requests);
      }
      if (cand.runs.size() < 2) cand.runs.clear();
    }
    cand.dense = plan.predicted_dense_ms >= 0 && plan.predicted_dense_ms <= sparse_ms;
    const double whole = cand.dense ? plan.predicted_dense_ms : sparse_ms;
    cand.best_ms = whole;
    cand.split = !cand.runs.empty() && cand.runs_ms < whole * (1 - policy.min_split_gain);
    if (cand.split) cand.best_ms = cand.runs_ms;
    candidates.push_back(std::move(cand));
  }
  const Candidate& best = *std::min_element(
      candidates.begin(), candidates.end(),
      [](const Candidate& x, const Candidate& y) { return x.best_ms < y.best_ms; });
  plan.sparse_form = best.form;
  const bool masked = best.form == SparseForm::kMaskedMha;
  const double whole = best.dense ? plan.predicted_dense_ms : best.sparse_ms;
  why = "cost mode: ";
  if (best.split) {
    plan.path = AttentionPath::kMixed;
    plan.segments = best.runs;
    plan.predicted_ms = best.runs_ms;
    fmt::format_to(out, "split into {} runs (", best.runs.size());
    for (size_t i = 0; i < best.runs.size(); ++i) {
      const auto& s = best.runs[i];
      fmt::format_to(out, "{}{} r{}", i ? ", " : "",
                     s.path == AttentionPath::kDenseMha ? "dense"
                     : masked                           ? "masked-mha"
                                                        : "sparse",
                     s.first_request);
      if (s.num_requests > 1) fmt::format_to(out, "-{}", s.first_request + s.num_requests - 1);
    }
    fmt::format_to(out, ") predicted {} < whole batch ", fmt_ms(best.runs_ms));
  } else {
    plan.path = best.dense ? AttentionPath::kDenseMha : AttentionPath::kSparseMla;
    plan.predicted_ms = whole;
    if (!best.runs.empty() && best.runs_ms < whole)
      fmt::format_to(out, "a split into {} runs predicted {} saves less than {:g}%; ",
                     best.runs.size(), fmt_ms(best.runs_ms), 100 * policy.min_split_gain);
    why += best.dense ? "dense MHA predicted "
           : masked   ? "sparse masked-MHA predicted "
                      : "sparse MLA predicted ";
  }
  fmt::format_to(out, "dense {}",
                 plan.predicted_dense_ms >= 0 ? fmt_ms(plan.predicted_dense_ms) : "not exact");
  if (plan.predicted_dense_ms < 0) {
    const int32_t max_len = b.max_kv_len();
    if (max_len > threshold)
      fmt::format_to(out, " (max L_r = {} > {})", max_len, threshold);
    else
      fmt::format_to(out, " (sum L_r = {} > chunk capacity {})", b.total_kv_len(),
                     policy.chunk_capacity);
  }
  if (plan.predicted_sparse_ms >= 0)
    fmt::format_to(out, ", sparse {}", fmt_ms(plan.predicted_sparse_ms));
  if (plan.predicted_masked_ms >= 0)
    fmt::format_to(out, ", masked-mha {}", fmt_ms(plan.predicted_masked_ms));
  fmt::format_to(out, "; profile {} {} H={} {}", entry.key.device, entry.key.model, entry.key.heads,
                 entry.key.layout);
  return plan;
}
}  // namespace

Plan plan_batch(const Batch& batch, const ModelConfig& config, KvLayout layout,
                const Capabilities& caps, const DispatchPolicy& policy, SparseForm form) {
  if (form == SparseForm::kAuto && !masked_mha_available(caps, config)) form = SparseForm::kMla;
  DSAKIT_CHECK(form != SparseForm::kMaskedMha || masked_mha_available(caps, config), kUnsupported,
               "sparse form masked-mha: ", caps.device_name,
               " has no dense MHA kernel with a kv mask for d_nope/d_rope/d_v = ",
               config.qk_nope_head_dim, "/", config.qk_rope_head_dim, "/", config.v_head_dim);
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
        plan = plan_by_cost(batch, config, layout, caps, policy, threshold, form);
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
  if (plan.mode != DispatchMode::kCost || !policy.profile)
    plan.sparse_form = form == SparseForm::kMaskedMha ? SparseForm::kMaskedMha : SparseForm::kMla;
  if (plan.segments.empty()) plan.segments.push_back({0, batch.num_requests(), plan.path});
  plan.approximate = false;
  for (const auto& seg : plan.segments)
    if (seg.path == AttentionPath::kDenseMha)
      for (int r = seg.first_request; r < seg.first_request + seg.num_requests; ++r)
        plan.approximate |= batch.prefix_lens[size_t(r)] + batch.extend_lens[size_t(r)] > k;
  if (plan.approximate)
    fmt::format_to(std::back_inserter(why),
                   " (APPROXIMATE: contexts longer than index_topk {}, opted in)", k);
  if (plan.sparse_form == SparseForm::kMaskedMha &&
      !(plan.mode == DispatchMode::kCost && policy.profile) &&
      plan.path != AttentionPath::kDenseMha)
    why += " (sparse form masked-mha)";
  why += suffix(policy);
  plan.reason = std::move(why);
  return plan;
}

}  // namespace dsakit
