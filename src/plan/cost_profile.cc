// The cost-model profile file: the key an entry is stored under, JSON write and read with its
// validation (format version, kernel revision, coefficients, samples), and entry lookup.
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
      if (smp.form == SparseForm::kMaskedMha) je["samples"].back()["form"] = to_string(smp.form);
    }
    je["dense"] = terms_json(e.dense);
    je["sparse"] = terms_json(e.sparse);
    if (e.prices_masked()) je["masked"] = terms_json(e.masked);
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
        if (js.contains("form")) {
          smp.form = parse_sparse_form(js.at("form").get<std::string>());
          DSAKIT_CHECK_ARG(smp.path == AttentionPath::kSparseMla && smp.form != SparseForm::kAuto,
                           "sample form: expected 'mla' or 'masked-mha' on a sparse_mla sample");
        }
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
      if (je.contains("masked"))
        e.masked =
            terms_from(je.at("masked"),
                       cost_terms(AttentionPath::kSparseMla, SparseForm::kMaskedMha), "masked");
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

}  // namespace dsakit
