// The cost model: a batch's features, the terms each path is priced by, and a profile entry's
// prediction (linear model times the local correction from nearby calibration samples). The
// profile file is cost_profile.cc, the fit cost_fit.cc.
#include "dsakit/cost_model.h"

#include <algorithm>
#include <cmath>

#include "dsakit/error.h"
#include "dsakit/plan.h"

namespace dsakit {

CostFeatures CostFeatures::of(const Batch& b, const ModelConfig& c, int first, int count) {
  const int n = b.num_requests();
  if (count < 0) count = n - first;
  DSAKIT_CHECK_ARG(first >= 0 && count >= 0 && first + count <= n, "cost features: requests [",
                   first, ", ", first + count, ") outside a batch of ", n);
  CostFeatures f;
  f.requests = count;
  f.heads = c.num_heads;
  f.index_heads = c.index_n_heads;
  const double k = c.index_topk;
  for (int r = first; r < first + count; ++r) {
    const double p = b.prefix_lens[size_t(r)], e = b.extend_lens[size_t(r)];
    f.tokens += e;
    f.positions += p + e;
    // Σ_{i=1..e} (p + i) and Σ min(p + i, k), in closed form.
    f.ctx += e * p + e * (e + 1) / 2;
    const double below = std::clamp(k - p, 0.0, e);  // tokens with p + i <= k
    f.ctx_topk += below * p + below * (below + 1) / 2 + (e - below) * k;
  }
  return f;
}

CostTerm parse_cost_term(const std::string& name) {
  static const std::pair<const char*, CostTerm> table[] = {
      {"1", CostTerm::kOne},  {"R", CostTerm::kR},    {"T", CostTerm::kT},
      {"N", CostTerm::kN},    {"T*H", CostTerm::kTH}, {"N*H", CostTerm::kNH},
      {"C*H", CostTerm::kCH}, {"K*H", CostTerm::kKH}, {"C*Hi", CostTerm::kCHi}};
  for (const auto& [n, t] : table)
    if (name == n) return t;
  DSAKIT_FAIL(kInvalidArgument, "cost model: unknown term '", name, "'");
}

double CostFeatures::term(CostTerm t) const {
  switch (t) {
    case CostTerm::kOne:
      return calls;
    case CostTerm::kR:
      return requests;
    case CostTerm::kT:
      return tokens;
    case CostTerm::kN:
      return positions;
    case CostTerm::kTH:
      return tokens * heads;
    case CostTerm::kNH:
      return positions * heads;
    case CostTerm::kCH:
      return ctx * heads;
    case CostTerm::kKH:
      return ctx_topk * heads;
    case CostTerm::kCHi:
      return ctx * index_heads;
  }
  return 0;
}

double CostTerms::predict_ms(const CostFeatures& f) const {
  double ms = 0;
  if (ids.size() == names.size()) {
    for (size_t i = 0; i < ids.size(); ++i) ms += coef_ms[i] * f.term(ids[i]);
  } else {
    for (size_t i = 0; i < names.size(); ++i) ms += coef_ms[i] * f.term(names[i]);
  }
  return ms;
}

const std::vector<std::string>& cost_terms(AttentionPath path, SparseForm form) {
  // Dense: gather + K/V up-projection scale with positions, attention with Σ ctx.
  static const std::vector<std::string> dense = {"1", "R", "T", "N", "N*H", "C*H"};
  // Sparse: indexer over Σ ctx, top-k rows, projections per token, attention over k_eff.
  static const std::vector<std::string> sparse = {"1", "R", "T", "N", "T*H", "K*H", "C*Hi"};
  // Sparse as masked dense MHA: the dense path's terms and the indexer's.
  static const std::vector<std::string> masked = {"1", "R", "T", "N", "N*H", "C*H", "C*Hi"};
  if (path == AttentionPath::kDenseMha) return dense;
  return form == SparseForm::kMaskedMha ? masked : sparse;
}

const std::vector<std::string>& cost_stage_terms(const std::string& stage) {
  static const std::map<std::string, std::vector<std::string>> table = {
      {"store", {"1", "T"}},
      {"gather", {"1", "N"}},
      {"up_proj_kv", {"1", "N*H"}},
      {"dense_mha", {"1", "T*H", "C*H"}},
      {"indexer_topk", {"1", "T", "C*Hi"}},
      {"topk_to_locations", {"1", "T"}},
      {"absorb_q", {"1", "T*H"}},
      {"sparse_mla", {"1", "T*H", "K*H"}},
      {"up_proj_v", {"1", "T*H"}},
  };
  static const std::vector<std::string> fallback = {"1", "T", "N"};
  const auto it = table.find(stage);
  return it == table.end() ? fallback : it->second;
}

double CostEntry::linear_ms(AttentionPath path, const CostFeatures& f, SparseForm form) const {
  if (path == AttentionPath::kDenseMha) return dense.predict_ms(f);
  return (form == SparseForm::kMaskedMha && prices_masked() ? masked : sparse).predict_ms(f);
}

namespace {

double log2_at_least_1(double v) {
  return std::log2(std::max(v, 1.0));
}

}  // namespace

void CostEntry::prepare() {
  for (CostTerms* t : {&dense, &sparse, &masked}) {
    t->ids.clear();
    for (const auto& n : t->names) t->ids.push_back(parse_cost_term(n));
  }
  neighbors.clear();
  for (const CostSample& s : samples) {
    const double base = linear_ms(s.path, s.features, s.form);
    if (s.ms <= 0 || base <= 0) continue;
    if (s.form == SparseForm::kMaskedMha && !prices_masked()) continue;
    neighbors.push_back({s.path, s.form, log2_at_least_1(s.features.tokens),
                         log2_at_least_1(s.features.positions),
                         log2_at_least_1(s.features.requests), std::log(s.ms / base)});
  }
}

double CostEntry::predict_ms(AttentionPath path, const CostFeatures& f, SparseForm form) const {
  // The neighbours measured this path in this form (the dense path has one form: kMla's value).
  if (path == AttentionPath::kDenseMha || !prices_masked()) form = SparseForm::kMla;
  const double linear = linear_ms(path, f, form);
  if (linear <= 0 || neighbors.empty()) return linear;
  // Local correction in log space: Gaussian weights over the distance in octaves of tokens,
  // positions and requests; kShrink is the weight of "no correction" (a sample exactly one
  // sigma away gets ~12x that), so a batch far from every sample keeps the linear model.
  constexpr double kSigma = 0.5, kShrink = 0.05;
  const double lt = log2_at_least_1(f.tokens), ln = log2_at_least_1(f.positions),
               lr = log2_at_least_1(f.requests);
  double weight = 0, sum = 0;
  for (const Neighbor& s : neighbors) {
    if (s.path != path || s.form != form) continue;
    const double dt = lt - s.log2_tokens, dn = ln - s.log2_positions, dr = lr - s.log2_requests;
    const double d2 = dt * dt + dn * dn + dr * dr;
    if (d2 > 28 * kSigma * kSigma) continue;  // weight < 1e-6
    const double w = std::exp(-d2 / (2 * kSigma * kSigma));
    weight += w;
    sum += w * s.log_residual;
  }
  return linear * std::exp(sum / (weight + kShrink));
}

}  // namespace dsakit
