// `dsakit bench` and `dsakit calibrate`: whole-layer timings per dispatch mode over a grid of
// shapes (DESIGN.md §10), and the cost-model fit that cost-mode dispatch reads (§5).
#include "tools/bench_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "src/core/files.h"
#include "tools/cli_common.h"
#include "tools/measure.h"

namespace dsakit::cli {
namespace {

using json = nlohmann::json;

// Set by SIGINT/SIGTERM while a bench or calibration runs: the loops stop at the next call and
// the JSON written so far stays valid (it is rewritten whole after every shape).
std::atomic<bool> g_stop{false};

extern "C" void on_stop_signal(int) {
  g_stop.store(true);
}

// Installs the handlers for the lifetime of a command and restores the previous ones.
class StopSignals {
 public:
  StopSignals() {
    g_stop.store(false);
    int_ = std::signal(SIGINT, on_stop_signal);
    term_ = std::signal(SIGTERM, on_stop_signal);
  }
  ~StopSignals() {
    std::signal(SIGINT, int_);
    std::signal(SIGTERM, term_);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  void (*int_)(int) = nullptr;
  void (*term_)(int) = nullptr;
};

inline constexpr int kExitInterrupted = 130;

std::unique_ptr<Backend> open_backend(const std::string& device, int threads) {
  DSAKIT_CHECK_ARG(device == "cpu" || device == "cuda" || device == "auto",
                   "--device: expected cpu, cuda or auto, got '", device, "'");
  DSAKIT_CHECK_ARG(threads >= 0 && threads <= 1024, "--threads: expected 0..1024, got ", threads);
  return device == "cpu" ? make_cpu_backend(threads) : make_backend(device);
}

std::vector<KvLayout> parse_layouts(const std::string& text) {
  std::vector<KvLayout> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse_kv_layout(item));
  DSAKIT_CHECK_ARG(!out.empty(), "--kv: expected a list of bf16, fp8, fp8-raw");
  return out;
}

std::string default_models(const Backend& be) {
  // H per rank 128/16 (DeepSeek-V3.2, tp 1/8) and 64/16 (GLM-5, tp 1/4); the CPU only the
  // 16-head shards (minutes, not hours, on a few cores).
  return be.device() == Device::kCpu ? "deepseek-v3.2:8,glm-5:4"
                                     : "deepseek-v3.2:1,deepseek-v3.2:8,glm-5:1,glm-5:4";
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

std::string group_name(const ModelConfig& c, KvLayout layout) {
  return fmt::format("{} H={} {}", c.name, c.num_heads, to_string(layout));
}

// Whether `mode` may run this shape (forced dense only where it is exact and compiled).
bool mode_allowed(DispatchMode mode, const BenchShape& s, const ModelConfig& c,
                  const Capabilities& caps) {
  if (mode != DispatchMode::kDense) return true;
  return s.max_len() <= c.index_topk && dense_mha_available(caps, c);
}

// ---- grids -----------------------------------------------------------------------------------

struct Grid {
  std::vector<int32_t> fresh, prefixes, extends;
  std::vector<BenchShape> mixed;
};

Grid make_grid(const std::string& name) {
  Grid g;
  auto mixed = [](std::vector<int32_t> p, std::vector<int32_t> e) {
    return BenchShape{"mixed", std::move(p), std::move(e)};
  };
  if (name == "quick") {
    g.fresh = {128, 512};
    g.prefixes = {384};
    g.extends = {1, 64};
    g.mixed = {mixed({0, 448}, {256, 64})};
  } else if (name == "small") {
    g.fresh = {128, 256, 512, 1024, 2048};
    g.prefixes = {512, 1536, 1984};
    g.extends = {1, 16, 64, 256};
    g.mixed = {mixed({0, 0}, {1500, 700}), mixed({1984, 0}, {16, 1024}),
               mixed({0, 0, 0, 0}, {256, 256, 256, 256}), mixed({1920, 0, 1980}, {64, 512, 32})};
  } else if (name == "full") {
    g.fresh = {256, 512, 1024, 1536, 2048, 4096, 8192, 16384, 32768, 65536};
    g.prefixes = {256, 1024, 1536, 1792, 1984, 4096, 32768};
    g.extends = {1, 16, 64, 256, 1024, 8192};
    g.mixed = {mixed({0, 0}, {1500, 700}),
               mixed({1984, 0}, {16, 1024}),
               mixed({0, 0, 0, 0, 0, 0, 0, 0}, {256, 256, 256, 256, 256, 256, 256, 256}),
               mixed({0, 0}, {2048, 4096}),
               mixed({1920, 0, 1980}, {64, 512, 32}),
               mixed({0, 1900, 0, 6000}, {100, 16, 300, 2000})};
  } else {
    DSAKIT_FAIL(kInvalidArgument, "--grid: expected quick, small or full, got '", name, "'");
  }
  return g;
}

std::vector<BenchShape> grid_shapes(const Grid& g, bool with_mixed) {
  std::vector<BenchShape> out;
  for (int32_t t : g.fresh) out.push_back({"fresh", {0}, {t}});
  for (int32_t p : g.prefixes)
    for (int32_t e : g.extends) out.push_back({"prefix", {p}, {e}});
  if (with_mixed) out.insert(out.end(), g.mixed.begin(), g.mixed.end());
  return out;
}

// Progress on stderr: one rewritten line on a terminal, one line per shape otherwise.
struct ProgressLine {
  bool enabled = true;
  bool tty = isatty(2) != 0;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  void operator()(size_t done, size_t total, const std::string& what) const {
    if (!enabled) return;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "%s[%s %zu/%zu %.0fs] %s%s", tty ? "\r\033[K" : "", "dsakit", done + 1,
                 total, s, what.c_str(), tty ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() const {
    if (enabled && tty) std::fprintf(stderr, "\n");
  }
};

// The figures the issue asks for, over the rows of one bench run.
json summarize(const json& rows) {
  json groups = json::object();
  for (const auto& r : rows) {
    const std::string g = fmt::format("{} H={} {}", r["config"].get<std::string>(),
                                      r["heads"].get<int>(), r["layout"].get<std::string>());
    json& s = groups[g];
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
      // Regret of the decision alone: the measured time of the whole-batch path cost mode chose
      // (its own time for a split plan), free of the noise between separate measurements.
      const std::string cp = m["cost"]["path"].get<std::string>();
      const char* same = cp == "dense_mha" ? "dense" : cp == "sparse_mla" ? "sparse" : "cost";
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
      const std::string rp = m["rule"]["path"].get<std::string>();
      const char* same = rp == "dense_mha" ? "dense" : "sparse";
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
      "\nsummary (speed-up = always-sparse ms / mode ms; oracle = faster of dense and "
      "sparse measured)\n");
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

// Runs tools/plot_bench.py on the JSON (matplotlib; optional).
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

}  // namespace

// ---- bench -----------------------------------------------------------------------------------

int bench_command(const BenchOptions& o) {
  DSAKIT_CHECK_ARG(o.runs >= 1 && o.runs <= 1000, "--runs: expected 1..1000, got ", o.runs);
  DSAKIT_CHECK_ARG(o.min_runs >= 1 && o.min_runs <= 1000, "--min-runs: expected 1..1000, got ",
                   o.min_runs);
  DSAKIT_CHECK_ARG(o.budget_ms > 0, "--budget-ms: expected > 0, got ", o.budget_ms);
  DSAKIT_CHECK_ARG(o.plot_format == "png" || o.plot_format == "svg",
                   "--plot-format: expected png or svg, got '", o.plot_format, "'");
  std::vector<DispatchMode> modes;
  {
    std::stringstream ss(o.modes);
    std::string m;
    while (std::getline(ss, m, ',')) modes.push_back(parse_dispatch_mode(m));
    DSAKIT_CHECK_ARG(!modes.empty(), "--modes: expected a list of dense, sparse, rule, cost");
  }
  auto be = open_backend(o.device, o.threads);
  const auto models = parse_model_list(o.models.empty() ? default_models(*be) : o.models);
  const auto layouts = parse_layouts(o.kv);
  Grid grid =
      make_grid(o.grid.empty() ? (be->device() == Device::kCpu ? "small" : "full") : o.grid);
  if (!o.fresh.empty()) grid.fresh = parse_int_list(o.fresh, "--fresh", 1);
  if (!o.prefixes.empty()) grid.prefixes = parse_int_list(o.prefixes, "--prefixes", 0);
  if (!o.extends.empty()) grid.extends = parse_int_list(o.extends, "--extends", 1);
  const std::vector<BenchShape> shapes = grid_shapes(grid, !o.no_mixed);
  DSAKIT_CHECK_ARG(!shapes.empty(), "the grid has no shapes");
  for (const auto& s : shapes)
    DSAKIT_CHECK_ARG(s.tokens() <= (int64_t(1) << 20) && s.max_len() <= (int64_t(1) << 20),
                     "shape ", s.label(), ": at most 2^20 tokens");

  DispatchPolicy base;
  if (!o.profile.empty()) base = base.with_profile(o.profile);
  base = base.with_env();
  base.overrides.clear();  // the policies are the bench's; env values were applied above
  const bool have_profile = base.profile != nullptr;
  const std::string json_path =
      !o.json.empty() ? o.json : (!o.plot.empty() ? o.plot + ".json" : std::string());

  StopSignals signals;
  const auto& caps = be->capabilities();
  if (!o.quiet)
    fmt::print(stderr, "dsakit bench: {} | {} shapes x {} configs x {} layouts | modes {}{}\n",
               caps.device_name, shapes.size(), models.size(), layouts.size(), o.modes,
               have_profile ? " | profile " + base.profile_path
                            : " | no profile: cost mode falls back to rule mode");
  const Backend::Ceilings ceil = be->measure_ceilings();

  json doc;
  doc["format"] = "dsakit-bench";
  doc["version"] = 1;
  doc["complete"] = false;
  doc["device"] = caps.device_name;
  doc["backend"] = be->device() == Device::kCpu ? "cpu" : "cuda";
  doc["date"] = today();
  doc["dsakit_version"] = DSAKIT_VERSION;
  doc["ceilings"] = {
      {"copy_gbs", ceil.copy_gbs}, {"gemm_tflops", ceil.gemm_tflops}, {"gemm", ceil.gemm}};
  doc["profile"] = have_profile ? json(base.profile_path) : json(nullptr);
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
  fmt::print("device {} | copy {:.0f} GB/s, GEMM {:.1f} TFLOP/s ({})\n", caps.device_name,
             ceil.copy_gbs, ceil.gemm_tflops, ceil.gemm);
  fmt::print("{:<26} {:<18} {:>9} {:>9} {:>11} {:>11} {:>6} {:>6} {:>6} {:>8} {:>5}\n", "group",
             "shape", "dense ms", "sparse ms", "rule ms", "cost ms", "rule x", "cost x", "c/orc",
             "TFLOP/s", "%gemm");

  ProgressLine progress;
  progress.enabled = !o.quiet;
  const size_t total = shapes.size() * models.size() * layouts.size();
  size_t done = 0;
  bool interrupted = false;
  for (const ModelConfig& cfg : models) {
    for (KvLayout layout : layouts) {
      LayerBench lb(*be, cfg, layout, o.seed);
      const std::string group = group_name(cfg, layout);
      for (const BenchShape& shape : shapes) {
        if (g_stop.load()) break;
        progress(done, total, group + " | " + shape.kind + " " + shape.label());
        std::vector<DispatchPolicy> policies;
        std::vector<DispatchMode> used;
        for (DispatchMode m : modes) {
          if (!mode_allowed(m, shape, cfg, caps)) continue;
          DispatchPolicy p = base;
          p.mode = m;
          policies.push_back(p);
          used.push_back(m);
        }
        lb.prepare(shape);
        const auto timings =
            lb.time(policies, o.runs, std::min(o.min_runs, o.runs), o.budget_ms, o.stages, &g_stop);
        if (g_stop.load()) break;
        ++done;
        const Batch& batch = lb.batch();
        const CostFeatures f = CostFeatures::of(batch, cfg);
        json row = {{"config", cfg.name},          {"heads", cfg.num_heads},
                    {"layout", to_string(layout)}, {"index_topk", cfg.index_topk},
                    {"kind", shape.kind},          {"label", shape.label()},
                    {"prefix", shape.prefix},      {"extend", shape.extend},
                    {"tokens", shape.tokens()},    {"kv", int64_t(f.positions)},
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
                    {"reason", t.plan.reason},
                    {"flops", flops},
                    {"tflops", tf},
                    {"pct_ceiling", 100 * tf / ceil.gemm_tflops},
                    {"stages", t.stages}};
          if (t.plan.predicted_ms >= 0) e["predicted_ms"] = t.plan.predicted_ms;
          jm[to_string(used[i])] = e;
        }
        row["modes"] = jm;
        // Oracle: the faster exact whole-batch path measured.
        double oracle = 1e300;
        std::string oracle_path;
        for (const char* m : {"dense", "sparse"})
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
        doc["rows"].push_back(row);
        if (!json_path.empty()) detail::write_file_atomic(json_path, doc.dump(1) + "\n", "--json");

        auto cell = [&](const char* m, bool letter) {
          if (!jm.contains(m)) return std::string("-");
          const std::string p = jm[m]["path"].get<std::string>();
          const std::string l = p == "dense_mha" ? "D" : p == "sparse_mla" ? "S" : "M";
          return letter ? fmt::format("{:.3f} {}", jm[m]["ms"].get<double>(), l)
                        : fmt::format("{:.3f}", jm[m]["ms"].get<double>());
        };
        auto ratio = [&](const char* k) {
          return row.contains(k) ? fmt::format("{:.2f}", row[k].get<double>()) : std::string("-");
        };
        const char* best = jm.contains("cost") ? "cost" : jm.contains("rule") ? "rule" : nullptr;
        if (progress.tty && progress.enabled) std::fprintf(stderr, "\r\033[K");
        fmt::print("{:<26} {:<18} {:>9} {:>9} {:>11} {:>11} {:>6} {:>6} {:>6} {:>8} {:>5}\n", group,
                   shape.label(), cell("dense", false), cell("sparse", false), cell("rule", true),
                   cell("cost", true), ratio("speedup_rule_vs_sparse"),
                   ratio("speedup_cost_vs_sparse"), ratio("cost_vs_oracle"),
                   best ? fmt::format("{:.1f}", jm[best]["tflops"].get<double>()) : "-",
                   best ? fmt::format("{:.0f}", jm[best]["pct_ceiling"].get<double>()) : "-");
        std::fflush(stdout);
      }
      if (g_stop.load()) break;
    }
    if (g_stop.load()) break;
  }
  progress.finish();
  interrupted = g_stop.load();
  doc["complete"] = !interrupted;
  if (interrupted) doc["interrupted"] = true;
  doc["summary"] = summarize(doc["rows"]);
  if (!json_path.empty()) detail::write_file_atomic(json_path, doc.dump(1) + "\n", "--json");
  print_summary(doc["summary"]);
  if (interrupted) {
    std::fprintf(stderr, "dsakit bench: interrupted after %zu of %zu shapes%s%s\n", done, total,
                 json_path.empty() ? "" : "; partial results in ", json_path.c_str());
    return kExitInterrupted;
  }
  if (!o.plot.empty()) run_plot(json_path, o.plot, o.plot_format);
  return 0;
}

// ---- calibrate -------------------------------------------------------------------------------

namespace {

// The compact calibration grid: contexts within index_topk (both paths exact: where the choice
// is made), a few beyond it for the sparse terms, and mixed batches for the per-request terms
// (with and without long cached prefixes).
std::vector<BenchShape> calibration_shapes(int index_topk) {
  const int32_t k = index_topk;
  std::vector<BenchShape> s;
  for (int32_t t : {64, 128, 256, 512, 1024, 1536, 2048})
    if (t <= k) s.push_back({"fresh", {0}, {t}});
  const std::vector<std::pair<int32_t, int32_t>> pe = {
      {512, 1},    {1024, 1},   {2000, 1},   {1024, 16},  {1984, 16},   {1536, 64}, {1984, 64},
      {1792, 256}, {1024, 512}, {1536, 512}, {256, 1024}, {1024, 1024}, {2040, 8}};
  for (auto [p, e] : pe)
    if (p + e <= k) s.push_back({"prefix", {p}, {e}});
  s.push_back({"mixed", {0, 0, 0, 0}, {256, 256, 256, 256}});
  s.push_back({"mixed", {0, 1024, 0}, {1024, 64, 64}});
  s.push_back({"mixed", std::vector<int32_t>(8, 0), std::vector<int32_t>(8, 128)});
  // Mixed batches whose positions are mostly long cached prefixes (chunked prefill next to a
  // fresh prompt): without samples near them the linear terms misprice them by 10-20% (H200).
  for (BenchShape m : {BenchShape{"mixed", {1792, 0, 2000}, {64, 256, 16}},
                       BenchShape{"mixed", {1536, 0, 1984}, {128, 384, 64}},
                       BenchShape{"mixed", {1024, 1984}, {256, 64}}})
    if (m.max_len() <= k) s.push_back(std::move(m));
  // Beyond index_topk (sparse only): separates the indexer's Σctx from attention's Σmin(ctx,k).
  s.push_back({"prefix", {k}, {512}});
  s.push_back({"prefix", {2 * k}, {64}});
  s.push_back({"prefix", {4 * k}, {16}});
  return s;
}

}  // namespace

int calibrate_command(const CalibrateOptions& o) {
  DSAKIT_CHECK_ARG(o.runs >= 3 && o.runs <= 1000, "--runs: expected 3..1000, got ", o.runs);
  DSAKIT_CHECK_ARG(o.budget_ms > 0, "--budget-ms: expected > 0, got ", o.budget_ms);
  DSAKIT_CHECK_ARG(!o.out.empty(), "--out: expected a file name");
  auto be = open_backend(o.device, o.threads);
  const auto models = parse_model_list(o.models.empty() ? default_models(*be) : o.models);
  const auto layouts = parse_layouts(o.kv);
  const auto& caps = be->capabilities();

  // Merge into an existing profile of this build; refuse to overwrite anything else.
  CostProfile profile;
  if (std::filesystem::exists(o.out)) {
    try {
      profile = CostProfile::load(o.out);
    } catch (const Error& e) {
      const std::string what = e.what();
      DSAKIT_CHECK_ARG(what.find("is stale") != std::string::npos, "--out ", o.out,
                       " exists and is not a dsakit cost profile this build can extend (", what,
                       "); choose another file or remove it");
      std::fprintf(stderr, "dsakit calibrate: %s exists but is stale; replacing it\n",
                   o.out.c_str());
      profile = CostProfile{};
    }
  }

  StopSignals signals;
  ProgressLine progress;
  progress.enabled = !o.quiet;
  size_t total = 0, done = 0;
  for (const auto& cfg : models)
    total += calibration_shapes(cfg.index_topk).size() * layouts.size();
  for (const ModelConfig& cfg : models) {
    DSAKIT_CHECK(mode_allowed(DispatchMode::kDense, {"fresh", {0}, {1}}, cfg, caps), kUnsupported,
                 "calibrate: ", caps.device_name, " has no dense MHA kernel for ", cfg.name,
                 " (d_nope/d_rope/d_v = ", cfg.qk_nope_head_dim, "/", cfg.qk_rope_head_dim, "/",
                 cfg.v_head_dim, "): cost mode has nothing to choose there");
    for (KvLayout layout : layouts) {
      LayerBench lb(*be, cfg, layout, o.seed);
      const std::string group = group_name(cfg, layout);
      std::vector<CostSample> samples;
      for (const BenchShape& shape : calibration_shapes(cfg.index_topk)) {
        if (g_stop.load()) break;
        progress(done++, total, "calibrate " + group + " | " + shape.label());
        std::vector<DispatchPolicy> policies;
        for (DispatchMode m : {DispatchMode::kDense, DispatchMode::kSparse}) {
          if (!mode_allowed(m, shape, cfg, caps)) continue;
          DispatchPolicy p;
          p.mode = m;
          policies.push_back(p);
        }
        lb.prepare(shape);
        const auto timings = lb.time(policies, o.runs, 3, o.budget_ms, true, &g_stop);
        if (g_stop.load()) break;
        for (const auto& t : timings)
          samples.push_back({t.plan.path, CostFeatures::of(lb.batch(), cfg), t.ms, t.stages});
      }
      if (g_stop.load()) break;
      CostEntry entry = fit_cost_entry(CostKey::of(caps.device_name, cfg, layout), samples);
      entry.created = today();
      progress.finish();
      if (!o.quiet) {
        fmt::print("{}: {} samples\n", group, entry.samples.size());
        for (const auto* t : {&entry.dense, &entry.sparse}) {
          std::string terms;
          for (size_t i = 0; i < t->names.size(); ++i)
            if (t->coef_ms[i] > 0) terms += fmt::format(" {:.3g}*{}", t->coef_ms[i], t->names[i]);
          fmt::print("  {:<7} ms ={}   (max rel. error {:.1f}%)\n",
                     t == &entry.dense ? "dense" : "sparse", terms, 100 * t->max_rel_error);
        }
      }
      profile.put(std::move(entry));
      profile.save(o.out);  // after every entry: an interrupted run keeps what it finished
    }
    if (g_stop.load()) break;
  }
  progress.finish();
  if (g_stop.load()) {
    std::fprintf(stderr, "dsakit calibrate: interrupted; %s holds the %zu finished entries\n",
                 o.out.c_str(), profile.entries.size());
    return kExitInterrupted;
  }
  if (!o.quiet)
    fmt::print("wrote {} ({} entries); use it with --profile {} or DSAKIT_PROFILE={}\n", o.out,
               profile.entries.size(), o.out, o.out);
  return 0;
}

}  // namespace dsakit::cli
