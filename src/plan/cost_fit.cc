// The cost-model fit: non-negative least squares on relative error, from calibration samples to
// the coefficients of each path's terms (and of each stage's).
#include "dsakit/cost_model.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "dsakit/error.h"
#include "dsakit/plan.h"

namespace dsakit {

namespace {

// Least squares min ‖A x − b‖ over the columns in `cols` (normal equations, columns scaled to
// unit norm, Gaussian elimination with partial pivoting). Returns false when singular.
bool solve_subset(const std::vector<std::vector<double>>& a, const std::vector<double>& b,
                  const std::vector<int>& cols, std::vector<double>& x) {
  const size_t m = b.size(), n = cols.size();
  std::vector<double> scale(n, 0);
  for (size_t j = 0; j < n; ++j) {
    for (size_t i = 0; i < m; ++i) scale[j] += a[i][size_t(cols[j])] * a[i][size_t(cols[j])];
    scale[j] = std::sqrt(scale[j]);
    if (scale[j] == 0) return false;
  }
  std::vector<std::vector<double>> g(n, std::vector<double>(n + 1, 0));
  for (size_t i = 0; i < m; ++i)
    for (size_t p = 0; p < n; ++p) {
      const double ap = a[i][size_t(cols[p])] / scale[p];
      for (size_t q = 0; q < n; ++q) g[p][q] += ap * a[i][size_t(cols[q])] / scale[q];
      g[p][n] += ap * b[i];
    }
  for (size_t p = 0; p < n; ++p) {
    size_t piv = p;
    for (size_t r = p + 1; r < n; ++r)
      if (std::abs(g[r][p]) > std::abs(g[piv][p])) piv = r;
    if (std::abs(g[piv][p]) < 1e-12) return false;
    std::swap(g[p], g[piv]);
    for (size_t r = 0; r < n; ++r) {
      if (r == p) continue;
      const double f = g[r][p] / g[p][p];
      for (size_t q = p; q <= n; ++q) g[r][q] -= f * g[p][q];
    }
  }
  x.assign(n, 0);
  for (size_t p = 0; p < n; ++p) x[p] = g[p][n] / g[p][p] / scale[p];
  return true;
}

}  // namespace

CostTerms fit_cost_terms(const std::vector<std::string>& terms,
                         const std::vector<CostFeatures>& features, const std::vector<double>& ms) {
  DSAKIT_CHECK_ARG(features.size() == ms.size() && !ms.empty(),
                   "cost fit: expected one time per sample, got ", features.size(), " samples and ",
                   ms.size(), " times");
  DSAKIT_CHECK_ARG(terms.size() <= 12, "cost fit: at most 12 terms, got ", terms.size());
  for (double t : ms)
    DSAKIT_CHECK_ARG(std::isfinite(t) && t > 0, "cost fit: times must be finite and > 0, got ", t);
  // Relative error: row i of A and b divided by ms[i].
  const size_t m = ms.size(), n = terms.size();
  std::vector<std::vector<double>> a(m, std::vector<double>(n));
  std::vector<double> b(m, 1.0);
  for (size_t i = 0; i < m; ++i)
    for (size_t j = 0; j < n; ++j) a[i][j] = features[i].term(terms[j]) / ms[i];
  // Non-negative least squares by exhaustive active sets: every subset of columns, solved
  // unconstrained, kept when all its coefficients are >= 0; the best residual wins. Exact for
  // the handful of terms a path has (2^n subsets).
  CostTerms best;
  best.names = terms;
  for (const auto& name : terms) best.ids.push_back(parse_cost_term(name));
  best.coef_ms.assign(n, 0);
  double best_res = double(m);  // all-zero model: every relative error is 1
  for (uint32_t mask = 1; mask < (1u << n); ++mask) {
    std::vector<int> cols;
    for (size_t j = 0; j < n; ++j)
      if (mask & (1u << j)) cols.push_back(int(j));
    if (cols.size() > m) continue;
    std::vector<double> x;
    if (!solve_subset(a, b, cols, x)) continue;
    if (std::any_of(x.begin(), x.end(), [](double v) { return v < 0; })) continue;
    double res = 0;
    for (size_t i = 0; i < m; ++i) {
      double p = 0;
      for (size_t q = 0; q < cols.size(); ++q) p += a[i][size_t(cols[q])] * x[q];
      res += (p - 1) * (p - 1);
    }
    if (res < best_res) {
      best_res = res;
      std::fill(best.coef_ms.begin(), best.coef_ms.end(), 0.0);
      for (size_t q = 0; q < cols.size(); ++q) best.coef_ms[size_t(cols[q])] = x[q];
    }
  }
  for (size_t i = 0; i < m; ++i)
    best.max_rel_error =
        std::max(best.max_rel_error, std::abs(best.predict_ms(features[i]) / ms[i] - 1));
  return best;
}

CostEntry fit_cost_entry(const CostKey& key, const std::vector<CostSample>& samples) {
  CostEntry e;
  e.key = key;
  for (const CostSample& smp : samples)
    e.samples.push_back({smp.path, smp.features, smp.ms, {}, smp.form});
  std::map<std::string, std::pair<std::vector<CostFeatures>, std::vector<double>>> stage_data;
  const std::pair<AttentionPath, SparseForm> fits[] = {
      {AttentionPath::kDenseMha, SparseForm::kMla},
      {AttentionPath::kSparseMla, SparseForm::kMla},
      {AttentionPath::kSparseMla, SparseForm::kMaskedMha}};
  for (const auto& [path, form] : fits) {
    const bool masked = form == SparseForm::kMaskedMha;
    std::vector<CostFeatures> f;
    std::vector<double> t;
    for (const auto& s : samples) {
      if (s.path != path || (path == AttentionPath::kSparseMla && s.form != form)) continue;
      f.push_back(s.features);
      t.push_back(s.ms);
      if (masked) continue;  // its dense_mha stage is another kernel's: not in the stage fits
      for (const auto& [stage, ms] : s.stage_ms) {
        if (ms <= 0) continue;
        stage_data[stage].first.push_back(s.features);
        stage_data[stage].second.push_back(ms);
      }
    }
    const auto& terms = cost_terms(path, form);
    if (masked && t.empty()) continue;  // the form was not calibrated
    DSAKIT_CHECK_ARG(t.size() >= terms.size(), "cost fit: ", t.size(), " ", to_string(path),
                     masked ? " (masked-mha)" : "", " samples for ", terms.size(),
                     " terms; calibrate over more shapes");
    CostTerms fit = fit_cost_terms(terms, f, t);
    (path == AttentionPath::kDenseMha ? e.dense : masked ? e.masked : e.sparse) = std::move(fit);
  }
  for (const auto& [stage, data] : stage_data)
    if (data.second.size() >= cost_stage_terms(stage).size())
      e.stages[stage] = fit_cost_terms(cost_stage_terms(stage), data.first, data.second);
  e.prepare();
  return e;
}

}  // namespace dsakit
