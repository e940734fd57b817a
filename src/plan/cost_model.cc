// Cost model: features of a batch, the profile file, and the non-negative least-squares fit.
#include "dsakit/cost_model.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsakit/error.h"
#include "dsakit/plan.h"
#include "src/core/files.h"

namespace dsakit {

using json = nlohmann::json;

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

const std::vector<std::string>& cost_terms(AttentionPath path) {
  // Dense: gather + K/V up-projection scale with positions, attention with Σ ctx.
  static const std::vector<std::string> dense = {"1", "R", "T", "N", "N*H", "C*H"};
  // Sparse: indexer over Σ ctx, top-k rows, projections per token, attention over k_eff.
  static const std::vector<std::string> sparse = {"1", "R", "T", "N", "T*H", "K*H", "C*Hi"};
  return path == AttentionPath::kDenseMha ? dense : sparse;
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

// ---- key -------------------------------------------------------------------------------------

CostKey CostKey::of(const std::string& device, const ModelConfig& c, KvLayout layout) {
  CostKey k;
  k.device = device;
  k.model = c.name;
  k.heads = c.num_heads;
  k.d_nope = c.qk_nope_head_dim;
  k.d_rope = c.qk_rope_head_dim;
  k.d_v = c.v_head_dim;
  k.d_c = c.kv_lora_rank;
  k.index_heads = c.index_n_heads;
  k.index_dim = c.index_head_dim;
  k.index_topk = c.index_topk;
  k.layout = to_string(layout);
  return k;
}

bool CostKey::matches(const CostKey& o) const {
  return device == o.device && heads == o.heads && d_nope == o.d_nope && d_rope == o.d_rope &&
         d_v == o.d_v && d_c == o.d_c && index_heads == o.index_heads && index_dim == o.index_dim &&
         index_topk == o.index_topk && layout == o.layout;
}

std::string CostKey::describe() const {
  std::ostringstream os;
  os << "'" << device << "', " << model << " H=" << heads << " (d_nope/d_rope/d_v/d_c " << d_nope
     << "/" << d_rope << "/" << d_v << "/" << d_c << ", indexer " << index_heads << "x" << index_dim
     << " top-" << index_topk << "), " << layout << " pool";
  return os.str();
}

double CostEntry::linear_ms(AttentionPath path, const CostFeatures& f) const {
  return (path == AttentionPath::kDenseMha ? dense : sparse).predict_ms(f);
}

namespace {

double log2_at_least_1(double v) {
  return std::log2(std::max(v, 1.0));
}

}  // namespace

void CostEntry::prepare() {
  for (CostTerms* t : {&dense, &sparse}) {
    t->ids.clear();
    for (const auto& n : t->names) t->ids.push_back(parse_cost_term(n));
  }
  neighbors.clear();
  for (const CostSample& s : samples) {
    const double base = linear_ms(s.path, s.features);
    if (s.ms <= 0 || base <= 0) continue;
    neighbors.push_back({s.path, log2_at_least_1(s.features.tokens),
                         log2_at_least_1(s.features.positions),
                         log2_at_least_1(s.features.requests), std::log(s.ms / base)});
  }
}

double CostEntry::predict_ms(AttentionPath path, const CostFeatures& f) const {
  const double linear = linear_ms(path, f);
  if (linear <= 0 || neighbors.empty()) return linear;
  // Local correction in log space: Gaussian weights over the distance in octaves of tokens,
  // positions and requests; kShrink is the weight of "no correction" (a sample exactly one
  // sigma away gets ~12x that), so a batch far from every sample keeps the linear model.
  constexpr double kSigma = 0.5, kShrink = 0.05;
  const double lt = log2_at_least_1(f.tokens), ln = log2_at_least_1(f.positions),
               lr = log2_at_least_1(f.requests);
  double weight = 0, sum = 0;
  for (const Neighbor& s : neighbors) {
    if (s.path != path) continue;
    const double dt = lt - s.log2_tokens, dn = ln - s.log2_positions, dr = lr - s.log2_requests;
    const double d2 = dt * dt + dn * dn + dr * dr;
    if (d2 > 28 * kSigma * kSigma) continue;  // weight < 1e-6
    const double w = std::exp(-d2 / (2 * kSigma * kSigma));
    weight += w;
    sum += w * s.log_residual;
  }
  return linear * std::exp(sum / (weight + kShrink));
}

// ---- JSON ------------------------------------------------------------------------------------

namespace {

json terms_json(const CostTerms& t) {
  json j = json::object();
  for (size_t i = 0; i < t.names.size(); ++i) j["coef_ms"][t.names[i]] = t.coef_ms[i];
  j["max_rel_error"] = t.max_rel_error;
  return j;
}

CostTerms terms_from(const json& j, const std::vector<std::string>& expected, const char* what) {
  CostTerms t;
  DSAKIT_CHECK_ARG(j.is_object() && j.contains("coef_ms") && j["coef_ms"].is_object(), what,
                   ": expected an object with coef_ms");
  for (const auto& [name, v] : j["coef_ms"].items()) {
    DSAKIT_CHECK_ARG(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0, what,
                     ".", name, ": expected a finite coefficient >= 0");
    parse_cost_term(name);  // throws for an unknown term
    t.names.push_back(name);
    t.coef_ms.push_back(v.get<double>());
  }
  if (!expected.empty())
    for (const auto& name : expected)
      DSAKIT_CHECK_ARG(std::find(t.names.begin(), t.names.end(), name) != t.names.end(), what,
                       ": missing term '", name, "'");
  t.max_rel_error = j.value("max_rel_error", 0.0);
  for (const auto& n : t.names) t.ids.push_back(parse_cost_term(n));
  return t;
}

}  // namespace

std::string CostProfile::to_json() const {
  json j;
  j["format"] = "dsakit-cost-profile";
  j["format_version"] = format;
  j["kernel_revision"] = kernel_revision;
  j["entries"] = json::array();
  for (const auto& e : entries) {
    json k = {{"device", e.key.device},
              {"model", e.key.model},
              {"heads", e.key.heads},
              {"d_nope", e.key.d_nope},
              {"d_rope", e.key.d_rope},
              {"d_v", e.key.d_v},
              {"d_c", e.key.d_c},
              {"index_heads", e.key.index_heads},
              {"index_dim", e.key.index_dim},
              {"index_topk", e.key.index_topk},
              {"layout", e.key.layout}};
    json je = {{"key", k}, {"created", e.created}};
    je["samples"] = json::array();
    for (const CostSample& smp : e.samples) {
      const CostFeatures& f = smp.features;
      je["samples"].push_back({{"path", to_string(smp.path)},
                               {"R", f.requests},
                               {"T", f.tokens},
                               {"N", f.positions},
                               {"C", f.ctx},
                               {"K", f.ctx_topk},
                               {"H", f.heads},
                               {"Hi", f.index_heads},
                               {"ms", smp.ms}});
    }
    je["dense"] = terms_json(e.dense);
    je["sparse"] = terms_json(e.sparse);
    for (const auto& [name, t] : e.stages) je["stages"][name] = terms_json(t);
    j["entries"].push_back(je);
  }
  return j.dump(2) + "\n";
}

CostProfile CostProfile::from_json(const std::string& text, const std::string& source) {
  const std::string where = source.empty() ? "cost profile" : "cost profile " + source;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    DSAKIT_FAIL(kInvalidArgument, where, ": not valid JSON (", e.what(), ")");
  }
  DSAKIT_CHECK_ARG(j.is_object() && j.value("format", "") == "dsakit-cost-profile", where,
                   ": not a dsakit cost profile (no \"format\": \"dsakit-cost-profile\")");
  CostProfile p;
  p.source = source;
  try {
    p.format = j.at("format_version").get<int>();
    p.kernel_revision = j.at("kernel_revision").get<int>();
  } catch (const json::exception&) {
    DSAKIT_FAIL(kInvalidArgument, where, ": format_version and kernel_revision must be integers");
  }
  DSAKIT_CHECK_ARG(p.format == kCostProfileFormat, where, " is stale: format version ", p.format,
                   ", this build reads ", kCostProfileFormat, "; re-run dsakit calibrate");
  DSAKIT_CHECK_ARG(p.kernel_revision == kCostKernelRevision, where,
                   " is stale: measured with kernel revision ", p.kernel_revision,
                   ", this build has revision ", kCostKernelRevision,
                   " (the kernels' speed changed); re-run dsakit calibrate");
  DSAKIT_CHECK_ARG(j.contains("entries") && j["entries"].is_array(), where,
                   ": expected an \"entries\" array");
  for (const auto& je : j["entries"]) {
    try {
      CostEntry e;
      const json& k = je.at("key");
      e.key.device = k.at("device").get<std::string>();
      e.key.model = k.value("model", "");
      e.key.heads = k.at("heads").get<int>();
      e.key.d_nope = k.at("d_nope").get<int>();
      e.key.d_rope = k.at("d_rope").get<int>();
      e.key.d_v = k.at("d_v").get<int>();
      e.key.d_c = k.at("d_c").get<int>();
      e.key.index_heads = k.at("index_heads").get<int>();
      e.key.index_dim = k.at("index_dim").get<int>();
      e.key.index_topk = k.at("index_topk").get<int>();
      e.key.layout = k.at("layout").get<std::string>();
      parse_kv_layout(e.key.layout);
      e.created = je.value("created", "");
      for (const json& js : je.at("samples")) {
        CostSample smp;
        const std::string path = js.at("path").get<std::string>();
        DSAKIT_CHECK_ARG(path == "dense_mha" || path == "sparse_mla",
                         "sample path: expected dense_mha or sparse_mla, got '", path, "'");
        smp.path = path == "dense_mha" ? AttentionPath::kDenseMha : AttentionPath::kSparseMla;
        CostFeatures& f = smp.features;
        f.requests = js.at("R").get<double>();
        f.tokens = js.at("T").get<double>();
        f.positions = js.at("N").get<double>();
        f.ctx = js.at("C").get<double>();
        f.ctx_topk = js.at("K").get<double>();
        f.heads = js.at("H").get<double>();
        f.index_heads = js.at("Hi").get<double>();
        smp.ms = js.at("ms").get<double>();
        for (double v : {f.requests, f.tokens, f.positions, f.ctx, f.ctx_topk, smp.ms})
          DSAKIT_CHECK_ARG(std::isfinite(v) && v >= 0, "sample values must be finite and >= 0");
        e.samples.push_back(smp);
      }
      e.dense = terms_from(je.at("dense"), cost_terms(AttentionPath::kDenseMha), "dense");
      e.sparse = terms_from(je.at("sparse"), cost_terms(AttentionPath::kSparseMla), "sparse");
      if (je.contains("stages") && je["stages"].is_object())
        for (const auto& [name, t] : je["stages"].items())
          e.stages[name] = terms_from(t, {}, name.c_str());
      e.prepare();  // after the fits: the residuals are against them
      p.entries.push_back(std::move(e));
    } catch (const json::exception& ex) {
      DSAKIT_FAIL(kInvalidArgument, where, ": entry ", p.entries.size(), " is malformed (",
                  ex.what(), ")");
    } catch (const Error& ex) {
      DSAKIT_FAIL(kInvalidArgument, where, ": entry ", p.entries.size(), ": ", ex.what());
    }
  }
  return p;
}

CostProfile CostProfile::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  DSAKIT_CHECK_ARG(f.good(), "cost profile ", path, ": cannot open the file");
  std::ostringstream os;
  os << f.rdbuf();
  DSAKIT_CHECK_ARG(os.str().size() <= (size_t(64) << 20), "cost profile ", path,
                   ": larger than 64 MiB");
  return from_json(os.str(), path);
}

