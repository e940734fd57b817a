// dsakit: the command line. Subcommands: run, plan, bench, calibrate, info. run_cli() is main()
// without the process: the fuzz target fuzz/fuzz_cli.cc calls it in-process.
#include "tools/cli_app.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "dsakit/plan.h"
#include "src/layer/paths.h"
#include "tools/bench_command.h"
#include "tools/cli_common.h"
#include "tools/dcp_command.h"
#include "tools/run_command.h"

namespace dsakit::cli {
namespace {

struct PlanOptions {
  std::string model = "deepseek-v3.2";
  int tp = 8;
  std::string device = "cuda";
  int arch = 90;
  std::string kv = "fp8";
  std::string prompts = "1500,700";
  std::string prefix;
  std::string mode = "extend";
  bool speculative = false, cuda_graph = false, context_parallel = false, hisparse = false;
  std::string dispatch = "rule";
  std::string profile, device_name;
  int64_t threshold = -1;
  bool allow_approx = false;
  int64_t chunk_capacity = 131072;
  std::string sparse_form = "auto";
  bool json = false;
};

int plan_command(const PlanOptions& o) {
  const ModelConfig cfg = load_model(o.model, o.tp);
  const auto total = parse_int_list(o.prompts, "--prompts", 1);
  const auto prefix = o.prefix.empty() ? std::vector<int32_t>(total.size(), 0)
                                       : parse_int_list(o.prefix, "--prefix", 0);
  DSAKIT_CHECK_ARG(prefix.size() == total.size(), "--prefix: expected ", total.size(),
                   " values (one per prompt), got ", prefix.size());
  Batch batch;
  batch.mode = parse_forward_mode(o.mode);
  for (size_t r = 0; r < total.size(); ++r) {
    DSAKIT_CHECK_ARG(prefix[r] < total[r], "--prefix: request ", r, " prefix ", prefix[r],
                     " must be shorter than its length ", total[r]);
    batch.prefix_lens.push_back(prefix[r]);
    batch.extend_lens.push_back(total[r] - prefix[r]);
  }
  batch.speculative = o.speculative;
  batch.cuda_graph = o.cuda_graph;
  batch.context_parallel = o.context_parallel;
  batch.hierarchical_sparse_cache = o.hisparse;
  Capabilities caps;
  if (o.device == "cpu") {
    caps = make_cpu_backend()->capabilities();
  } else if (o.device == "cuda") {
    DSAKIT_CHECK_ARG(o.arch >= 50 && o.arch <= 200, "--arch: expected an sm number like 90, got ",
                     o.arch);
    caps = cuda_capabilities(o.arch);
    // A profile is keyed by the GPU's name: take it from the device when one is visible.
    if (o.device_name.empty() && cuda_device_count() > 0)
      caps.device_name = make_cuda_backend(0)->capabilities().device_name;
  } else {
    DSAKIT_FAIL(kInvalidArgument, "--device: expected cpu or cuda, got '", o.device, "'");
  }
  DispatchPolicy policy;
  policy.mode = parse_dispatch_mode(o.dispatch);
  policy.threshold = o.threshold;
  policy.allow_approximation = o.allow_approx;
  policy.chunk_capacity = o.chunk_capacity;
  if (!o.profile.empty()) policy = policy.with_profile(o.profile);
  if (!o.device_name.empty()) caps.device_name = o.device_name;
  // The form as a layer would take it: DSAKIT_SPARSE_FORM overrides the flag.
  const SparseForm form = detail::sparse_form_from_env(parse_sparse_form(o.sparse_form));
  const Plan plan = plan_batch(batch, cfg, parse_kv_layout(o.kv), caps, policy.with_env(), form);
  if (o.json) {
    nlohmann::json j = {{"path", to_string(plan.path)},
                        {"mode", to_string(plan.mode)},
                        {"rule", plan.rule},
                        {"approximate", plan.approximate},
                        {"sparse_form", to_string(plan.sparse_form)},
                        {"reason", plan.reason}};
    for (const auto& s : plan.segments)
      j["segments"].push_back({{"first_request", s.first_request},
                               {"num_requests", s.num_requests},
                               {"path", to_string(s.path)}});
    if (plan.predicted_ms >= 0)
      j["predicted_ms"] = {{"dense", plan.predicted_dense_ms},
                           {"sparse", plan.predicted_sparse_ms},
                           {"masked", plan.predicted_masked_ms},
                           {"plan", plan.predicted_ms}};
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("{}: {}\n", to_string(plan.path), plan.reason);
  }
  return 0;
}

int info_command() {
  fmt::print("dsakit {}\n", DSAKIT_VERSION);
  fmt::print("backends: cpu{}\n", cuda_backend_compiled() ? ", cuda (sm_90a)" : "");
  auto cpu = make_cpu_backend();
  fmt::print("  cpu   {} (dense MHA: yes; any head dims; FP8 up-projection: {})\n",
             cpu->capabilities().device_name, cpu->capabilities().fp8_up_proj ? "yes" : "no");
  const int n = cuda_device_count();
  if (!cuda_backend_compiled()) {
    fmt::print("  cuda  not built (no nvcc at configure time)\n");
  } else if (n == 0) {
    fmt::print("  cuda  built for sm_90a; no GPU visible\n");
  } else {
    for (int i = 0; i < n; ++i) {
      try {
        auto be = make_cuda_backend(i);
        const auto& c = be->capabilities();
        fmt::print("  cuda:{} {} (sm_{}, dense MHA: {}, FP8 up-projection: {})\n", i, c.device_name,
                   c.sm_arch, c.dense_mha ? "yes" : "no", c.fp8_up_proj ? "yes" : "no");
      } catch (const Error& e) {
        fmt::print("  cuda:{} unusable: {}\n", i, e.what());
      }
    }
  }
  fmt::print("kernels: CPU: any head dims and pool layout; CUDA (sm_90a build):\n");
  for (const std::string& family : cuda_capabilities(90).kernel_instances)
    fmt::print("  {}\n", family);
  fmt::print("presets:");
  for (const auto& p : ModelConfig::preset_names()) fmt::print(" {}", p);
  fmt::print("\n");
  return 0;
}

void add_model_flags(CLI::App* app, std::string& model, int& tp) {
  app->add_option("--model", model,
                  "Model: a preset (deepseek-v3.2, glm-5) or a Hugging Face config.json path")
      ->capture_default_str();
  app->add_option("--tp", tp, "Tensor-parallel size: each rank holds H/tp attention heads")
      ->capture_default_str();
}

}  // namespace

int run_cli(int argc, char** argv) {
  CLI::App app{
      "dsakit: DeepSeek Sparse Attention prefill (sparse MLA and dense MHA) over a paged MLA KV "
      "cache.\nExit codes: 0 ok, 1 verification failed, 2 bad usage or input, 3 device/runtime "
      "error."};
  app.require_subcommand(1);
  app.set_version_flag("--version", DSAKIT_VERSION);

  RunOptions ro;
  CLI::App* run = app.add_subcommand(
      "run",
      "Run one batch through the DSA layer: store the new tokens in the paged pool, plan "
      "(dense MHA or sparse MLA), compute, print the plan's reason and per-stage times.\n"
      "Examples:\n  dsakit run --verify\n  dsakit run --model glm-5 --tp 4 --kv bf16 "
      "--prompts 3000 --chunk 1024 --verify\n  dsakit run --prompts 1900 --prefix 1850 "
      "--decode-steps 4 --verify --save run.safetensors");
  add_model_flags(run, ro.model, ro.tp);
  run->add_option("--device", ro.device, "cpu | cuda | auto (cuda when a GPU is present)")
      ->capture_default_str();
  run->add_option("--threads", ro.threads, "CPU threads (0: all cores)");
  run->add_option("--kv", ro.kv, "Pool layout: bf16 (1152 B/token), fp8 (656 B), fp8-raw (576 B)")
      ->capture_default_str();
  run->add_option("--scale-policy", ro.scale_policy,
                  "fp8 pool scales: pow2 (FlashMLA's rule) | amax (docs/formats.md)")
      ->capture_default_str();
  run->add_option("--k-scale", ro.k_scale, "fp8-raw pool scale")->capture_default_str();
  run->add_option("--page-size", ro.page_size, "Tokens per page")->capture_default_str();
  CLI::Option* prompts =
      run->add_option("--prompts", ro.prompts, "Prompt length per request (prefix included)")
          ->capture_default_str();
  CLI::Option* prefix = run->add_option(
      "--prefix", ro.prefix,
      "Cached prefix per request: stored by an earlier call, re-read from the pool (prefix hit)");
  run->add_option("--chunk", ro.chunk, "Chunked prefill: tokens per request per call (0: one call)")
      ->capture_default_str();
  CLI::Option* decode = run->add_option("--decode-steps", ro.decode_steps,
                                        "Decode steps after the prefill (always sparse MLA)")
                            ->capture_default_str();
  run->add_option("--dispatch", ro.dispatch, "rule | cost | dense | sparse")->capture_default_str();
  run->add_option("--profile", ro.profile,
                  "Cost-mode profile written by dsakit calibrate (or set DSAKIT_PROFILE)");
  run->add_option("--threshold", ro.threshold,
                  "Dense MHA when max prefix+extend <= this (default: index_topk)");
  run->add_flag("--allow-approx", ro.allow_approx,
                "Allow dense MHA above index_topk (an approximation of the model)");
  run->add_option("--sm-scale", ro.sm_scale, "Softmax scale (default: from the config)");
  run->add_option("--seed", ro.seed, "Seed of the random inputs")->capture_default_str();
  run->add_flag("--verify", ro.verify,
                "Check sampled tokens against the float64 reference (exit 1 on failure)");
  run->add_option("--verify-tokens", ro.verify_tokens, "Tokens per request checked by --verify")
      ->capture_default_str();
  run->add_option("--verify-tol", ro.verify_tol,
                  "rel-L2 bound on o for --verify (default: 1e-2 bf16 pool, 3e-2 fp8 pools)");
  run->add_flag("--fp8-weights", ro.fp8_weights,
                "Give the layer kv_b_proj's FP8 checkpoint form too (e4m3, 128x128 block scales; "
                "random, bf16-exact): with an fp8 / fp8-raw pool (CPU, or CUDA sm_90) the dense "
                "path's K/V up-projection runs as an FP8 GEMM on the pool's codes. --inputs "
                "files that hold kv_b_proj_fp8 use it with or without this flag (with it, the "
                "file must hold it)");
  run->add_option("--inputs", ro.inputs,
                  "Read the inputs (and lengths) from a safetensors file written by --save");
  run->add_option("--save", ro.save, "Write inputs, outputs and pool rows to a safetensors file");
  run->add_flag("--json", ro.json, "Print a JSON report instead of the table");
  run->add_flag("--quiet", ro.quiet, "Print nothing but errors");
  run->add_option("--dcp", ro.dcp,
                  "Context parallelism over W GPUs of this host: one process per GPU over NCCL, "
                  "position p on rank p % W; with --verify, also against one GPU and the float64 "
                  "reference (docs/layer.md)");
  run->add_option("--max-workspace-mb", ro.max_workspace_mb,
                  "Refuse a layer call whose workspace estimate exceeds this many MiB (0: no "
                  "limit); exit 3 before the call computes anything");
  run->add_option("--sparse-rows", ro.sparse_rows,
                  "How the sparse path reads an fp8 / fp8-raw pool: auto (a bf16 copy of the "
                  "context rows where the GPU reads those faster and each is read often: "
                  "prefill), pool, or staged (docs/layer.md#staged-rows); DSAKIT_SPARSE_ROWS "
                  "overrides it")
      ->capture_default_str();
  run->add_option("--sparse-form", ro.sparse_form,
                  "How the sparse path attends to the top-k: mla (absorbed MLA over the selected "
                  "rows), masked-mha (the top-k as a mask over dense MHA of every context row: "
                  "the same function, causal work at dense MHA's cheaper per-pair cost), or auto "
                  "(--dispatch cost picks the cheaper per batch where its profile prices both; "
                  "mla otherwise); docs/layer.md#masked-mha; DSAKIT_SPARSE_FORM overrides it")
      ->capture_default_str();

  PlanOptions po;
  CLI::App* plan = app.add_subcommand(
      "plan",
      "Print the dispatcher's decision and its reason for a described batch (runs nothing)");
  add_model_flags(plan, po.model, po.tp);
  plan->add_option("--device", po.device, "cpu | cuda")->capture_default_str();
  plan->add_option("--arch", po.arch, "CUDA compute capability as sm number (90, 100)")
      ->capture_default_str();
  plan->add_option("--kv", po.kv, "Pool layout: bf16, fp8, fp8-raw")->capture_default_str();
  plan->add_option("--prompts", po.prompts, "Length per request (prefix included)")
      ->capture_default_str();
  plan->add_option("--prefix", po.prefix, "Cached prefix per request");
  plan->add_option("--mode", po.mode, "extend | decode | target-verify | draft-extend")
      ->capture_default_str();
  plan->add_flag("--speculative", po.speculative, "Extend with speculative decoding");
  plan->add_flag("--cuda-graph", po.cuda_graph, "Capturing or replaying a CUDA graph");
  plan->add_flag("--context-parallel", po.context_parallel, "Prefill context parallelism on");
  plan->add_flag("--hisparse", po.hisparse, "A host-offloaded sparse KV cache is attached");
  plan->add_option("--dispatch", po.dispatch, "rule | cost | dense | sparse")
      ->capture_default_str();
  plan->add_option("--profile", po.profile,
                   "Cost-mode profile written by dsakit calibrate (or set DSAKIT_PROFILE)");
  plan->add_option("--device-name", po.device_name,
                   "Device name a profile entry is keyed by (default: this machine's GPU for "
                   "cuda, its CPU backend for cpu)");
  plan->add_option("--threshold", po.threshold, "Dense threshold (default: index_topk)");
  plan->add_flag("--allow-approx", po.allow_approx, "Allow a threshold above index_topk");
  plan->add_option("--chunk-capacity", po.chunk_capacity, "Max total tokens for dense")
      ->capture_default_str();
  plan->add_option("--sparse-form", po.sparse_form,
                   "The layer's sparse form option: auto (cost mode with a profile that prices "
                   "both forms picks), mla or masked-mha; DSAKIT_SPARSE_FORM overrides it")
      ->capture_default_str();
  plan->add_flag("--json", po.json, "Print JSON");

  BenchOptions bo;
  CLI::App* bench = app.add_subcommand(
      "bench",
      "Time the whole layer call (store + indexer + top-k + attention + projections) per "
      "dispatch mode over a grid of shapes: fresh prompts, cached prefix x extend, mixed "
      "batches; for each model config and pool layout. Prints a table (ms, TFLOP/s, % of the "
      "measured GEMM ceiling, speed-up over always-sparse, cost/oracle) and a summary; --json "
      "writes every row (rewritten after each shape: Ctrl-C leaves valid partial JSON).\n"
      "Examples:\n  dsakit bench --device cpu --grid quick\n  dsakit calibrate --out prof.json "
      "&& dsakit bench --profile prof.json --json bench.json --plot docs/img/bench");
  bench->add_option("--device", bo.device, "cpu | cuda | auto")->capture_default_str();
  bench->add_option("--threads", bo.threads, "CPU threads (0: all cores)");
  bench->add_option("--models", bo.models,
                    "Configs as PRESET[:TP] list (default: cuda deepseek-v3.2:1,deepseek-v3.2:8,"
                    "glm-5:1,glm-5:4 i.e. H per rank 128/16/64/16; cpu the two 16-head shards)");
  bench->add_option("--kv", bo.kv, "Pool layouts, a list of bf16, fp8, fp8-raw")
      ->capture_default_str();
  bench->add_option("--grid", bo.grid,
                    "quick (seconds) | small (cpu default) | full (cuda default: fresh 256..64K, "
                    "prefix 256..32K x extend 1..8K, mixed batches)");
  bench->add_option("--fresh", bo.fresh, "Override the grid's fresh prompt lengths (list)");
  bench->add_option("--prefixes", bo.prefixes, "Override the grid's cached prefix lengths (list)");
  bench->add_option("--extends", bo.extends, "Override the grid's extend lengths (list)");
  bench->add_flag("--no-mixed", bo.no_mixed, "Leave out the mixed batches");
  bench
      ->add_option("--modes", bo.modes,
                   "Dispatch modes to time (list of dense, sparse, masked, rule, cost; dense only "
                   "where it is exact; masked: the sparse path forced in the masked-MHA form, "
                   "where the backend has it, and counted in the oracle)")
      ->capture_default_str();
  bench->add_option("--profile", bo.profile,
                    "Cost-mode profile from dsakit calibrate (or DSAKIT_PROFILE); without one, "
                    "cost mode falls back to rule mode");
  bench->add_option("--runs", bo.runs, "At most this many timed calls per mode and shape (median)")
      ->capture_default_str();
  bench->add_option("--min-runs", bo.min_runs, "At least this many, whatever the budget")
      ->capture_default_str();
  bench
      ->add_option("--budget-ms", bo.budget_ms,
                   "Per shape: stop adding runs once this much wall time is spent")
      ->capture_default_str();
  bench->add_flag("!--no-stages", bo.stages, "Skip the per-stage timing calls");
  bench->add_option("--json", bo.json, "Write all rows and the summary as JSON");
  bench->add_option("--plot", bo.plot,
                    "Draw PREFIX-curves/-decision/-speedup figures with tools/plot_bench.py "
                    "(matplotlib); JSON goes to --json or PREFIX.json");
  bench->add_option("--plot-format", bo.plot_format, "png | svg")->capture_default_str();
  bench->add_flag("--fp8-weights", bo.fp8_weights,
                  "Give the layers kv_b_proj also in its FP8 checkpoint form (random 128x128 "
                  "block-scaled e4m3): on fp8 and fp8-raw pools the dense path's K/V "
                  "up-projection then reads the pool's codes in one FP8 GEMM (groups marked w8); "
                  "bf16 pools run as without it");
  bench
      ->add_option("--sparse-rows", bo.sparse_rows,
                   "How the sparse path reads fp8 / fp8-raw pools, as for dsakit run: auto, pool "
                   "or staged (groups marked pool / staged where not auto); DSAKIT_SPARSE_ROWS "
                   "overrides it")
      ->capture_default_str();
  bench
      ->add_option("--sparse-form", bo.sparse_form,
                   "The sparse path's attention, as for dsakit run: auto, mla or masked-mha "
                   "(groups marked mla / masked-mha where not auto; each mode's row says the "
                   "form its plan took); DSAKIT_SPARSE_FORM overrides it")
      ->capture_default_str();
  bench->add_option("--seed", bo.seed, "Seed of the random inputs")->capture_default_str();
  bench->add_flag("--quiet", bo.quiet, "No progress line");
  bench->add_option("--dcp", bo.dcp,
                    "Context parallelism: time fresh prompts (--fresh, default 16384,65536; "
                    "--models default deepseek-v3.2:1; first --kv layout) on W GPUs against one");

  CalibrateOptions co;
  CLI::App* calibrate = app.add_subcommand(
      "calibrate",
      "Measure dense MHA and sparse MLA on this device over a compact grid and fit the cost "
      "model (per-stage and whole-call linear terms in tokens, context and heads); writes or "
      "updates a profile JSON keyed by device name, model dimensions and pool layout, which "
      "--dispatch cost reads (--profile FILE or DSAKIT_PROFILE=FILE).\n"
      "Example:\n  dsakit calibrate --models deepseek-v3.2:8 --kv fp8 --out h200.json");
  calibrate->add_option("--device", co.device, "cpu | cuda | auto")->capture_default_str();
  calibrate->add_option("--threads", co.threads, "CPU threads (0: all cores)");
  calibrate->add_option("--models", co.models,
                        "Configs as PRESET[:TP] list (defaults as for bench)");
  calibrate->add_option("--kv", co.kv, "Pool layouts, a list of bf16, fp8, fp8-raw")
      ->capture_default_str();
  calibrate
      ->add_option("--out", co.out, "Profile file (entries for other keys already in it are kept)")
      ->capture_default_str();
  calibrate->add_option("--runs", co.runs, "Timed calls per path and shape (median)")
      ->capture_default_str();
  calibrate->add_option("--budget-ms", co.budget_ms, "Per shape wall-time budget")
      ->capture_default_str();
  calibrate->add_option("--seed", co.seed, "Seed of the random inputs")->capture_default_str();
  calibrate->add_flag("--quiet", co.quiet, "Print nothing but errors");

  CLI::App* info = app.add_subcommand("info", "Print the build (backends, kernels) and devices");

  const std::string first = argc > 1 ? argv[1] : "";
  if (!first.empty() && first[0] != '-' && first != "run" && first != "plan" && first != "bench" &&
      first != "calibrate" && first != "info") {
    std::fprintf(stderr,
                 "dsakit: error: unknown subcommand '%s' (expected run, plan, bench, calibrate "
                 "or info; see dsakit --help)\n",
                 argv[1]);
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "dsakit: error: %s (see dsakit --help)\n", e.what());
    return kExitUsage;
  }
  try {
    if (*run) {
      if (!ro.inputs.empty() && (prompts->count() || prefix->count() || decode->count())) {
        std::fprintf(stderr,
                     "dsakit: error: --inputs takes the lengths from the file; do not also pass "
                     "--prompts, --prefix or --decode-steps\n");
        return kExitUsage;
      }
      return ro.dcp > 0 ? run_dcp_command(ro) : run_command(ro);
    }
    if (*plan) return plan_command(po);
    if (*bench) return bo.dcp > 0 ? bench_dcp_command(bo) : bench_command(bo);
    if (*calibrate) return calibrate_command(co);
    if (*info) return info_command();
  } catch (const dsakit::Error& e) {
    std::fprintf(stderr, "dsakit: error: %s\n", e.what());
    const auto k = e.kind();
    return (k == dsakit::ErrorKind::kBackend || k == dsakit::ErrorKind::kInternal ||
            k == dsakit::ErrorKind::kResource)
               ? kExitRuntime
               : kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsakit: error: %s\n", e.what());
    return kExitRuntime;
  }
  return 0;
}

}  // namespace dsakit::cli
