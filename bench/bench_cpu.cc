// CPU benchmarks of every Backend op of the layer (docs/design.md#benchmarks), DeepSeek-V3.2 TP8
// shapes (H = 16 heads per rank), one fresh prompt of T tokens (P = 0, E = T), backends made with
// make_cpu_backend(threads). Arguments: T (tokens), threads, and for pool-reading ops the pool
// layout (0 = bf16, 1 = fp8). Counters: GFLOP/s with FLOPs counted as in docs/design.md#benchmarks,
// and GB/s of the bytes an op must read and write (inputs, outputs and pool rows touched).
//
// Time is wall-clock (UseRealTime) per iteration; Google Benchmark repeats an op until 0.5 s
// have passed, so the long T = 8192 attention runs are single iterations.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/cost_model.h"
#include "dsakit/plan.h"

namespace dsakit {
namespace {

// DeepSeek-V3.2 at TP8 (docs/config.md).
constexpr int kHeads = 16, kDnope = 128, kDrope = 64, kDv = 128, kDc = 512;
constexpr int kIndexHeads = 64, kIndexDim = 128, kTopk = 2048, kPageSize = 64;
constexpr double kSmScale = 0.1352337788608801;  // YaRN mscale² / sqrt(192), factor 40

// Uniform(-1, 1) values from a 64-bit LCG: fast to generate, never all zeros.
class FastRandom {
 public:
  explicit FastRandom(uint64_t seed) : state_(seed) {}
  float next() {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return float(int32_t(state_ >> 32)) * (1.0f / 2147483648.0f);
  }

 private:
  uint64_t state_;
};

Tensor random_host(FastRandom& rng, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::host(dtype, shape);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::kBF16)
      t.ptr<bf16_t>()[i] = f32_to_bf16(rng.next());
    else
      t.ptr<float>()[i] = rng.next();
  }
  return t;
}

Tensor host_i32(const std::vector<int32_t>& v, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::host(DType::kI32, shape);
  std::copy(v.begin(), v.end(), t.ptr<int32_t>());
  return t;
}

// Every input of one fresh prompt of T tokens, in host memory (which is also the CPU backend's
// device memory), shared by all ops and thread counts. Pools start filled by store_kv.
struct Workload {
  int64_t tokens = 0;
  int64_t sum_ctx = 0;         // Σ_t (t + 1): causal positions seen by the dense path
  int64_t sum_topk = 0;        // Σ_t min(k, t + 1): slots read by sparse MLA
  int64_t sum_scored_ctx = 0;  // Σ over tokens with ctx > k of ctx: indexer logits computed
  Tensor locs;                 // i32 [T] pool locations of positions 0 … T-1
  Tensor kv_start, ctx_len;    // i32 [T]
  Tensor c_kv, k_pe;           // bf16 [T, d_c], [T, d_rope]
  Tensor idx_q, idx_w, idx_k;  // bf16 [T, H_i, d_i], f32 [T, H_i], bf16 [T, d_i]
  Tensor topk_locs;            // i32 [T, k] top-k-like selection as pool locations, -1 padded
  Tensor kv_b_proj;            // bf16 [H (d_nope + d_v), d_c]
  Tensor q_nope, q_pe;         // bf16 [T, H, d_nope], [T, H, d_rope]
  Tensor q_abs, o_lat;         // f32 [T, H, d_c]
  Tensor k_nope, v;            // f32 [T, H, d_nope], [T, H, d_v] (up-projected)
  std::map<KvLayout, PagedKvPool> pools;
  IndexKeyPool index_pool;
};