void CostProfile::save(const std::string& path) const {
  detail::write_file_atomic(path, to_json(), "cost profile");
}

const CostEntry& CostProfile::find(const CostKey& key) const {
  for (const auto& e : entries)
    if (e.key.matches(key)) return e;
  std::ostringstream os;
  os << "cost profile " << (source.empty() ? "(in memory)" : source) << " has no entry for "
     << key.describe() << "; it holds " << entries.size() << " entr"
     << (entries.size() == 1 ? "y" : "ies");
  for (const auto& e : entries) os << "; [" << e.key.describe() << "]";
  os << ". Run dsakit calibrate on this device for this model and layout";
  DSAKIT_FAIL(kInvalidArgument, os.str());
}

void CostProfile::put(CostEntry entry) {
  entry.prepare();
  for (auto& e : entries)
    if (e.key.matches(entry.key)) {
      e = std::move(entry);
      return;
    }
  entries.push_back(std::move(entry));
}

// ---- fit -------------------------------------------------------------------------------------

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
  for (const CostSample& smp : samples) e.samples.push_back({smp.path, smp.features, smp.ms, {}});
  std::map<std::string, std::pair<std::vector<CostFeatures>, std::vector<double>>> stage_data;
  for (AttentionPath path : {AttentionPath::kDenseMha, AttentionPath::kSparseMla}) {
    std::vector<CostFeatures> f;
    std::vector<double> t;
    for (const auto& s : samples) {
      if (s.path != path) continue;
      f.push_back(s.features);
      t.push_back(s.ms);
      for (const auto& [stage, ms] : s.stage_ms) {
        if (ms <= 0) continue;
        stage_data[stage].first.push_back(s.features);
        stage_data[stage].second.push_back(ms);
      }
    }
    DSAKIT_CHECK_ARG(t.size() >= cost_terms(path).size(), "cost fit: ", t.size(), " ",
                     to_string(path), " samples for ", cost_terms(path).size(),
                     " terms; calibrate over more shapes");
    (path == AttentionPath::kDenseMha ? e.dense : e.sparse) =
        fit_cost_terms(cost_terms(path), f, t);
  }
  for (const auto& [stage, data] : stage_data)
    if (data.second.size() >= cost_stage_terms(stage).size())
      e.stages[stage] = fit_cost_terms(cost_stage_terms(stage), data.first, data.second);
  e.prepare();
  return e;
}

}  // namespace dsakit
