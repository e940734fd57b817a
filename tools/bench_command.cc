// `dsakit bench` and `dsakit calibrate`: whole-layer timings per dispatch mode over a grid of
// shapes (docs/design.md#benchmarks), and the cost-model fit that cost-mode dispatch reads
// (docs/dispatch.md#cost-mode). The flow of both commands (options, measurement loop, Ctrl-C) is
// here; the shapes are bench_grid.cc, bench's JSON, table and summary bench_results.cc, the timing
// measure.cc.
#include "tools/bench_command.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "tools/bench_grid.h"
#include "tools/bench_results.h"
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

// "a,b,c": each item parsed by `parse`; `empty_error` when there is none.
template <typename Parse>
auto parse_list(const std::string& text, Parse parse, const char* empty_error) {
  std::vector<decltype(parse(text))> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(parse(item));
  DSAKIT_CHECK_ARG(!out.empty(), empty_error);
  return out;
}

std::vector<KvLayout> parse_layouts(const std::string& text) {
  return parse_list(text, parse_kv_layout, "--kv: expected a list of bf16, fp8, fp8-raw");
}

std::string default_models(const Backend& be) {
  // H per rank 128/16 (DeepSeek-V3.2, tp 1/8) and 64/16 (GLM-5, tp 1/4); the CPU only the
  // 16-head shards (minutes, not hours, on a few cores).
  return be.device() == Device::kCpu ? "deepseek-v3.2:8,glm-5:4"
                                     : "deepseek-v3.2:1,deepseek-v3.2:8,glm-5:1,glm-5:4";
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
  // Clears the rewritten line before a line on stdout.
  void clear() const {
    if (enabled && tty) std::fprintf(stderr, "\r\033[K");
  }
  void finish() const {
    if (enabled && tty) std::fprintf(stderr, "\n");
  }
};

// A timed mode: a dispatch mode, on the bench's layers or ("masked") on layers fixed to the
// masked-MHA form.
struct BenchMode {
  std::string name;  // dense | sparse | masked | rule | cost: the rows' key
  DispatchMode mode;
  bool masked_form = false;
};
const BenchMode kDenseMode{"dense", DispatchMode::kDense},
    kSparseMode{"sparse", DispatchMode::kSparse},
    kMaskedMode{"masked", DispatchMode::kSparse, true};

BenchMode parse_bench_mode(const std::string& name) {
  if (name == "masked") return kMaskedMode;
  for (DispatchMode m :
       {DispatchMode::kDense, DispatchMode::kSparse, DispatchMode::kRule, DispatchMode::kCost})
    if (name == to_string(m)) return {name, m};
  DSAKIT_FAIL(kInvalidArgument, "--modes: expected dense, sparse, masked, rule or cost, got '",
              name, "'");
}

// --modes: "dense,sparse,masked,rule,cost" in any order and subset.
std::vector<BenchMode> parse_modes(const std::string& text) {
  return parse_list(text, parse_bench_mode,
                    "--modes: expected a list of dense, sparse, masked, rule, cost");
}

// The policy every bench mode starts from: the profile (--profile, else DSAKIT_PROFILE) and the
// environment's overrides, applied once.
DispatchPolicy bench_policy(const std::string& profile) {
  DispatchPolicy base;
  if (!profile.empty()) base = base.with_profile(profile);
  base = base.with_env();
  base.overrides.clear();  // the policies are the bench's; env values were applied above
  return base;
}

// The modes that may run `shape` (mode_allowed) and their timings on `lb`, prepared for the
// shape here, each mode's policy `base` with its mode set. Stops early on Ctrl-C (g_stop).
struct ModeTimings {
  std::vector<BenchMode> modes;
  std::vector<PolicyTiming> timings;
};