const Workload& workload(int64_t tokens) {
  static std::map<int64_t, std::unique_ptr<Workload>> cache;
  std::unique_ptr<Workload>& slot = cache[tokens];
  if (slot) return *slot;
  slot = std::make_unique<Workload>();
  Workload& w = *slot;
  FastRandom rng(0x5eed0000 + uint64_t(tokens));
  std::mt19937_64 gen(static_cast<uint64_t>(tokens));
  const int64_t pages = (tokens + kPageSize - 1) / kPageSize;
  w.tokens = tokens;

  std::vector<int32_t> locs(static_cast<size_t>(tokens)), start(size_t(tokens), 0),
      ctx(static_cast<size_t>(tokens));
  std::iota(locs.begin(), locs.end(), 0);  // page table [0, 1, …]: location = position
  for (int64_t t = 0; t < tokens; ++t) {
    ctx[size_t(t)] = int32_t(t + 1);
    w.sum_ctx += t + 1;
    w.sum_topk += std::min<int64_t>(kTopk, t + 1);
    if (t + 1 > kTopk) w.sum_scored_ctx += t + 1;
  }
  w.locs = host_i32(locs, {tokens});
  w.kv_start = host_i32(start, {tokens});
  w.ctx_len = host_i32(ctx, {tokens});

  // Selection: every position while t + 1 <= k, else k random positions of [0, t], ascending.
  std::vector<int32_t> topk(size_t(tokens * kTopk), -1), perm;
  for (int64_t t = 0; t < tokens; ++t) {
    int32_t* row = topk.data() + t * kTopk;
    perm.resize(size_t(t + 1));
    std::iota(perm.begin(), perm.end(), 0);
    const int64_t n = std::min<int64_t>(kTopk, t + 1);
    for (int64_t j = 0; j < n && t + 1 > kTopk; ++j)
      std::swap(perm[size_t(j)], perm[size_t(j + int64_t(gen() % uint64_t(t + 1 - j)))]);
    std::sort(perm.begin(), perm.begin() + n);
    std::copy_n(perm.begin(), n, row);
  }
  w.topk_locs = host_i32(topk, {tokens, kTopk});

  w.c_kv = random_host(rng, DType::kBF16, {tokens, kDc});
  w.k_pe = random_host(rng, DType::kBF16, {tokens, kDrope});
  w.idx_q = random_host(rng, DType::kBF16, {tokens, kIndexHeads, kIndexDim});
  w.idx_w = random_host(rng, DType::kF32, {tokens, kIndexHeads});
  w.idx_k = random_host(rng, DType::kBF16, {tokens, kIndexDim});
  w.kv_b_proj = random_host(rng, DType::kBF16, {kHeads * (kDnope + kDv), kDc});
  w.q_nope = random_host(rng, DType::kBF16, {tokens, kHeads, kDnope});
  w.q_pe = random_host(rng, DType::kBF16, {tokens, kHeads, kDrope});
  w.q_abs = random_host(rng, DType::kF32, {tokens, kHeads, kDc});
  w.o_lat = random_host(rng, DType::kF32, {tokens, kHeads, kDc});
  w.k_nope = random_host(rng, DType::kF32, {tokens, kHeads, kDnope});
  w.v = random_host(rng, DType::kF32, {tokens, kHeads, kDv});

  std::unique_ptr<Backend> backend = make_cpu_backend();
  for (const KvLayout layout : {KvLayout::kBf16, KvLayout::kFp8Scaled}) {
    KvPoolDesc desc;
    desc.layout = layout;
    desc.page_size = kPageSize;
    desc.num_pages = pages;
    PagedKvPool pool = backend->make_kv_pool(desc);
    backend->store_kv(pool, w.locs, w.c_kv, w.k_pe);
    w.pools.emplace(layout, std::move(pool));
  }
  IndexKeyPoolDesc index_desc;
  index_desc.page_size = kPageSize;
  index_desc.num_pages = pages;
  w.index_pool = backend->make_index_pool(index_desc);
  backend->store_index_keys(w.index_pool, w.locs, w.idx_k);
  return w;
}

// ---- per-benchmark plumbing --------------------------------------------------------------

struct Setup {
  const Workload& w;
  std::unique_ptr<Backend> backend;
};

Setup setup(benchmark::State& state) {
  return {workload(state.range(0)), make_cpu_backend(int(state.range(1)))};
}

