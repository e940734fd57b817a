#include "tools/run_command.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "dsakit/safetensors.h"
#include "tools/cli_common.h"
#include "tools/harness.h"
#include "tools/run_file.h"
#include "tools/run_state.h"
#include "tools/run_verify.h"

namespace dsakit::cli {

namespace {

using json = nlohmann::json;

// A progress line on stderr for long runs (a terminal, or more than 4096 tokens).
struct Progress {
  bool enabled = false;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  std::string label;
  void operator()(int64_t done, int64_t total) const {
    if (!enabled) return;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "\r[dsakit] %s: %lld/%lld tokens (%.1f s)%s", label.c_str(),
                 (long long)done, (long long)total, s, done == total ? "\n" : "");
    std::fflush(stderr);
  }
};

// Memory of a run: what the pools hold, the largest layer-call workspace (the layer's estimate
// over every step run) and the process's peak resident set.
struct MemoryReport {
  int64_t pool_bytes = 0;
  int64_t peak_workspace_bytes = 0;
  int64_t device_held_bytes = 0;  // the backend's device memory after the steps (their peak)
  int64_t max_rss_bytes = 0;
};

int64_t max_rss_bytes() {
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return int64_t(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

double mib(int64_t bytes) {
  return double(bytes) / double(1 << 20);
}

void print_run_header(const RunOptions& opt, const RunState& run) {
  fmt::print("model    {}\n", run.cfg.summary());
  fmt::print("device   {}\n", run.be->capabilities().device_name);
  fmt::print("kv pool  {}\n", run.kd.summary());
  if (run.kv_b_proj_fp8_host.codes.defined())
    fmt::print("weights  kv_b_proj bf16 and FP8 (e4m3, 128x128 block scales){}\n",
               opt.inputs.empty() ? " random" : " from " + opt.inputs);
  fmt::print("batch    prompts [{}] cached prefix [{}] chunk {} decode steps {}  sm_scale {:.6g}\n",
             join_int_list(run.len.prompt), join_int_list(run.len.prefix), opt.chunk,
             run.len.decode_steps, run.layer->sm_scale());
}

// The plans the steps after the cached prefix took, with how many steps each, and their summed
// stage times, in first-seen order.
struct StepSummary {
  std::map<std::string, double> stage_ms;
  std::vector<std::string> stage_order;
  std::map<std::string, int> plans;  // "path | reason" -> steps
  std::vector<std::string> plan_order;

  std::string plan_text() const {  // one plan a line
    std::string text;
    for (const auto& p : plan_order) {
      if (!text.empty()) text += '\n';
      text += p;
    }
    return text;
  }
};

StepSummary summarize_steps(const RunState& run) {
  StepSummary sum;
  for (size_t i = run.prefix_steps; i < run.out.steps.size(); ++i) {
    const auto& st = run.out.steps[i];
    const std::string key = std::string(to_string(st.plan.path)) + " | " + st.plan.reason;
    if (!sum.plans.count(key)) sum.plan_order.push_back(key);
    sum.plans[key]++;
    for (const auto& sg : st.stages) {
      if (!sum.stage_ms.count(sg.stage)) sum.stage_order.push_back(sg.stage);
      sum.stage_ms[sg.stage] += sg.ms;
    }
  }
  return sum;
}

// Pool bytes and the largest per-call workspace estimate (max RSS is taken at the end).
MemoryReport memory_report(const RunState& run) {
  MemoryReport mem;
  mem.pool_bytes =
      int64_t(run.kv_pool.storage().nbytes()) + int64_t(run.index_pool.storage().nbytes());
  for (const auto& st : run.out.steps)
    mem.peak_workspace_bytes =
        std::max(mem.peak_workspace_bytes, run.layer->workspace_bytes(st.batch, st.plan));
  return mem;
}

void print_run_json(const RunOptions& opt, const RunState& run, const StepSummary& steps,
                    const MemoryReport& mem, const VerifyResult& vr) {
  json j;
  j["model"] = json::parse(run.cfg.to_json());
  j["device"] = run.be->capabilities().device_name;
  j["kv_layout"] = to_string(run.kd.layout);
  j["weights"] = run.kv_b_proj_fp8_host.codes.defined() ? "bf16+fp8" : "bf16";
  j["page_size"] = opt.page_size;
  j["prompts"] = run.len.prompt;
  j["prefix"] = run.len.prefix;
  j["chunk"] = opt.chunk;
  j["decode_steps"] = run.len.decode_steps;
  j["sm_scale"] = run.layer->sm_scale();
  j["sparse_rows"] = to_string(run.layer->options().sparse_rows);
  j["sparse_form"] = to_string(run.layer->options().sparse_form);
  j["plans"] = json::array();
  for (const auto& p : steps.plan_order)
    j["plans"].push_back({{"plan", p}, {"steps", steps.plans.at(p)}});
  j["stages_ms"] = json::object();
  for (const auto& s : steps.stage_order) j["stages_ms"][s] = steps.stage_ms.at(s);
  j["wall_ms"] = run.wall_ms;
  j["memory"] = {{"pool_bytes", mem.pool_bytes},
                 {"peak_layer_workspace_bytes", mem.peak_workspace_bytes},
                 {"device_held_bytes", mem.device_held_bytes},
                 {"max_rss_bytes", mem.max_rss_bytes}};
  if (opt.verify)
    j["verify"] = {{"tokens", vr.tokens},
                   {"sparse_tokens", vr.sparse_tokens},
                   {"o_rel_l2", vr.o_rel},
                   {"lse_max_abs", vr.lse_abs},
                   {"topk_agreement", vr.topk_agree},
                   {"tolerance", vr.tol},
                   {"lse_tolerance", vr.lse_tol},
                   {"pass", vr.pass}};
  if (!opt.save.empty()) j["saved"] = opt.save;
  fmt::print("{}\n", j.dump(2));
}

void print_run_text(const RunOptions& opt, const RunState& run, const StepSummary& steps,
                    const MemoryReport& mem, const VerifyResult& vr) {
  fmt::print("plan\n");
  for (const auto& p : steps.plan_order) fmt::print("  {:>4} step(s)  {}\n", steps.plans.at(p), p);
  // One pass: a stage's first call in the process carries one-time setup (the GEMM library's,
  // measured in docs/perf.md), which warm timings exclude.
  fmt::print(
      "stages (ms, summed over steps; first calls include one-time setup such as the GEMM "
      "library's; dsakit bench times warm calls)\n");
  double sum = 0;
  for (const auto& s : steps.stage_order) {
    fmt::print("  {:<18} {:>10.3f}\n", s, steps.stage_ms.at(s));
    sum += steps.stage_ms.at(s);
  }
  fmt::print("  {:<18} {:>10.3f}   (wall {:.1f} ms incl. host staging)\n", "total", sum,
             run.wall_ms);
  fmt::print(
      "memory   pools {:.1f} MiB, layer workspace {:.1f} MiB (peak estimate over steps), device "
      "held {:.1f} MiB (peak), max RSS {:.1f} MiB\n",
      mib(mem.pool_bytes), mib(mem.peak_workspace_bytes), mib(mem.device_held_bytes),
      mib(mem.max_rss_bytes));
  if (opt.verify)
    fmt::print(
        "verify   {} tokens ({} via top-k): o rel-L2 {:.3e} (tol {:.1e}), lse max abs {:.3e} "
        "(tol {:.0e}), top-k sets equal {:.1f}%  -> {}\n",
        vr.tokens, vr.sparse_tokens, vr.o_rel, vr.tol, vr.lse_abs, vr.lse_tol, 100 * vr.topk_agree,
        vr.pass ? "PASS" : "FAIL");
  if (!opt.save.empty()) fmt::print("saved    {}\n", opt.save);
}

}  // namespace

// The options checked before anything is read or allocated.
void check_run_options(const RunOptions& opt) {
  DSAKIT_CHECK_ARG(opt.page_size >= 1 && opt.page_size <= 4096,
                   "--page-size: expected 1..4096, got ", opt.page_size);
  DSAKIT_CHECK_ARG(opt.chunk >= 0, "--chunk: expected >= 0, got ", opt.chunk);
  DSAKIT_CHECK_ARG(opt.decode_steps >= 0 && opt.decode_steps <= 100000,
                   "--decode-steps: expected 0..100000, got ", opt.decode_steps);
  DSAKIT_CHECK_ARG(opt.verify_tokens >= 1, "--verify-tokens: expected >= 1, got ",
                   opt.verify_tokens);
  DSAKIT_CHECK_ARG(opt.verify_tol >= 0 && opt.verify_tol < 1, "--verify-tol: expected [0, 1), got ",
                   opt.verify_tol);
  DSAKIT_CHECK_ARG(!opt.fp8_weights || opt.dcp == 0,
                   "--fp8-weights: not offered with --dcp (its ranks draw bf16 weights)");
  DSAKIT_CHECK_ARG(opt.sparse_form == "mla" || opt.sparse_form == "auto" || opt.dcp == 0,
                   "--sparse-form: with --dcp the ranks run mla (their top-k merge combines MLA "
                   "partials), got '",
                   opt.sparse_form, "'");
  DSAKIT_CHECK_ARG(opt.max_workspace_mb >= 0 && opt.max_workspace_mb <= (int64_t(1) << 40),
                   "--max-workspace-mb: expected 0..2^40 (0: no limit), got ",
                   opt.max_workspace_mb);
}

// The lengths of the run: from the --inputs file's metadata (the file is read into `in_file`)
// or from the options; checked.
RunLengths run_lengths(const RunOptions& opt, SafetensorsFile& in_file) {
  RunLengths len;
  if (!opt.inputs.empty()) {
    in_file = SafetensorsFile::read(opt.inputs);
    len = read_run_lengths(in_file, opt.inputs);
  } else {
    len.prompt = parse_int_list(opt.prompts, "--prompts", 1);
    len.prefix = opt.prefix.empty() ? std::vector<int32_t>(len.prompt.size(), 0)
                                    : parse_int_list(opt.prefix, "--prefix", 0);
    len.decode_steps = opt.decode_steps;
  }
  const size_t b = len.prompt.size();
  DSAKIT_CHECK_ARG(b >= 1 && b <= 4096, "--prompts: expected 1..4096 requests, got ", b);
  DSAKIT_CHECK_ARG(len.prefix.size() == b, "--prefix: expected ", b,
                   " values (one per prompt), got ", len.prefix.size());
  int64_t total_tokens = 0;
  for (size_t r = 0; r < b; ++r) {
    DSAKIT_CHECK_ARG(len.prompt[r] >= 1, "--prompts: request ", r, " has length 0");
    DSAKIT_CHECK_ARG(len.prefix[r] < len.prompt[r], "--prefix: request ", r, " prefix ",
                     len.prefix[r], " must be shorter than its prompt ", len.prompt[r]);
    total_tokens += int64_t(len.prompt[r]) + len.decode_steps;
    DSAKIT_CHECK_ARG(int64_t(len.prompt[r]) + len.decode_steps <= (int64_t(1) << 24),
                     "--prompts: request ", r, " length exceeds 16M tokens");
  }
  DSAKIT_CHECK_ARG(total_tokens <= (int64_t(1) << 24), "--prompts: ", total_tokens,
                   " tokens in total exceed the 16M-token limit of one run");
  return len;
}

// The backend, the inputs (random or from --inputs), the pools with their page tables, and the
// layer.
void set_up_run(const RunOptions& opt, RunState& run) {
  const ModelConfig& cfg = run.cfg;
  run.be = opt.device == "cpu" ? make_cpu_backend(opt.threads) : make_backend(opt.device);
  if (!opt.inputs.empty()) {
    // The file's weights, in FP8 too where it has them (--fp8-weights then only asserts so).
    run.tokens =
        read_run_inputs(run.in_file, cfg, run.len, run.kv_b_proj_host, run.kv_b_proj_fp8_host);
    DSAKIT_CHECK_ARG(!opt.fp8_weights || run.kv_b_proj_fp8_host.codes.defined(),
                     "--fp8-weights with --inputs: ", opt.inputs,
                     " has no kv_b_proj_fp8 / kv_b_proj_fp8_scales (its kv_b_proj is bf16 only)");
  } else {
    run.tokens = random_token_store(cfg, run.len.total(), opt.seed);
    if (opt.fp8_weights) {
      run.kv_b_proj_fp8_host = random_fp8_kv_b_proj(cfg, opt.seed + 1);
      run.kv_b_proj_host = run.kv_b_proj_fp8_host.bf16;
    } else {
      run.kv_b_proj_host = random_kv_b_proj(cfg, opt.seed + 1);
    }
  }
  set_up_layer(opt, run);
}

void set_up_layer(const RunOptions& opt, RunState& run) {
  const ModelConfig& cfg = run.cfg;
  run.kv_b_proj = run.be->to_device(run.kv_b_proj_host);
  KvPoolDesc& kd = run.kd = run_pool_desc(opt, cfg);
  int64_t pages = 0;
  for (int32_t l : run.tokens.lengths) pages += (l + opt.page_size - 1) / opt.page_size;
  kd.num_pages = pages + 4;  // a few spare pages nobody owns
  run.kv_pool = run.be->make_kv_pool(kd);
  run.index_pool = run.be->make_index_pool({opt.page_size, kd.num_pages, cfg.index_head_dim});
  run.tables = allocate_pages(run.tokens.lengths, opt.page_size, kd.num_pages, opt.seed + 2);

  LayerOptions lo = run_layer_options(opt);
  if (run.kv_b_proj_fp8_host.codes.defined()) {
    run.kv_b_proj_codes = run.be->to_device(run.kv_b_proj_fp8_host.codes);
    run.kv_b_proj_scales = run.be->to_device(run.kv_b_proj_fp8_host.scales);
    lo.kv_b_proj_fp8 = {run.kv_b_proj_codes, run.kv_b_proj_scales};
  }
  run.layer =
      std::make_unique<DsaAttention>(cfg, *run.be, run.kv_pool, run.index_pool, run.kv_b_proj, lo);
}

KvPoolDesc run_pool_desc(const RunOptions& opt, const ModelConfig& cfg) {
  KvPoolDesc kd;
  kd.layout = parse_kv_layout(opt.kv);
  kd.page_size = opt.page_size;
  kd.d_c = cfg.kv_lora_rank;
  kd.d_rope = cfg.qk_rope_head_dim;
  kd.scale_policy = parse_scale_policy(opt.scale_policy);
  kd.k_scale = float(opt.k_scale);
  return kd;
}

LayerOptions run_layer_options(const RunOptions& opt) {
  LayerOptions lo;
  lo.sm_scale = opt.sm_scale;
  lo.policy.mode = parse_dispatch_mode(opt.dispatch);
  lo.policy.threshold = opt.threshold;
  lo.policy.allow_approximation = opt.allow_approx;
  if (!opt.profile.empty()) lo.policy = lo.policy.with_profile(opt.profile);
  lo.time_stages = true;
  lo.max_workspace_bytes = opt.max_workspace_mb << 20;
  lo.sparse_rows = parse_sparse_rows(opt.sparse_rows);
  lo.sparse_form = parse_sparse_form(opt.sparse_form);
  return lo;
}

StepsResult run_steps(const RunOptions& opt, const RunLengths& len, const ModelConfig& cfg,
                      Backend& be, const LayerForward& forward,
                      const std::vector<std::vector<int32_t>>& tables, const TokenStore& tokens,
                      RunOutputs& out) {
  const size_t b = len.prompt.size();
  StepsResult result;
  Progress progress;
  progress.enabled = !opt.quiet && !opt.json && (isatty(2) || tokens.rows() > 4096);
  std::vector<int32_t> zeros(b, 0), prompt_end(len.prompt);
  const auto t0 = std::chrono::steady_clock::now();
  if (std::any_of(len.prefix.begin(), len.prefix.end(), [](int32_t p) { return p > 0; })) {
    progress.label = "cached prefix";
    run_schedule(cfg, be, forward, tables, tokens, {zeros, len.prefix, 0, ForwardMode::kExtend},
                 out, progress);
    std::fill(out.ran.begin(), out.ran.end(), 0);  // prefix rows are setup, not results
    result.prefix_steps = out.steps.size();
  }
  progress.label = "prefill";
  run_schedule(cfg, be, forward, tables, tokens,
               {len.prefix, prompt_end, opt.chunk, ForwardMode::kExtend}, out, progress);
  for (int s = 0; s < len.decode_steps; ++s) {
    std::vector<int32_t> a(b), e(b);
    for (size_t r = 0; r < b; ++r) a[r] = len.prompt[r] + s, e[r] = a[r] + 1;
    progress.label = "decode";
    run_schedule(cfg, be, forward, tables, tokens, {a, e, 1, ForwardMode::kDecode}, out);
  }
  result.wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

// The run: the cached prefix (one call), the rest of each prompt (in --chunk pieces), then the
// decode steps, all into run.out.
void run_layer_steps(const RunOptions& opt, RunState& run) {
  DsaAttention& layer = *run.layer;
  const LayerForward forward = [&](const Batch& batch, const std::vector<int32_t>&,
                                   const LayerInputs& inputs) {
    return layer.forward(batch, inputs);
  };
  const StepsResult r =
      run_steps(opt, run.len, run.cfg, *run.be, forward, run.tables, run.tokens, run.out);
  run.prefix_steps = r.prefix_steps;
  run.wall_ms = r.wall_ms;
}

int run_command(const RunOptions& opt) {
  RunState run;
  run.cfg = load_model(opt.model, opt.tp);
  check_run_options(opt);
  run.len = run_lengths(opt, run.in_file);
  set_up_run(opt, run);
  if (!opt.quiet && !opt.json) print_run_header(opt, run);
  std::fflush(stdout);

  run_layer_steps(opt, run);
  const StepSummary steps = summarize_steps(run);
  MemoryReport mem = memory_report(run);
  mem.device_held_bytes = run.be->device_bytes_held();  // the steps' peak, before verify
  VerifyResult vr;
  if (opt.verify) vr = verify_run(opt, run);
  if (!opt.save.empty()) write_run_file(opt.save, opt, run, steps.plan_text());
  mem.max_rss_bytes = max_rss_bytes();  // after verify and save: the whole run's peak

  if (opt.json)
    print_run_json(opt, run, steps, mem, vr);
  else if (!opt.quiet)
    print_run_text(opt, run, steps, mem, vr);
  return vr.pass ? 0 : kExitVerifyFailed;
}

}  // namespace dsakit::cli
