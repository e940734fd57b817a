#include "tools/run_command.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "dsakit/safetensors.h"
#include "src/reference/layer_reference.h"
#include "tools/cli_common.h"

namespace dsakit::cli {

namespace {

using json = nlohmann::json;

struct Lengths {
  std::vector<int32_t> prompt, prefix;
  int decode_steps = 0;
  std::vector<int32_t> total() const {
    std::vector<int32_t> t(prompt);
    for (auto& x : t) x += decode_steps;
    return t;
  }
};

std::string join(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

// Tensors of an --inputs file, checked against the config and the lengths in its metadata.
TokenStore load_inputs(const SafetensorsFile& f, const ModelConfig& c, const Lengths& len,
                       Tensor& kv_b_proj) {
  TokenStore s;
  s.lengths = len.total();
  const int64_t n = s.rows();
  s.q_nope = f.get("q_nope", DType::kBF16, {n, c.num_heads, c.qk_nope_head_dim});
  s.q_pe = f.get("q_pe", DType::kBF16, {n, c.num_heads, c.qk_rope_head_dim});
  s.c_kv = f.get("c_kv", DType::kBF16, {n, c.kv_lora_rank});
  s.k_pe = f.get("k_pe", DType::kBF16, {n, c.qk_rope_head_dim});
  s.idx_q = f.get("idx_q", DType::kBF16, {n, c.index_n_heads, c.index_head_dim});
  s.idx_k = f.get("idx_k", DType::kBF16, {n, c.index_head_dim});
  s.idx_w = f.get("idx_w", DType::kF32, {n, c.index_n_heads});
  kv_b_proj = f.get("kv_b_proj", DType::kBF16,
                    {int64_t(c.num_heads) * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
  return s;
}

std::vector<int32_t> metadata_list(const SafetensorsFile& f, const char* key) {
  auto it = f.metadata().find(key);
  DSAKIT_CHECK(it != f.metadata().end(), kFormat, f.origin(), ": metadata key '", key,
               "' is missing (write the file with dsakit run --save)");
  if (it->second.empty()) return {};
  return parse_int_list(it->second, key, 0);
}

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

struct VerifyResult {
  double o_rel = 0, lse_abs = 0, topk_agree = 1;
  int64_t tokens = 0, sparse_tokens = 0;
  double tol = 0, lse_tol = 1e-3;
  bool pass = true;
};

}  // namespace

int run_command(const RunOptions& opt) {
  const ModelConfig cfg = load_model(opt.model, opt.tp);
  DSAKIT_CHECK_ARG(opt.page_size >= 1 && opt.page_size <= 4096,
                   "--page-size: expected 1..4096, got ", opt.page_size);
  DSAKIT_CHECK_ARG(opt.chunk >= 0, "--chunk: expected >= 0, got ", opt.chunk);
  DSAKIT_CHECK_ARG(opt.decode_steps >= 0 && opt.decode_steps <= 100000,
                   "--decode-steps: expected 0..100000, got ", opt.decode_steps);
  DSAKIT_CHECK_ARG(opt.verify_tokens >= 1, "--verify-tokens: expected >= 1, got ",
                   opt.verify_tokens);
  DSAKIT_CHECK_ARG(opt.verify_tol >= 0 && opt.verify_tol < 1, "--verify-tol: expected [0, 1), got ",
                   opt.verify_tol);
  DSAKIT_CHECK_ARG(opt.max_workspace_mb >= 0 && opt.max_workspace_mb <= (int64_t(1) << 40),
                   "--max-workspace-mb: expected 0..2^40 (0: no limit), got ",
                   opt.max_workspace_mb);

  // ---- lengths and inputs -----------------------------------------------------------------
  Lengths len;
  SafetensorsFile in_file;
  if (!opt.inputs.empty()) {
    in_file = SafetensorsFile::read(opt.inputs);
    len.prompt = metadata_list(in_file, "prompts");
    len.prefix = metadata_list(in_file, "prefix");
    const auto steps = metadata_list(in_file, "decode_steps");
    DSAKIT_CHECK(steps.size() == 1, kFormat, opt.inputs,
                 ": metadata decode_steps must be one integer");
    len.decode_steps = steps[0];
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

  std::unique_ptr<Backend> be =
      opt.device == "cpu" ? make_cpu_backend(opt.threads) : make_backend(opt.device);
  Tensor kv_b_proj_host;
  const TokenStore tokens = opt.inputs.empty() ? TokenStore::random(cfg, len.total(), opt.seed)
                                               : load_inputs(in_file, cfg, len, kv_b_proj_host);
  if (opt.inputs.empty()) kv_b_proj_host = random_kv_b_proj(cfg, opt.seed + 1);
  const Tensor kv_b_proj = be->to_device(kv_b_proj_host);

  // ---- pools ------------------------------------------------------------------------------
  KvPoolDesc kd;
  kd.layout = parse_kv_layout(opt.kv);
  kd.page_size = opt.page_size;
  kd.d_c = cfg.kv_lora_rank;
  kd.d_rope = cfg.qk_rope_head_dim;
  kd.scale_policy = parse_scale_policy(opt.scale_policy);
  kd.k_scale = float(opt.k_scale);
  int64_t pages = 0;
  for (int32_t l : tokens.lengths) pages += (l + opt.page_size - 1) / opt.page_size;
  kd.num_pages = pages + 4;  // a few spare pages nobody owns
  PagedKvPool kv_pool = be->make_kv_pool(kd);
  IndexKeyPool index_pool = be->make_index_pool({opt.page_size, kd.num_pages, cfg.index_head_dim});
  const auto tables = allocate_pages(tokens.lengths, opt.page_size, kd.num_pages, opt.seed + 2);

  LayerOptions lo;
  lo.sm_scale = opt.sm_scale;
  lo.policy.mode = parse_dispatch_mode(opt.dispatch);
  lo.policy.threshold = opt.threshold;
  lo.policy.allow_approximation = opt.allow_approx;
  if (!opt.profile.empty()) lo.policy = lo.policy.with_profile(opt.profile);
  lo.time_stages = true;
  lo.max_workspace_bytes = opt.max_workspace_mb << 20;
  DsaAttention layer(cfg, *be, kv_pool, index_pool, kv_b_proj, lo);

  if (!opt.quiet && !opt.json) {
    fmt::print("model    {}\n", cfg.summary());
    fmt::print("device   {}\n", be->capabilities().device_name);
    fmt::print("kv pool  {}\n", kd.summary());
    fmt::print(
        "batch    prompts [{}] cached prefix [{}] chunk {} decode steps {}  sm_scale {:.6g}\n",
        join(len.prompt), join(len.prefix), opt.chunk, len.decode_steps, layer.sm_scale());
  }

  std::fflush(stdout);

  // ---- run: cached prefix, the (chunked) extend, decode steps ----------------------------
  Progress progress;
  progress.enabled = !opt.quiet && !opt.json && (isatty(2) || total_tokens > 4096);
  RunOutputs out;
  std::vector<int32_t> zeros(b, 0), prompt_end(len.prompt);
  const auto t0 = std::chrono::steady_clock::now();
  size_t prefix_steps = 0;
  if (std::any_of(len.prefix.begin(), len.prefix.end(), [](int32_t p) { return p > 0; })) {
    progress.label = "cached prefix";
    run_schedule(layer, tables, tokens, {zeros, len.prefix, 0, ForwardMode::kExtend}, out,
                 progress);
    std::fill(out.ran.begin(), out.ran.end(), 0);  // prefix rows are setup, not results
    prefix_steps = out.steps.size();
  }
  progress.label = "prefill";
  run_schedule(layer, tables, tokens, {len.prefix, prompt_end, opt.chunk, ForwardMode::kExtend},
               out, progress);
  for (int s = 0; s < len.decode_steps; ++s) {
    std::vector<int32_t> a(b), e(b);
    for (size_t r = 0; r < b; ++r) a[r] = len.prompt[r] + s, e[r] = a[r] + 1;
    progress.label = "decode";
    run_schedule(layer, tables, tokens, {a, e, 1, ForwardMode::kDecode}, out);
  }
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  // ---- report -----------------------------------------------------------------------------
  std::map<std::string, double> stage_ms;
  std::vector<std::string> stage_order;
  std::map<std::string, int> plans;
  std::vector<std::string> plan_order;
  for (size_t i = prefix_steps; i < out.steps.size(); ++i) {
    const auto& st = out.steps[i];
    const std::string key = std::string(to_string(st.plan.path)) + " | " + st.plan.reason;
    if (!plans.count(key)) plan_order.push_back(key);
    plans[key]++;
    for (const auto& sg : st.stages) {
      if (!stage_ms.count(sg.stage)) stage_order.push_back(sg.stage);
      stage_ms[sg.stage] += sg.ms;
    }
  }

  MemoryReport mem;
  mem.pool_bytes = int64_t(kv_pool.storage().nbytes()) + int64_t(index_pool.storage().nbytes());
  for (const auto& st : out.steps)
    mem.peak_workspace_bytes =
        std::max(mem.peak_workspace_bytes, layer.workspace_bytes(st.batch, st.plan));

  // ---- verify against the float64 reference on sampled tokens ----------------------------
  VerifyResult vr;
  if (opt.verify) {
    const Tensor kv_host = be->to_host(kv_pool.storage());
    const Tensor ix_host = be->to_host(index_pool.storage());
    reference::LayerSnapshot snap;
    snap.config = &cfg;
    snap.sm_scale = layer.sm_scale();
    snap.lengths = tokens.lengths;
    snap.q_nope = tokens.q_nope;
    snap.q_pe = tokens.q_pe;
    snap.idx_q = tokens.idx_q;
    snap.idx_w = tokens.idx_w;
    snap.kv_b_proj = kv_b_proj_host;
    snap.kv_desc = kd;
    snap.kv_storage = kv_host;
    snap.index_desc = index_pool.desc();
    snap.index_storage = ix_host;
    snap.page_tables = tables;
    snap.bf16_intermediates = be->capabilities().intermediate_dtype == DType::kBF16;
    // Path per row, from the step that computed it.
    std::vector<int8_t> dense_row(size_t(tokens.rows()), -1);
    for (size_t i = prefix_steps; i < out.steps.size(); ++i) {
      const StepRecord& st = out.steps[i];
      size_t j = 0;
      for (int r = 0; r < st.batch.num_requests(); ++r)
        for (int32_t e = 0; e < st.batch.extend_lens[size_t(r)]; ++e)
          dense_row[size_t(st.rows[j++])] = st.plan.path_of(r) == AttentionPath::kDenseMha;
    }
    std::mt19937_64 gen(opt.seed + 3);
    std::vector<reference::TokenQuery> qs;
    std::vector<int64_t> q_rows;
    for (size_t r = 0; r < b; ++r) {
      std::vector<int32_t> cand;
      for (int32_t p = 0; p < tokens.lengths[r]; ++p)
        if (out.ran[size_t(tokens.offset(int(r)) + p)]) cand.push_back(p);
      std::set<int32_t> pick;
      if (!cand.empty()) {  // first, last and random tokens of the request
        pick.insert(cand.front());
        pick.insert(cand.back());
      }
      std::shuffle(cand.begin(), cand.end(), gen);
      for (size_t i = 0; i < cand.size() && int(pick.size()) < opt.verify_tokens; ++i)
        pick.insert(cand[i]);
      for (int32_t p : pick) {
        const int64_t row = tokens.offset(int(r)) + p;
        qs.push_back({int(r), p, dense_row[size_t(row)] == 1});
        q_rows.push_back(row);
      }
    }
    if (!opt.quiet && !opt.json)
      std::fprintf(stderr, "[dsakit] verifying %zu tokens against the float64 reference...\n",
                   qs.size());
    const auto ref = reference::layer_outputs(snap, qs);
    const int64_t h = cfg.num_heads, dv = cfg.v_head_dim, k = cfg.index_topk;
    double num = 0, den = 0;
    int64_t agree = 0, sets = 0;
    for (size_t i = 0; i < qs.size(); ++i) {
      const int64_t row = q_rows[i];
      for (int64_t j = 0; j < h * dv; ++j) {
        const double got = out.o.ptr<float>()[row * h * dv + j];
        const double want = ref.o[i * size_t(h * dv) + size_t(j)];
        num +=
            std::isnan(got) ? std::numeric_limits<double>::infinity() : (got - want) * (got - want);
        den += want * want;
      }
      for (int64_t j = 0; j < h; ++j) {
        const double got = out.lse.ptr<float>()[row * h + j],
                     want = ref.lse[i * size_t(h) + size_t(j)];
        const double d =
            (std::isinf(got) && std::isinf(want) && got == want) ? 0 : std::fabs(got - want);
        vr.lse_abs =
            std::max(vr.lse_abs, std::isnan(d) ? std::numeric_limits<double>::infinity() : d);
      }
      if (!qs[i].all_positions && qs[i].pos + 1 > k) {
        ++vr.sparse_tokens;
        std::vector<int32_t> got;
        for (int64_t j = 0; j < k; ++j)
          if (int32_t p = out.topk.ptr<int32_t>()[row * k + j]; p >= 0) got.push_back(p);
        ++sets;
        agree += got == ref.selected[i];
      }
    }
    vr.tokens = int64_t(qs.size());
    vr.o_rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    vr.topk_agree = sets ? double(agree) / double(sets) : 1.0;
    // lse: 1e-3 (§9); with bf16 intermediates the reference mirrors the backend's rounding
    // points, but a product within fp32-accumulation error of a bf16 rounding boundary can round
    // either way and move one score by ~sm_scale·|q_d|·ulp(k_d) (~1e-3 for DeepSeek-V3.2), so the
    // layer-level bound there is 5e-3 (docs/numerics.md).
    vr.lse_tol = snap.bf16_intermediates ? 5e-3 : 1e-3;
    vr.tol = opt.verify_tol > 0 ? opt.verify_tol : kd.layout == KvLayout::kBf16 ? 1e-2 : 3e-2;
    // Top-k sets may differ only through near-ties between fp32 and float64 scores; the output
    // error bound covers their effect, so the set agreement is reported, not gated.
    vr.pass = vr.o_rel <= vr.tol && vr.lse_abs <= vr.lse_tol;
  }

  // ---- save ---------------------------------------------------------------------------------
  if (!opt.save.empty()) {
    SafetensorsWriter w;
    w.add("q_nope", tokens.q_nope);
    w.add("q_pe", tokens.q_pe);
    w.add("c_kv", tokens.c_kv);
    w.add("k_pe", tokens.k_pe);
    w.add("idx_q", tokens.idx_q);
    w.add("idx_k", tokens.idx_k);
    w.add("idx_w", tokens.idx_w);
    w.add("kv_b_proj", kv_b_proj_host);
    const int64_t rows = tokens.rows(), h = cfg.num_heads, dv = cfg.v_head_dim;
    Tensor o_bf16 = Tensor::host(DType::kBF16, {rows, h, dv});
    for (int64_t i = 0; i < o_bf16.numel(); ++i)
      o_bf16.ptr<bf16_t>()[i] = f32_to_bf16(out.o.ptr<float>()[i]);
    w.add("o", o_bf16);
    w.add("lse", out.lse);
    if (std::any_of(out.steps.begin(), out.steps.end(),
                    [](const StepRecord& s) { return s.plan.path != AttentionPath::kDenseMha; }))
      w.add("topk", out.topk);
    // Pool rows of every token in position order (row order of the inputs).
    const Tensor kv_host = be->to_host(kv_pool.storage());
    const Tensor ix_host = be->to_host(index_pool.storage());
    const int bpt = kd.bytes_per_token(), di = cfg.index_head_dim, ips = di + 4;
    Tensor kv_rows = Tensor::host(DType::kU8, {rows, bpt});
    Tensor ix_rows = Tensor::host(DType::kU8, {rows, ips});
    for (size_t r = 0; r < b; ++r)
      for (int32_t p = 0; p < tokens.lengths[r]; ++p) {
        const int64_t row = tokens.offset(int(r)) + p;
        const int64_t loc = location_of(tables[r], opt.page_size, p);
        std::copy_n(kv_host.ptr<uint8_t>() + loc * bpt, bpt, kv_rows.ptr<uint8_t>() + row * bpt);
        const uint8_t* page =
            ix_host.ptr<uint8_t>() + (loc / opt.page_size) * index_pool.desc().page_bytes();
        const int slot = int(loc % opt.page_size);
        std::copy_n(page + slot * di, di, ix_rows.ptr<uint8_t>() + row * ips);
        std::copy_n(page + int64_t(opt.page_size) * di + slot * 4, 4,
                    ix_rows.ptr<uint8_t>() + row * ips + di);
      }
    w.add("kv_pool", kv_rows);
    w.add("index_pool", ix_rows);
    w.set_metadata("format", "dsakit-run-v1");
    w.set_metadata("config", cfg.to_json());
    w.set_metadata("layout", to_string(kd.layout));
    w.set_metadata("scale_policy", to_string(kd.scale_policy));
    w.set_metadata("page_size", std::to_string(opt.page_size));
    w.set_metadata("prompts", join(len.prompt));
    w.set_metadata("prefix", join(len.prefix));
    w.set_metadata("decode_steps", std::to_string(len.decode_steps));
    w.set_metadata("chunk", std::to_string(opt.chunk));
    w.set_metadata("sm_scale", fmt::format("{:.17g}", layer.sm_scale()));
    std::string plan_text;
    for (const auto& p : plan_order) {
      if (!plan_text.empty()) plan_text += '\n';
      plan_text += p;
    }
    w.set_metadata("plan", plan_text);
    w.write(opt.save);
  }

  mem.max_rss_bytes = max_rss_bytes();  // after verify and save: the whole run's peak

  // ---- print --------------------------------------------------------------------------------
  if (opt.json) {
    json j;
    j["model"] = json::parse(cfg.to_json());
    j["device"] = be->capabilities().device_name;
    j["kv_layout"] = to_string(kd.layout);
    j["page_size"] = opt.page_size;
    j["prompts"] = len.prompt;
    j["prefix"] = len.prefix;
    j["chunk"] = opt.chunk;
    j["decode_steps"] = len.decode_steps;
    j["sm_scale"] = layer.sm_scale();
    j["plans"] = json::array();
    for (const auto& p : plan_order) j["plans"].push_back({{"plan", p}, {"steps", plans[p]}});
    j["stages_ms"] = json::object();
    for (const auto& s : stage_order) j["stages_ms"][s] = stage_ms[s];
    j["wall_ms"] = wall_ms;
    j["memory"] = {{"pool_bytes", mem.pool_bytes},
                   {"peak_layer_workspace_bytes", mem.peak_workspace_bytes},
                   {"max_rss_bytes", mem.max_rss_bytes}};
    if (opt.verify)
      j["verify"] = {{"tokens", vr.tokens},
                     {"o_rel_l2", vr.o_rel},
                     {"lse_max_abs", vr.lse_abs},
                     {"topk_agreement", vr.topk_agree},
                     {"tolerance", vr.tol},
                     {"lse_tolerance", vr.lse_tol},
                     {"pass", vr.pass}};
    if (!opt.save.empty()) j["saved"] = opt.save;
    fmt::print("{}\n", j.dump(2));
  } else if (!opt.quiet) {
    fmt::print("plan\n");
    for (const auto& p : plan_order) fmt::print("  {:>4} step(s)  {}\n", plans[p], p);
    fmt::print("stages (ms, summed over steps)\n");
    double sum = 0;
    for (const auto& s : stage_order) {
      fmt::print("  {:<18} {:>10.3f}\n", s, stage_ms[s]);
      sum += stage_ms[s];
    }
    fmt::print("  {:<18} {:>10.3f}   (wall {:.1f} ms incl. host staging)\n", "total", sum, wall_ms);
    fmt::print(
        "memory   pools {:.1f} MiB, layer workspace {:.1f} MiB (peak estimate over steps), max "
        "RSS {:.1f} MiB\n",
        mib(mem.pool_bytes), mib(mem.peak_workspace_bytes), mib(mem.max_rss_bytes));
    if (opt.verify)
      fmt::print(
          "verify   {} tokens ({} via top-k): o rel-L2 {:.3e} (tol {:.1e}), lse max abs {:.3e} "
          "(tol {:.0e}), top-k sets equal {:.1f}%  -> {}\n",
          vr.tokens, vr.sparse_tokens, vr.o_rel, vr.tol, vr.lse_abs, vr.lse_tol,
          100 * vr.topk_agree, vr.pass ? "PASS" : "FAIL");
    if (!opt.save.empty()) fmt::print("saved    {}\n", opt.save);
  }
  return vr.pass ? 0 : kExitVerifyFailed;
}

}  // namespace dsakit::cli
