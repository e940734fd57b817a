#include "tools/dcp_command.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "dsakit/dcp.h"
#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "src/reference/layer_reference.h"
#include "tools/cli_common.h"
#include "tools/harness.h"
#include "tools/measure.h"
#include "tools/run_state.h"
#include "tools/run_verify.h"

namespace dsakit::cli {

namespace {

// Pages rank `rank` needs for `lengths` (its owned positions), plus a few nobody owns.
int64_t rank_pages(const std::vector<int32_t>& lengths, int rank, int world, int page_size) {
  int64_t pages = 4;
  for (const int32_t l : lengths)
    pages += (dcp_owned_positions(l, rank, world) + page_size - 1) / page_size;
  return pages;
}

// Every rank leaves it together (an all-gather of one value each), with its device idle.
void barrier(Backend& be, DcpComm& comm) {
  const Tensor one = be.empty(DType::kI32, {1});
  const Tensor all = be.empty(DType::kI32, {comm.world()});
  be.fill_bytes(one, 0);
  comm.all_gather(be, one, all);
  be.synchronize();
}

// The W-rank outputs against one rank's: o rel-L2 and max |Δlse| over the rows both ran, and
// the fraction of the one-rank run's top-k rows (sparse path) whose sets the W ranks match.
struct Agreement {
  double o_rel = 0, lse_abs = 0, topk_same = 1;
  int64_t rows = 0, topk_rows = 0;
};

Agreement compare_outputs(const RunOutputs& a, const RunOutputs& b, int64_t k) {
  Agreement r;
  const int64_t rows = int64_t(a.ran.size());
  const int64_t od = a.o.numel() / std::max<int64_t>(rows, 1);
  const int64_t ld = a.lse.numel() / std::max<int64_t>(rows, 1);
  double num = 0, den = 0;
  int64_t same = 0;
  for (int64_t i = 0; i < rows; ++i) {
    if (!a.ran[size_t(i)] || !b.ran[size_t(i)]) continue;
    ++r.rows;
    for (int64_t j = 0; j < od; ++j) {
      const double x = a.o.ptr<float>()[i * od + j], y = b.o.ptr<float>()[i * od + j];
      num += std::isnan(y) ? std::numeric_limits<double>::infinity() : (x - y) * (x - y);
      den += x * x;
    }
    for (int64_t j = 0; j < ld; ++j) {
      const double x = a.lse.ptr<float>()[i * ld + j], y = b.lse.ptr<float>()[i * ld + j];
      const double d = (std::isinf(x) && x == y) ? 0 : std::fabs(x - y);
      r.lse_abs = std::max(r.lse_abs, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
    }
    const int32_t* ta = a.topk.ptr<int32_t>() + i * k;
    const int32_t* tb = b.topk.ptr<int32_t>() + i * k;
    if (ta[0] >= 0) {  // the one-rank row took the sparse path (its dense rows hold -1)
      ++r.topk_rows;
      same += std::equal(ta, ta + k, tb);
    }
  }
  r.o_rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  r.topk_same = r.topk_rows ? double(same) / double(r.topk_rows) : 1.0;
  return r;
}

// Stage times summed over the steps after the cached prefix, in first-seen order.
std::vector<std::pair<std::string, double>> stage_sums(const RunOutputs& out, size_t first) {
  std::vector<std::pair<std::string, double>> sums;
  for (size_t i = first; i < out.steps.size(); ++i)
    for (const StageTime& st : out.steps[i].stages) {
      auto it = std::find_if(sums.begin(), sums.end(),
                             [&](const auto& s) { return s.first == st.stage; });
      if (it == sums.end())
        sums.push_back({st.stage, st.ms});
      else
        it->second += st.ms;
    }
  return sums;
}

}  // namespace

int run_dcp_command(const RunOptions& opt) {
  DSAKIT_CHECK_ARG(opt.dcp >= 1 && opt.dcp <= 64, "--dcp: expected 1..64 GPUs, got ", opt.dcp);
  DSAKIT_CHECK_ARG(opt.inputs.empty() && opt.save.empty(),
                   "--dcp: --inputs and --save are not supported with --dcp");
  DSAKIT_CHECK_ARG(opt.device == "auto" || opt.device == "cuda",
                   "--dcp runs one process per GPU (--device cuda); on the CPU the tests run the "
                   "same ranks in one process (DcpSimulation)");
  const ModelConfig cfg = load_model(opt.model, opt.tp);
  check_run_options(opt);
  SafetensorsFile no_file;
  const RunLengths len = run_lengths(opt, no_file);
  const std::vector<int32_t> total = len.total();
  const auto rank_main = [&](int rank, Backend& be, DcpComm& comm) -> int {
    const int world = comm.world();
    const bool report = rank == 0 && !opt.quiet && !opt.json;
    RunOptions rank_opt = opt;
    rank_opt.quiet = opt.quiet || rank != 0;  // one progress line, rank 0's
    const TokenStore tokens = random_token_store(cfg, total, opt.seed);
    const Tensor kv_b_proj_host = random_kv_b_proj(cfg, opt.seed + 1);
    const Tensor kv_b_proj = be.to_device(kv_b_proj_host);
    KvPoolDesc kd = run_pool_desc(opt, cfg);
    kd.num_pages = rank_pages(total, rank, world, opt.page_size);
    DcpRank layer(cfg, be, comm, kd, total, kv_b_proj, run_layer_options(opt));
    const LayerForward forward = [&](const Batch& batch, const std::vector<int32_t>& requests,
                                     const LayerInputs& inputs) {
      return layer.forward(batch, inputs, requests);
    };
    if (report) {
      fmt::print("model    {}\n", cfg.summary());
      fmt::print("dcp      {} ranks, one process per GPU over NCCL; rank 0 on {}\n", world,
                 be.capabilities().device_name);
      fmt::print("kv pool  {} (per rank)\n", kd.summary());
      fmt::print("batch    prompts [{}] cached prefix [{}] chunk {} decode steps {}\n",
                 join_int_list(len.prompt), join_int_list(len.prefix), opt.chunk, len.decode_steps);
      std::fflush(stdout);
    }
    RunOutputs out;
    const std::vector<std::vector<int32_t>> no_tables(total.size());  // each rank keeps its own
    const StepsResult steps = run_steps(rank_opt, len, cfg, be, forward, no_tables, tokens, out);
    if (rank != 0) return 0;
    if (report) {
      fmt::print("stages (rank 0, ms, summed over steps; first calls include one-time setup)\n");
      for (const auto& [name, ms] : stage_sums(out, steps.prefix_steps))
        fmt::print("  {:<18} {:>10.3f}\n", name, ms);
      fmt::print("  wall {:.1f} ms ({} steps)\n", steps.wall_ms, out.steps.size());
    }
    if (!opt.verify) return 0;

    // The same steps on one GPU (this rank's), then both against the float64 reference.
    RunState single;
    single.cfg = cfg;
    single.len = len;
    single.be = make_cuda_backend(0);
    single.tokens = tokens;
    single.kv_b_proj_host = kv_b_proj_host;
    set_up_layer(opt, single);
    RunOptions single_opt = opt;
    single_opt.quiet = true;
    run_layer_steps(single_opt, single);
    const Agreement agree = compare_outputs(single.out, out, cfg.index_topk);
    const VerifyResult vr_single = verify_run(opt, single);
    const std::vector<StepRecord> out_steps = out.steps;
    std::swap(single.out, out);
    const VerifyResult vr_dcp = verify_run(opt, single);
    std::swap(single.out, out);
    const bool same_topk = agree.topk_same == 1.0;
    // Where a step took another path than on one GPU (a dense step run sparse by the ranks), the
    // two are equal only within the bound between the paths (docs/numerics.md).
    bool same_paths = single.out.steps.size() == out_steps.size();
    for (size_t i = 0; same_paths && i < out_steps.size(); ++i)
      same_paths = single.out.steps[i].plan.path == out_steps[i].plan.path;
    const double lse_tol = same_paths ? vr_dcp.lse_tol : reference::kLseBoundAcrossPaths;
    const bool close = agree.o_rel <= vr_dcp.tol && agree.lse_abs <= lse_tol;
    const bool pass = vr_single.pass && vr_dcp.pass && same_topk && close;
    if (!opt.quiet) {
      fmt::print(
          "dcp vs one GPU  {} rows: o rel-L2 {:.3e} (tol {:.1e}), lse max abs {:.3e} (tol "
          "{:.0e}), top-k sets identical {:.1f}% of {} rows; wall {:.1f} ms on one GPU\n",
          agree.rows, agree.o_rel, vr_dcp.tol, agree.lse_abs, lse_tol, 100 * agree.topk_same,
          agree.topk_rows, single.wall_ms);
      for (const auto& [name, vr] : {std::pair{"one GPU", vr_single}, std::pair{"dcp", vr_dcp}})
        fmt::print(
            "verify   {:<8} {} tokens ({} via top-k): o rel-L2 {:.3e} (tol {:.1e}), lse max abs "
            "{:.3e} (tol {:.0e}), top-k sets equal {:.1f}%  -> {}\n",
            name, vr.tokens, vr.sparse_tokens, vr.o_rel, vr.tol, vr.lse_abs, vr.lse_tol,
            100 * vr.topk_agree, vr.pass ? "PASS" : "FAIL");
      fmt::print("verify   dcp {} one GPU and the float64 reference -> {}\n",
                 same_topk && close ? "matches" : "DIFFERS from", pass ? "PASS" : "FAIL");
    }
    return pass ? 0 : kExitVerifyFailed;
  };
  return run_dcp_on_gpus(opt.dcp, rank_main);
}

int bench_dcp_command(const BenchOptions& bo) {
  DSAKIT_CHECK_ARG(bo.dcp >= 1 && bo.dcp <= 64, "--dcp: expected 1..64 GPUs, got ", bo.dcp);
  DSAKIT_CHECK_ARG(!bo.fp8_weights,
                   "--fp8-weights: not offered with --dcp (its ranks draw bf16 "
                   "weights)");
  DSAKIT_CHECK_ARG(bo.sparse_form == "mla" || bo.sparse_form == "auto",
                   "--sparse-form: with --dcp the ranks run mla (their top-k merge combines MLA "
                   "partials), got '",
                   bo.sparse_form, "'");
  DSAKIT_CHECK_ARG(bo.device == "auto" || bo.device == "cuda",
                   "bench --dcp runs one process per GPU (--device cuda)");
  DSAKIT_CHECK_ARG(bo.min_runs >= 1 && bo.runs >= bo.min_runs,
                   "--runs / --min-runs: expected 1 <= min-runs <= runs");
  const std::vector<int32_t> fresh =
      parse_int_list(bo.fresh.empty() ? "16384,65536" : bo.fresh, "--fresh", 1);
  const std::string models = bo.models.empty() ? "deepseek-v3.2:1" : bo.models;
  const std::string kv = bo.kv.substr(0, bo.kv.find(','));
  const std::vector<ModelConfig> configs = parse_model_list(models);
  const auto rank_main = [&](int rank, Backend& be, DcpComm& comm) -> int {
    const int world = comm.world();
    if (rank == 0) {
      fmt::print(
          "dsakit bench --dcp {}: one forward of a fresh prompt, median of {}..{} calls; "
          "rank 0 on {}\n",
          world, bo.min_runs, bo.runs, be.capabilities().device_name);
      fmt::print("{:<16} {:>4} {:<8} {:>7} {:<11} {:>10} {:>10} {:>8}\n", "model", "H", "kv", "T",
                 "path", "1 GPU ms", fmt::format("{} GPU ms", world), "speedup");
      std::fflush(stdout);
    }
    for (const ModelConfig& cfg : configs) {
      for (const int32_t t : fresh) {
        const std::vector<int32_t> lengths = {t};
        const TokenStore tokens = uniform_token_store(cfg, lengths, bo.seed);
        std::vector<int64_t> rows(static_cast<size_t>(t));
        for (int32_t i = 0; i < t; ++i) rows[size_t(i)] = i;
        const auto inputs = tokens.slice(be, rows);
        const Tensor kv_b_proj = be.to_device(random_kv_b_proj(cfg, bo.seed + 1));
        RunOptions ro;
        ro.kv = kv;
        KvPoolDesc kd = run_pool_desc(ro, cfg);
        LayerOptions lo;
        lo.sparse_rows = parse_sparse_rows(bo.sparse_rows);
        Batch batch;
        batch.prefix_lens = {0};
        batch.extend_lens = {t};
        const auto median_ms = [&](const std::function<void()>& call, bool together) {
          call();  // warm-up
          std::vector<double> ms;
          for (int i = 0; i < bo.runs; ++i) {
            if (together) barrier(be, comm);
            ms.push_back(be.time_ms(call));
            if (int(ms.size()) >= bo.min_runs && (ms.size() >= 3 || ms.back() > bo.budget_ms))
              break;
          }
          std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
          return ms[ms.size() / 2];
        };
        kd.num_pages = rank_pages(lengths, rank, world, ro.page_size);
        std::string path;
        double dcp_ms = 0;
        {
          DcpRank layer(cfg, be, comm, kd, lengths, kv_b_proj, lo);
          barrier(be, comm);
          dcp_ms = median_ms(
              [&] { path = to_string(layer.forward(batch, inputs.view()).plan.path); }, true);
        }
        if (rank == 0) {
          kd.num_pages = rank_pages(lengths, 0, 1, ro.page_size);
          PagedKvPool kv_pool = be.make_kv_pool(kd);
          IndexKeyPool index_pool =
              be.make_index_pool({kd.page_size, kd.num_pages, cfg.index_head_dim});
          batch.page_tables = allocate_pages(lengths, kd.page_size, kd.num_pages, bo.seed + 2);
          DsaAttention layer(cfg, be, kv_pool, index_pool, kv_b_proj, lo);
          const double one_ms = median_ms([&] { layer.forward(batch, inputs.view()); }, false);
          batch.page_tables.clear();
          fmt::print("{:<16} {:>4} {:<8} {:>7} {:<11} {:>10.3f} {:>10.3f} {:>7.2f}x\n", cfg.name,
                     cfg.num_heads, kv, t, path, one_ms, dcp_ms, one_ms / dcp_ms);
          std::fflush(stdout);
        }
        barrier(be, comm);  // rank 0's one-GPU runs are done
      }
    }
    return 0;
  };
  return run_dcp_on_gpus(bo.dcp, rank_main);
}

}  // namespace dsakit::cli
