#include "tools/bench_results.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "dsakit/cost_model.h"
#include "src/core/files.h"
#include "tools/cli_common.h"

namespace dsakit::cli {

using json = nlohmann::json;

json bench_document(const Backend& be, const Backend::Ceilings& ceil, const DispatchPolicy& policy,
                    const BenchOptions& o) {
  json doc;
  doc["format"] = "dsakit-bench";
  doc["version"] = 1;
  doc["complete"] = false;
  doc["device"] = be.capabilities().device_name;
  doc["backend"] = be.device() == Device::kCpu ? "cpu" : "cuda";
  doc["date"] = today();
  doc["dsakit_version"] = DSAKIT_VERSION;
  doc["ceilings"] = {
      {"copy_gbs", ceil.copy_gbs}, {"gemm_tflops", ceil.gemm_tflops}, {"gemm", ceil.gemm}};
  doc["profile"] = policy.profile != nullptr ? json(policy.profile_path) : json(nullptr);
  doc["method"] = fmt::format(
      "time of DsaAttention::forward from an idle device by Backend::time_ms (CUDA: events "
      "recorded on the stream before and after the call, so host planning, index uploads and "
      "launch gaps count, a final synchronization's wake-up does not; CPU: wall time), median "
      "of {}..{} calls per mode (as many as fit in {} ms per shape) after one warm-up call; the "
      "modes take turns in blocks of 4 calls whose first (after a switch of path) is dropped; up "
      "to 3 input sets rotated; enqueue_ms: host time until forward returns; stage times from "
      "separate calls that time each stage alone the same way",
      std::min(o.min_runs, o.runs), o.runs, o.budget_ms);
  doc["rows"] = json::array();
  return doc;
}

namespace {

// The forced mode whose time is that of the whole-batch path a mode's plan took ("dense",
// "sparse" for MLA, "masked" for the masked-MHA form), or "" for a split plan.
std::string forced_mode_of(const json& mode) {
  const std::string path = mode["path"].get<std::string>();
  if (path == "dense_mha") return "dense";
  if (path != "sparse_mla") return "";
  return mode.value("sparse_form", std::string("mla")) == "masked-mha" ? "masked" : "sparse";
}

}  // namespace

json bench_row(const LayerBench& bench, const BenchShape& shape,
               const std::vector<std::string>& used, const std::vector<PolicyTiming>& timings,
               double gemm_tflops) {
  const ModelConfig& cfg = bench.config();
  const Batch& batch = bench.batch();
  const KvLayout layout = bench.layout();
  const CostFeatures f = CostFeatures::of(batch, cfg);
  json row = {{"group", bench.group()},
              {"weights", bench.fp8_weights() ? "fp8" : "bf16"},
              {"sparse_rows", to_string(bench.sparse_rows())},
              {"sparse_form", to_string(bench.sparse_form())},
              {"config", cfg.name},
              {"heads", cfg.num_heads},
              {"layout", to_string(layout)},
              {"index_topk", cfg.index_topk},
              {"kind", shape.kind},
              {"label", shape.label()},
              {"prefix", shape.prefix},
              {"extend", shape.extend},
              {"tokens", shape.tokens()},
              {"kv", int64_t(f.positions)},
              {"max_len", shape.max_len()}};
  json jm = json::object();
  for (size_t i = 0; i < used.size(); ++i) {
    const PolicyTiming& t = timings[i];
    const double flops = plan_flops(cfg, batch, t.plan);
    const double tf = flops / (t.ms * 1e-3) / 1e12;
    json e = {{"ms", t.ms},
              {"enqueue_ms", t.enqueue_ms},
              {"runs", t.runs},
              {"path", to_string(t.plan.path)},
              {"sparse_form", to_string(t.plan.sparse_form)},
              {"reason", t.plan.reason},
              {"flops", flops},
              {"tflops", tf},
              {"pct_ceiling", 100 * tf / gemm_tflops},
              {"stages", t.stages}};
    if (t.plan.predicted_ms >= 0) e["predicted_ms"] = t.plan.predicted_ms;
    jm[used[i]] = e;
  }
  row["modes"] = jm;
  // Oracle: the fastest exact whole-batch path measured (the sparse one in either form).
  double oracle = 1e300;
  std::string oracle_path;
  for (const char* m : {"dense", "sparse", "masked"})
    if (jm.contains(m) && jm[m]["ms"].get<double>() < oracle) {
      oracle = jm[m]["ms"].get<double>();
      oracle_path = m;
    }
  if (!oracle_path.empty()) {
    row["oracle_ms"] = oracle;
    row["oracle_path"] = oracle_path;
    for (const char* m : {"rule", "cost"}) {
      if (!jm.contains(m)) continue;
      if (jm.contains("sparse"))
        row[std::string("speedup_") + m + "_vs_sparse"] =
            jm["sparse"]["ms"].get<double>() / jm[m]["ms"].get<double>();
      row[std::string(m) + "_vs_oracle"] = jm[m]["ms"].get<double>() / oracle;
    }
  }
  return row;
}

void write_bench_json(const std::string& path, const json& doc) {
  if (!path.empty()) detail::write_file_atomic(path, doc.dump(1) + "\n", "--json");
}

void print_bench_header(const std::string& device_name, const Backend::Ceilings& ceil) {
  fmt::print("device {} | copy {:.0f} GB/s, GEMM {:.1f} TFLOP/s ({})\n", device_name, ceil.copy_gbs,
             ceil.gemm_tflops, ceil.gemm);
  // rule / cost cells: ms and the plan's path, D dense, S sparse (MLA), K sparse as masked MHA,
  // M a split; "masked ms" is the masked mode (sparse forced in the masked-MHA form).
  fmt::print("{:<26} {:<18} {:>9} {:>9} {:>9} {:>11} {:>11} {:>6} {:>6} {:>6} {:>8} {:>5}\n",
             "group", "shape", "dense ms", "sparse ms", "masked ms", "rule ms", "cost ms", "rule x",
             "cost x", "c/orc", "TFLOP/s", "%gemm");
}

void print_bench_row(const json& row) {
  const json& jm = row["modes"];
  auto cell = [&](const char* m, bool letter) {
    if (!jm.contains(m)) return std::string("-");
    const std::string f = forced_mode_of(jm[m]);
    const std::string l = f == "dense" ? "D" : f == "sparse" ? "S" : f == "masked" ? "K" : "M";
    return letter ? fmt::format("{:.3f} {}", jm[m]["ms"].get<double>(), l)
                  : fmt::format("{:.3f}", jm[m]["ms"].get<double>());
  };
  auto ratio = [&](const char* k) {
    return row.contains(k) ? fmt::format("{:.2f}", row[k].get<double>()) : std::string("-");
  };
  const char* best = jm.contains("cost") ? "cost" : jm.contains("rule") ? "rule" : nullptr;
  fmt::print("{:<26} {:<18} {:>9} {:>9} {:>9} {:>11} {:>11} {:>6} {:>6} {:>6} {:>8} {:>5}\n",
             row["group"].get<std::string>(), row["label"].get<std::string>(), cell("dense", false),
             cell("sparse", false), cell("masked", false), cell("rule", true), cell("cost", true),
             ratio("speedup_rule_vs_sparse"), ratio("speedup_cost_vs_sparse"),
             ratio("cost_vs_oracle"),
             best ? fmt::format("{:.1f}", jm[best]["tflops"].get<double>()) : "-",
             best ? fmt::format("{:.0f}", jm[best]["pct_ceiling"].get<double>()) : "-");
  std::fflush(stdout);
}

json summarize(const json& rows) {
  json groups = json::object();
  for (const auto& r : rows) {
    json& s = groups[r["group"].get<std::string>()];
    if (s.is_null())
      s = {{"fresh_within_topk", 0},
           {"rule_speedup_min", 1e300},
           {"rule_speedup_max", 0.0},
           {"cost_speedup_min", 1e300},
           {"cost_speedup_max", 0.0},
           {"shapes", 0},
           {"cost_within_3pct", 0},
           {"cost_vs_oracle_worst", 0.0},
           {"rule_wrong", 0},
           {"cost_beats_rule_where_rule_wrong", 0},
           {"rule_vs_oracle_worst", 0.0}};
    const json& m = r["modes"];
    if (!r.contains("oracle_ms")) continue;
    const double oracle = r["oracle_ms"].get<double>();
    s["shapes"] = s["shapes"].get<int>() + 1;
    if (r["kind"] == "fresh" && r["max_len"].get<int64_t>() <= r["index_topk"].get<int64_t>() &&
        m.contains("sparse")) {
      s["fresh_within_topk"] = s["fresh_within_topk"].get<int>() + 1;
      for (const char* mode : {"rule", "cost"}) {
        if (!m.contains(mode)) continue;
        const double x = m["sparse"]["ms"].get<double>() / m[mode]["ms"].get<double>();
        const std::string k = std::string(mode) + "_speedup_";
        s[k + "min"] = std::min(s[k + "min"].get<double>(), x);
        s[k + "max"] = std::max(s[k + "max"].get<double>(), x);
      }
    }
    if (m.contains("cost")) {
      // Regret of the decision alone: the measured time of the whole-batch path (and sparse
      // form) cost mode chose, forced (its own time for a split plan, or where that mode was
      // not timed), free of the noise between separate measurements.
      const std::string same = forced_mode_of(m["cost"]);
      const double regret = (m.contains(same) ? m[same] : m["cost"])["ms"].get<double>() / oracle;
      if (regret <= 1.03)
        s["cost_decision_within_3pct"] = s.value("cost_decision_within_3pct", 0) + 1;
      if (regret > s.value("cost_decision_worst", 0.0)) {
        s["cost_decision_worst"] = regret;
        s["cost_decision_worst_shape"] = r["label"];
      }
      const double c = m["cost"]["ms"].get<double>() / oracle;
      if (c <= 1.03) s["cost_within_3pct"] = s["cost_within_3pct"].get<int>() + 1;
      if (c > s["cost_vs_oracle_worst"].get<double>()) {
        s["cost_vs_oracle_worst"] = c;
        s["cost_vs_oracle_worst_shape"] = r["label"];
      }
    }
    if (m.contains("rule")) {
      // The rule's decision, judged like cost mode's: the forced-mode time of the path it chose.
      const std::string same = forced_mode_of(m["rule"]);
      const double q = (m.contains(same) ? m[same] : m["rule"])["ms"].get<double>() / oracle;
      if (q > s["rule_vs_oracle_worst"].get<double>()) {
        s["rule_vs_oracle_worst"] = q;
        s["rule_vs_oracle_worst_shape"] = r["label"];
      }
      if (q > 1.03) {  // the rule's choice is measurably slower than the best path
        s["rule_wrong"] = s["rule_wrong"].get<int>() + 1;
        if (m.contains("cost") && m["cost"]["ms"].get<double>() < m["rule"]["ms"].get<double>())
          s["cost_beats_rule_where_rule_wrong"] =
              s["cost_beats_rule_where_rule_wrong"].get<int>() + 1;
      }
    }
  }
  for (auto& [name, s] : groups.items()) {
    for (const char* mode : {"rule", "cost"}) {
      const std::string k = std::string(mode) + "_speedup_";
      if (s[k + "min"].get<double>() > 1e299) s[k + "min"] = s[k + "max"] = nullptr;
    }
  }
  return groups;
}

void print_summary(const json& summary) {
  fmt::print(
      "\nsummary (speed-up = always-sparse ms / mode ms; oracle = fastest of dense, sparse and "
      "masked measured)\n");
  for (const auto& item : summary.items()) {
    const std::string& name = item.key();
    const json& s = item.value();
    auto num = [&](const char* k) {
      return s[k].is_null() ? std::string("-") : fmt::format("{:.2f}", s[k].get<double>());
    };
    fmt::print(
        "  {:<28} fresh<=topk: rule {}..{}x, cost {}..{}x | cost within 3% of oracle on "
        "{}/{} (worst {} at {}; by its decision {}/{}, worst {}) | rule off by >3% on {} "
        "shapes, cost faster there on {} (rule worst {} at {})\n",
        name, num("rule_speedup_min"), num("rule_speedup_max"), num("cost_speedup_min"),
        num("cost_speedup_max"), s["cost_within_3pct"].get<int>(), s["shapes"].get<int>(),
        num("cost_vs_oracle_worst"), s.value("cost_vs_oracle_worst_shape", std::string("-")),
        s.value("cost_decision_within_3pct", 0), s["shapes"].get<int>(),
        s.contains("cost_decision_worst") ? num("cost_decision_worst") : "-",
        s["rule_wrong"].get<int>(), s["cost_beats_rule_where_rule_wrong"].get<int>(),
        num("rule_vs_oracle_worst"), s.value("rule_vs_oracle_worst_shape", std::string("-")));
  }
}

void run_plot(const std::string& json_path, const std::string& prefix, const std::string& fmt_) {
  std::string script = DSAKIT_SOURCE_DIR "/tools/plot_bench.py";
  if (const char* s = std::getenv("DSAKIT_PLOT_SCRIPT"); s && *s) script = s;
  std::string python = "python3";
  if (const char* p = std::getenv("DSAKIT_PYTHON"); p && *p)
    python = p;
  else if (std::filesystem::exists(DSAKIT_SOURCE_DIR "/.venv/bin/python"))
    python = DSAKIT_SOURCE_DIR "/.venv/bin/python";
  auto quote = [](const std::string& s) {
    std::string q = "'";
    for (char ch : s) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
    return q + "'";
  };
  const std::string cmd = quote(python) + " " + quote(script) + " " + quote(json_path) + " " +
                          quote(prefix) + " --format " + quote(fmt_);
  const int rc = std::system(cmd.c_str());
  if (rc != 0)
    std::fprintf(stderr,
                 "dsakit bench: plotting failed (exit %d); the JSON is complete: run %s %s %s "
                 "by hand (needs matplotlib: pip install -r scripts/requirements.txt)\n",
                 rc, script.c_str(), json_path.c_str(), prefix.c_str());
}

}  // namespace dsakit::cli