ModeTimings time_modes(LayerBench& lb, const BenchShape& shape, const std::vector<BenchMode>& modes,
                       const DispatchPolicy& base, const Capabilities& caps, int runs, int min_runs,
                       double budget_ms, bool stages) {
  ModeTimings out;
  std::vector<TimedPolicy> policies;
  for (const BenchMode& m : modes) {
    if (!mode_allowed(m.mode, shape, lb.config(), caps)) continue;
    if (m.masked_form && !lb.has_masked_form()) continue;
    DispatchPolicy p = base;
    p.mode = m.mode;
    policies.push_back({p, m.masked_form});
    out.modes.push_back(m);
  }
  lb.prepare(shape);
  out.timings = lb.time(policies, runs, min_runs, budget_ms, stages, &g_stop);
  return out;
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
  const std::vector<BenchMode> modes = parse_modes(o.modes);
  auto be = open_backend(o.device, o.threads);
  const auto models = parse_model_list(o.models.empty() ? default_models(*be) : o.models);
  const auto layouts = parse_layouts(o.kv);
  const std::vector<BenchShape> shapes = bench_shapes(o, be->device());
  const DispatchPolicy base = bench_policy(o.profile);
  LayerBenchOptions lb_options;
  lb_options.fp8_weights = o.fp8_weights;
  lb_options.sparse_rows = parse_sparse_rows(o.sparse_rows);
  lb_options.sparse_form = parse_sparse_form(o.sparse_form);
  const std::string json_path =
      !o.json.empty() ? o.json : (!o.plot.empty() ? o.plot + ".json" : std::string());

  StopSignals signals;
  const auto& caps = be->capabilities();
  if (!o.quiet)
    fmt::print(stderr, "dsakit bench: {} | {} shapes x {} configs x {} layouts | modes {}{}{}\n",
               caps.device_name, shapes.size(), models.size(), layouts.size(), o.modes,
               base.profile != nullptr ? " | profile " + base.profile_path
                                       : " | no profile: cost mode falls back to rule mode",
               o.fp8_weights ? " | FP8 kv_b_proj on fp8 pools (w8)" : "");
  const Backend::Ceilings ceil = be->measure_ceilings();
  json doc = bench_document(*be, ceil, base, o);
  print_bench_header(caps.device_name, ceil);

  ProgressLine progress;
  progress.enabled = !o.quiet;
  const size_t total = shapes.size() * models.size() * layouts.size();
  size_t done = 0;
  for (const ModelConfig& cfg : models) {
    for (KvLayout layout : layouts) {
      LayerBench lb(*be, cfg, layout, o.seed, lb_options);
      const std::string group = lb.group();
      for (const BenchShape& shape : shapes) {
        if (g_stop.load()) break;
        progress(done, total, group + " | " + shape.kind + " " + shape.label());
        const ModeTimings t = time_modes(lb, shape, modes, base, caps, o.runs,
                                         std::min(o.min_runs, o.runs), o.budget_ms, o.stages);
        if (g_stop.load()) break;
        ++done;
        std::vector<std::string> names;
        for (const BenchMode& m : t.modes) names.push_back(m.name);
        doc["rows"].push_back(bench_row(lb, shape, names, t.timings, ceil.gemm_tflops));
        write_bench_json(json_path, doc);
        progress.clear();
        print_bench_row(doc["rows"].back());
      }
      if (g_stop.load()) break;
    }
    if (g_stop.load()) break;
  }
  progress.finish();
  const bool interrupted = g_stop.load();
  doc["complete"] = !interrupted;
  if (interrupted) doc["interrupted"] = true;
  doc["summary"] = summarize(doc["rows"]);
  write_bench_json(json_path, doc);
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

// The profile --out names, to merge the new entries into: empty when there is no such file or
// it is stale; anything else that is not a profile of this build is refused, never overwritten.
CostProfile profile_to_extend(const std::string& out) {
  if (!std::filesystem::exists(out)) return {};
  try {
    return CostProfile::load(out);
  } catch (const Error& e) {
    const std::string what = e.what();
    DSAKIT_CHECK_ARG(what.find("is stale") != std::string::npos, "--out ", out,
                     " exists and is not a dsakit cost profile this build can extend (", what,
                     "); choose another file or remove it");
    std::fprintf(stderr, "dsakit calibrate: %s exists but is stale; replacing it\n", out.c_str());
    return {};
  }
}

// Each path's fitted terms and its largest relative error over the calibration shapes.
void print_fit(const std::string& group, const CostEntry& entry) {
  fmt::print("{}: {} samples\n", group, entry.samples.size());
  for (const auto& [name, t] :
       {std::pair{"dense", &entry.dense}, std::pair{"sparse", &entry.sparse},
        std::pair{"masked", &entry.masked}}) {
    if (t->names.empty()) continue;  // masked: not calibrated
    std::string terms;
    for (size_t i = 0; i < t->names.size(); ++i)
      if (t->coef_ms[i] > 0) terms += fmt::format(" {:.3g}*{}", t->coef_ms[i], t->names[i]);
    fmt::print("  {:<7} ms ={}   (max rel. error {:.1f}%)\n", name, terms, 100 * t->max_rel_error);
  }
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

  CostProfile profile = profile_to_extend(o.out);

  StopSignals signals;
  ProgressLine progress;
  progress.enabled = !o.quiet;
  size_t total = 0, done = 0;
  // Fresh prompts beyond index_topk on GPUs only (a CPU takes seconds per call there).
  const bool long_prompts = caps.device == Device::kCuda;
  for (const auto& cfg : models)
    total += calibration_shapes(cfg.index_topk, long_prompts).size() * layouts.size();
  for (const ModelConfig& cfg : models) {
    DSAKIT_CHECK(mode_allowed(DispatchMode::kDense, {"fresh", {0}, {1}}, cfg, caps), kUnsupported,
                 "calibrate: ", caps.device_name, " has no dense MHA kernel for ", cfg.name,
                 " (d_nope/d_rope/d_v = ", cfg.qk_nope_head_dim, "/", cfg.qk_rope_head_dim, "/",
                 cfg.v_head_dim, "): cost mode has nothing to choose there");
    for (KvLayout layout : layouts) {
      // The sparse path in both forms where the backend has the masked kernel (the bench's
      // layers, whose auto form is MLA when sparse is forced, and its masked-MHA layers),
      // interleaved with dense.
      LayerBench lb(*be, cfg, layout, o.seed);
      const std::string group = lb.group();
      std::vector<CostSample> samples;
      for (const BenchShape& shape : calibration_shapes(cfg.index_topk, long_prompts)) {
        if (g_stop.load()) break;
        progress(done++, total, "calibrate " + group + " | " + shape.label());
        const ModeTimings t = time_modes(lb, shape, {kDenseMode, kSparseMode, kMaskedMode},
                                         DispatchPolicy{}, caps, o.runs, 3, o.budget_ms, true);
        if (g_stop.load()) break;
        for (const PolicyTiming& pt : t.timings)
          samples.push_back({pt.plan.path, CostFeatures::of(lb.batch(), cfg), pt.ms, pt.stages,
                             pt.plan.sparse_form});
      }
      if (g_stop.load()) break;
      CostEntry entry = fit_cost_entry(CostKey::of(caps.device_name, cfg, layout), samples);
      entry.created = today();
      progress.finish();
      if (!o.quiet) print_fit(group, entry);
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