KvLayout layout_arg(const benchmark::State& state) {
  return state.range(2) == 0 ? KvLayout::kBf16 : KvLayout::kFp8Scaled;
}

void set_counters(benchmark::State& state, double flops, double bytes) {
  using benchmark::Counter;
  if (flops > 0)
    state.counters["GFLOP/s"] = Counter(flops * 1e-9, Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = Counter(bytes * 1e-9, Counter::kIsIterationInvariantRate);
}

template <typename Op>
void run(benchmark::State& state, Backend& backend, Op&& op) {
  for (auto _ : state) {
    op();
    backend.synchronize();
  }
}

// ---- pool ----------------------------------------------------------------------------------

void BM_store_kv(benchmark::State& state) {
  Setup s = setup(state);
  KvPoolDesc desc = s.w.pools.at(layout_arg(state)).desc();
  PagedKvPool pool = s.backend->make_kv_pool(desc);
  run(state, *s.backend, [&] { s.backend->store_kv(pool, s.w.locs, s.w.c_kv, s.w.k_pe); });
  set_counters(state, 0, double(s.w.tokens) * (2 * (kDc + kDrope) + desc.bytes_per_token()));
}

void BM_gather_kv(benchmark::State& state) {
  Setup s = setup(state);
  const PagedKvPool& pool = s.w.pools.at(layout_arg(state));
  const Tensor c_kv = s.backend->empty(DType::kBF16, {s.w.tokens, kDc});
  const Tensor k_pe = s.backend->empty(DType::kBF16, {s.w.tokens, kDrope});
  run(state, *s.backend, [&] { s.backend->gather_kv(pool, s.w.locs, c_kv, k_pe); });
  set_counters(state, 0, double(s.w.tokens) * (pool.desc().bytes_per_token() + 2 * (kDc + kDrope)));
}

// ---- indexer -------------------------------------------------------------------------------

void BM_indexer_topk(benchmark::State& state) {
  Setup s = setup(state);
  IndexerArgs layout;
  layout.keys = &s.w.index_pool;
  layout.kv_locs = s.w.locs;
  layout.kv_start = s.w.kv_start;
  layout.ctx_len = s.w.ctx_len;
  const Tensor out = s.backend->empty(DType::kI32, {s.w.tokens, kTopk});
  run(state, *s.backend,
      [&] { s.backend->indexer_topk(s.w.idx_q, s.w.idx_w, layout, kTopk, out); });
  const double logits = double(s.w.sum_scored_ctx);  // identity-shortcut tokens compute none
  set_counters(state, 2.0 * kIndexHeads * kIndexDim * logits,
               double(s.w.tokens) * (kIndexHeads * (2 * kIndexDim + 4) + 4 * kTopk) +
                   logits * (kIndexDim + 4));
}

// ---- projections ---------------------------------------------------------------------------

constexpr double kWeightBytes = 2.0 * kHeads * (kDnope + kDv) * kDc;

void BM_absorb_q(benchmark::State& state) {
  Setup s = setup(state);
  const Tensor q_abs = s.backend->empty(DType::kF32, {s.w.tokens, kHeads, kDc});
  run(state, *s.backend, [&] { s.backend->absorb_q(s.w.q_nope, s.w.kv_b_proj, kDv, q_abs); });
  const double t = double(s.w.tokens);
  set_counters(state, 2.0 * t * kHeads * kDnope * kDc,
               t * kHeads * (2 * kDnope + 4 * kDc) + kWeightBytes);
}

void BM_up_proj_v(benchmark::State& state) {
  Setup s = setup(state);
  const Tensor o = s.backend->empty(DType::kBF16, {s.w.tokens, kHeads, kDv});
  run(state, *s.backend, [&] { s.backend->up_proj_v(s.w.o_lat, s.w.kv_b_proj, kDnope, o); });
  const double t = double(s.w.tokens);
  set_counters(state, 2.0 * t * kHeads * kDv * kDc,
               t * kHeads * (4 * kDc + 2 * kDv) + kWeightBytes);
}

void BM_up_proj_kv(benchmark::State& state) {
  Setup s = setup(state);
  const Tensor k_nope = s.backend->empty(DType::kF32, {s.w.tokens, kHeads, kDnope});
  const Tensor v = s.backend->empty(DType::kF32, {s.w.tokens, kHeads, kDv});
  run(state, *s.backend, [&] { s.backend->up_proj_kv(s.w.c_kv, s.w.kv_b_proj, k_nope, v); });
  const double t = double(s.w.tokens);
  set_counters(state, 2.0 * t * kHeads * (kDnope + kDv) * kDc,
               t * (2 * kDc + 4 * kHeads * (kDnope + kDv)) + kWeightBytes);
}

// ---- attention -----------------------------------------------------------------------------

void BM_sparse_mla(benchmark::State& state) {
  Setup s = setup(state);
  const PagedKvPool& pool = s.w.pools.at(layout_arg(state));
  const Tensor o_lat = s.backend->empty(DType::kF32, {s.w.tokens, kHeads, kDc});
  const Tensor lse = s.backend->empty(DType::kF32, {s.w.tokens, kHeads});
  SparseMlaArgs a;
  a.q_abs = s.w.q_abs;
  a.q_pe = s.w.q_pe;
  a.kv = &pool;
  a.indices = s.w.topk_locs;
  a.sm_scale = kSmScale;
  a.o_lat = o_lat;
  a.lse = lse;
  run(state, *s.backend, [&] { s.backend->sparse_mla(a); });
  const double t = double(s.w.tokens), slots = double(s.w.sum_topk);
  set_counters(state, 2.0 * kHeads * slots * (kDc + kDrope + kDc),
               slots * pool.desc().bytes_per_token() + t * 4 * kTopk +
                   t * kHeads * (4 * kDc + 2 * kDrope + 4 * kDc + 4));
}

void BM_dense_mha(benchmark::State& state) {
  Setup s = setup(state);
  const int32_t t = int32_t(s.w.tokens);
  const std::vector<int32_t> cu = {0, t};
  const Tensor cu_dev = host_i32(cu, {2});
  const Tensor o = s.backend->empty(DType::kBF16, {t, kHeads, kDv});
  const Tensor lse = s.backend->empty(DType::kF32, {t, kHeads});
  DenseMhaArgs a;
  a.q_nope = s.w.q_nope;
  a.q_pe = s.w.q_pe;
  a.k_nope = s.w.k_nope;
  a.k_pe = s.w.k_pe;
  a.v = s.w.v;
  a.cu_q = cu_dev;
  a.cu_kv = cu_dev;
  a.cu_q_host = cu.data();
  a.cu_kv_host = cu.data();
  a.num_requests = 1;
  a.sm_scale = kSmScale;
  a.o = o;
  a.lse = lse;
  run(state, *s.backend, [&] { s.backend->dense_mha(a); });
  const double tokens = double(t);
  set_counters(state, 2.0 * kHeads * double(s.w.sum_ctx) * (kDnope + kDrope + kDv),
               tokens * kHeads * (2 * (kDnope + kDrope) + 4 * (kDnope + kDv) + 2 * kDv + 4) +
                   tokens * 2 * kDrope);
}

// ---- registration --------------------------------------------------------------------------

const std::vector<int64_t> kTokens = {2048, 8192};
const std::vector<int64_t> kThreads = {1, 2};

void common(benchmark::internal::Benchmark* b) {
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}
void token_thread_args(benchmark::internal::Benchmark* b) {
  common(b);
  b->ArgNames({"T", "threads"})->ArgsProduct({kTokens, kThreads});
}
void token_thread_layout_args(benchmark::internal::Benchmark* b) {
  common(b);
  b->ArgNames({"T", "threads", "fp8"})->ArgsProduct({kTokens, kThreads, {0, 1}});
}
// The fp8 sparse path at T = 8192 alone would take minutes (gather-bound), so the default run
// measures fp8 at 2048 tokens and bf16 at both sizes.
void sparse_args(benchmark::internal::Benchmark* b) {
  common(b);
  b->ArgNames({"T", "threads", "fp8"});
  for (const int64_t threads : kThreads) {
    b->Args({2048, threads, 0})->Args({2048, threads, 1})->Args({8192, threads, 0});
  }
}

// The planner itself, which runs on every layer call: rule mode (mode 0), and cost mode (mode 1)
// with a profile entry of 49 calibration samples (the size dsakit calibrate writes) for a batch
// of R requests (half fresh 256-token prompts, half 16 new tokens on a 1,984-token prefix, so
// splits are weighed). Host time per plan.
void BM_plan(benchmark::State& state) {
  const bool cost = state.range(0) == 1;
  const int requests = int(state.range(1));
  const ModelConfig config = ModelConfig::preset("deepseek-v3.2").with_tp(8);
  Capabilities caps;
  caps.device = Device::kCuda;
  caps.device_name = "bench gpu";
  caps.sm_arch = 90;
  caps.dense_mha = true;
  Batch b;
  for (int r = 0; r < requests; ++r) {
    b.prefix_lens.push_back(r % 2 ? 1984 : 0);
    b.extend_lens.push_back(r % 2 ? 16 : 256);
  }
  b.page_tables.resize(size_t(requests));
  DispatchPolicy policy;
  if (cost) {
    CostEntry e;
    e.key = CostKey::of(caps.device_name, config, KvLayout::kFp8Scaled);
    for (AttentionPath path : {AttentionPath::kDenseMha, AttentionPath::kSparseMla}) {
      CostTerms& t = path == AttentionPath::kDenseMha ? e.dense : e.sparse;
      t.names = cost_terms(path);
      for (size_t i = 0; i < t.names.size(); ++i) t.coef_ms.push_back(1e-6 * double(i + 1));
    }
    std::mt19937 gen(3);
    for (int i = 0; i < 49; ++i) {
      const Batch one = [&] {
        Batch x;
        x.prefix_lens = {int32_t(gen() % 2048)};
        x.extend_lens = {int32_t(1 + gen() % 2048)};
        x.page_tables.resize(1);
        return x;
      }();
      e.samples.push_back({i % 2 ? AttentionPath::kDenseMha : AttentionPath::kSparseMla,
                           CostFeatures::of(one, config),
                           0.1 + 1e-3 * double(gen() % 1000),
                           {}});
    }
    CostProfile built;
    built.put(std::move(e));
    // Through the JSON reader, as a profile file is read.
    auto profile = std::make_shared<CostProfile>(CostProfile::from_json(built.to_json(), "bench"));
    policy.mode = DispatchMode::kCost;
    policy.profile = profile;
  }
  for (auto _ : state) {
    Plan p = plan_batch(b, config, KvLayout::kFp8Scaled, caps, policy);
    benchmark::DoNotOptimize(p);
  }
}
BENCHMARK(BM_plan)->ArgsProduct({{0, 1}, {1, 8, 64}})->ArgNames({"mode", "requests"});

BENCHMARK(BM_store_kv)->Apply(token_thread_layout_args);
BENCHMARK(BM_gather_kv)->Apply(token_thread_layout_args);
BENCHMARK(BM_indexer_topk)->Apply(token_thread_args);
BENCHMARK(BM_absorb_q)->Apply(token_thread_args);
BENCHMARK(BM_sparse_mla)->Apply(sparse_args);
BENCHMARK(BM_up_proj_v)->Apply(token_thread_args);
BENCHMARK(BM_up_proj_kv)->Apply(token_thread_args);
BENCHMARK(BM_dense_mha)->Apply(token_thread_args);

}  // namespace
}  // namespace dsakit

BENCHMARK_MAIN();
