// CUDA benchmark (docs/design.md#benchmarks): each stage of both paths and the whole layer, timed
// with CUDA events on the backend's stream (Backend::time_ms; warm-up, median of >= 20 runs, 3
// input sets rotated so the L2 does not flatter) beside its host enqueue time, next to the ceilings
// measured in the same run (device-to-device copy bandwidth, cuBLAS bf16 GEMM rate). Prints a
// table; --json FILE writes the rows.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "bench/issue_rate.h"
#include "bench/row_gather.h"
#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "dsakit/layer.h"
#include "src/cuda/attention/dispatch.h"
#include "src/cuda/cuda_backend.h"
#include "tools/harness.h"

namespace {

using namespace dsakit;

constexpr int kSets = 3;
constexpr int kRuns = 20;

// GPU time (Backend::time_ms: CUDA events around the call, from an idle stream) and host time
// (until the call returns, so the cost of enqueueing alone) of fn(i), i = run index to rotate
// input sets: medians over `runs` calls after 3 warm-up calls.
struct Timing {
  double ms = 0, host_ms = 0;
};
Timing time_ms(Backend& be, const std::function<void(int)>& fn, int runs = kRuns) {
  for (int i = 0; i < 3; ++i) fn(i);
  std::vector<double> ms, host;
  for (int i = 0; i < runs; ++i) {
    ms.push_back(be.time_ms([&] {
      const auto t0 = std::chrono::steady_clock::now();
      fn(i);
      host.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }));
  }
  const auto median = [](std::vector<double>& v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  return {median(ms), median(host)};
}

Tensor random_device(Backend& be, DType dtype, const std::vector<int64_t>& shape, uint64_t seed,
                     float stddev = 1.0f) {
  Tensor h = Tensor::host(dtype, shape);
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> d(0.f, stddev);
  for (int64_t i = 0; i < h.numel(); ++i) {
    if (dtype == DType::kBF16)
      h.ptr<bf16_t>()[i] = f32_to_bf16(d(gen));
    else
      h.ptr<float>()[i] = d(gen);
  }
  return be.to_device(h);
}

// Uniform bf16 values in [-scale, scale) from splitmix64, four per draw: fast enough for the
// multi-GB query tensors of the large sparse shapes (random, never zero).
Tensor uniform_bf16_device(Backend& be, const std::vector<int64_t>& shape, uint64_t seed,
                           float scale) {
  Tensor h = Tensor::host(DType::kBF16, shape);
  bf16_t* v = h.ptr<bf16_t>();
  const int64_t n = h.numel();
  uint64_t state = seed;
  for (int64_t i = 0; i < n; i += 4) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (int64_t j = 0; j < 4 && i + j < n; ++j) {
      const float u = float((z >> (16 * j)) & 0xFFFF) / 32768.0f - 1.0f;
      v[i + j] = f32_to_bf16(u * scale);
    }
  }
  return be.to_device(h);
}

struct Row {
  std::string shape, stage;
  Timing t;
  double flops = 0, bytes = 0;
};

// Which attention kernels time_each_kernel times (--wgmma-only: the sm90 ones alone).
bool g_time_mma_sync = true;

// --filter: the shapes to time (a regex searched in each shape's label); unset: all.
std::optional<std::regex> g_filter;
int g_selected = 0;  // shapes timed

// Whether the shape labelled `shape` is timed (and, if so, says so on stderr as `what`).
bool selected(const std::string& shape, const char* what) {
  if (g_filter && !std::regex_search(shape, *g_filter)) return false;
  ++g_selected;
  std::fprintf(stderr, "[bench] %s%s\n", what, shape.c_str());
  return true;
}

// Rows "<stem>_sm80" and "<stem>_sm90": fn(i) timed with each attention kernel forced through
// `option` (one of be.options()'s kernel choices, restored afterwards); a kernel without an
// instance for the shape (kUnsupported) adds no row.
void time_each_kernel(AttentionKernel& option, Backend& be, const std::string& shape,
                      const std::string& stem, double flops, const std::function<void(int)>& fn,
                      std::vector<Row>& rows) {
  const AttentionKernel previous = option;
  for (const auto& [kernel, suffix] : {std::pair{AttentionKernel::kMmaSync, "_sm80"},
                                       std::pair{AttentionKernel::kWgmma, "_sm90"}}) {
    if (kernel == AttentionKernel::kMmaSync && !g_time_mma_sync) continue;
    option = kernel;
    try {
      rows.push_back({shape, stem + suffix, time_ms(be, fn), flops, 0});
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kUnsupported) throw;
    }
  }
  option = previous;
}

// One fresh prompt of T tokens (a single request, causal) for config `c`.
std::vector<Row> bench_shape(cuda::CudaBackend& be, const ModelConfig& c, int64_t t,
                             KvLayout layout) {
  const std::string shape =
      fmt::format("{} H={} T={} {}", c.name, c.num_heads, t, to_string(layout));
  if (!selected(shape, "")) return {};
  const int64_t h = c.num_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, dc = c.kv_lora_rank, hi = c.index_n_heads, di = c.index_head_dim;
  const int k = c.index_topk;
  be.options().host_value_checks = false;  // time kernels, not host-side validation syncs

  // Causal counts.
  double sum_ctx = 0, sum_keff = 0;
  for (int64_t i = 0; i < t; ++i) {
    sum_ctx += double(i + 1);
    sum_keff += double(std::min<int64_t>(i + 1, k));
  }
  const int page = 64;
  const int64_t pages = (t + page - 1) / page;
  KvPoolDesc kd;
  kd.layout = layout;
  kd.page_size = page;
  kd.num_pages = pages;
  kd.d_c = int(dc);
  kd.d_rope = int(dr);
  struct Set {
    PagedKvPool kv;
    IndexKeyPool ix;
    Tensor q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w;
  };
  std::vector<Set> sets;
  for (int i = 0; i < kSets; ++i) {
    Set st{be.make_kv_pool(kd),
           be.make_index_pool({page, pages, int(di)}),
           random_device(be, DType::kBF16, {t, h, dn}, 10 + i),
           random_device(be, DType::kBF16, {t, h, dr}, 20 + i),
           random_device(be, DType::kBF16, {t, dc}, 30 + i),
           random_device(be, DType::kBF16, {t, dr}, 40 + i),
           random_device(be, DType::kBF16, {t, hi, di}, 50 + i),
           random_device(be, DType::kBF16, {t, di}, 60 + i),
           random_device(be, DType::kF32, {t, hi}, 70 + i)};
    sets.push_back(std::move(st));
  }
  const Tensor w = random_device(be, DType::kBF16, {h * (dn + dv), dc}, 99, 0.044f);
  std::vector<int32_t> locs_h(static_cast<size_t>(t)), start_h(static_cast<size_t>(t), 0),
      ctx_h(static_cast<size_t>(t)), cu_q_h{0, int32_t(t)}, cu_kv_h{0, int32_t(t)};
  for (int64_t i = 0; i < t; ++i) locs_h[size_t(i)] = int32_t(i), ctx_h[size_t(i)] = int32_t(i + 1);
  auto dev_i32 = [&](std::vector<int32_t>& v) {
    return be.to_device(make_view(v.data(), DType::kI32, Device::kCpu, {int64_t(v.size())}));
  };
  const Tensor locs = dev_i32(locs_h), start = dev_i32(start_h), ctx = dev_i32(ctx_h),
               cu_q = dev_i32(cu_q_h), cu_kv = dev_i32(cu_kv_h);
  for (auto& st : sets) {
    be.store_kv(st.kv, locs, st.c_kv, st.k_pe);
    be.store_index_keys(st.ix, locs, st.idx_k);
  }
  const int bpt = kd.bytes_per_token();
  std::vector<Row> rows;
  auto add = [&](const char* stage, Timing t, double flops, double bytes) {
    rows.push_back({shape, stage, t, flops, bytes});
  };

  add("store_kv",
      time_ms(be,
              [&](int i) {
                auto& st = sets[size_t(i % kSets)];
                be.store_kv(st.kv, locs, st.c_kv, st.k_pe);
              }),
      0, double(t) * (2.0 * (dc + dr) + bpt));
  add("store_index_keys",
      time_ms(be,
              [&](int i) {
                auto& st = sets[size_t(i % kSets)];
                be.store_index_keys(st.ix, locs, st.idx_k);
              }),
      0, double(t) * 2.0 * 2 * di);
  // The layer's one host -> device copy of its index arrays (3T + N + 2(B + 1) i32).
  std::vector<int32_t> index_h(size_t(4 * t + 4), 1);
  add("upload_index", time_ms(be, [&](int) { dev_i32(index_h); }), 0, 4.0 * double(index_h.size()));
  Tensor c_all = be.empty(DType::kBF16, {t, dc}), kpe_all = be.empty(DType::kBF16, {t, dr});
  add("gather_kv",
      time_ms(be, [&](int i) { be.gather_kv(sets[size_t(i % kSets)].kv, locs, c_all, kpe_all); }),
      0, double(t) * (bpt + 2.0 * (dc + dr)));
  Tensor top = be.empty(DType::kI32, {t, k});
  add("indexer_topk",
      time_ms(
          be,
          [&](int i) {
            auto& st = sets[size_t(i % kSets)];
            IndexerArgs a;
            a.keys = &st.ix;
            a.kv_locs = locs;
            a.kv_start = start;
            a.ctx_len = ctx;
            be.indexer_topk(st.idx_q, st.idx_w, a, k, top);
          },
          5),
      2.0 * hi * di * sum_ctx, 0);
  Tensor loc_top = be.empty(DType::kI32, {t, k});
  add("topk_to_locations",
      time_ms(be, [&](int) { be.positions_to_locations(top, locs, start, ctx, loc_top); }), 0,
      8.0 * double(t) * k);
  Tensor q_abs = be.empty(DType::kBF16, {t, h, dc});
  add("absorb_q",
      time_ms(be, [&](int i) { be.absorb_q(sets[size_t(i % kSets)].q_nope, w, int(dv), q_abs); }),
      2.0 * t * h * dn * dc, 0);
  Tensor o_lat = be.empty(DType::kBF16, {t, h, dc}), lse = be.empty(DType::kF32, {t, h});
  add("sparse_mla",
      time_ms(be,
              [&](int i) {
                auto& st = sets[size_t(i % kSets)];
                SparseMlaArgs a;
                a.q_abs = q_abs;
                a.q_pe = st.q_pe;
                a.kv = &st.kv;
                a.indices = loc_top;
                a.sm_scale = c.softmax_scale();
                a.o_lat = o_lat;
                a.lse = lse;
                be.sparse_mla(a);
              }),
      2.0 * h * sum_keff * (576 + 512), 0);
  Tensor o = be.empty(DType::kBF16, {t, h, dv});
  add("up_proj_v", time_ms(be, [&](int) { be.up_proj_v(o_lat, w, int(dn), o); }),
      2.0 * t * h * dc * dv, 0);
  Tensor k_nope = be.empty(DType::kBF16, {t, h, dn}), v = be.empty(DType::kBF16, {t, h, dv});
  add("up_proj_kv", time_ms(be, [&](int) { be.up_proj_kv(c_all, w, k_nope, v); }),
      2.0 * t * h * dc * (dn + dv), 0);
  // What the layer runs: K and V as the halves of one buffer, one GEMM over all heads.
  Tensor kv_up = be.empty(DType::kBF16, {t, h, dn + dv});
  const KvHalves halves = kv_halves(kv_up, dn);
  add("up_proj_kv_halves",
      time_ms(be, [&](int) { be.up_proj_kv(c_all, w, halves.k_nope, halves.v); }),
      2.0 * t * h * dc * (dn + dv), 0);
  add("dense_mha",
      time_ms(be,
              [&](int i) {
                auto& st = sets[size_t(i % kSets)];
                DenseMhaArgs a;
                a.q_nope = st.q_nope;
                a.q_pe = st.q_pe;
                a.k_nope = k_nope;
                a.k_pe = kpe_all;
                a.v = v;
                a.cu_q = cu_q;
                a.cu_kv = cu_kv;
                a.cu_q_host = cu_q_h.data();
                a.cu_kv_host = cu_kv_h.data();
                a.num_requests = 1;
                a.sm_scale = c.softmax_scale();
                a.o = o;
                a.lse = lse;
                be.dense_mha(a);
              }),
      2.0 * h * sum_ctx * (dn + dr + dv), 0);
  be.options().host_value_checks = true;
  return rows;
}

// kv_mask bits [T, words] for one fresh causal prompt of T tokens: query t keeps
// min(t + 1, keep) of its positions, drawn at random (a top-k's count, not its choice).
Tensor random_topk_mask(Backend& be, int64_t t, int keep, int64_t words, uint64_t seed) {
  std::vector<int32_t> bits(size_t(t * words), 0);
  std::mt19937_64 gen(seed);
  for (int64_t q = 0; q < t; ++q) {
    auto* row = reinterpret_cast<uint32_t*>(bits.data() + q * words);
    const int64_t visible = q + 1;
    if (visible <= keep) {
      for (int64_t p = 0; p < visible; ++p) row[p / 32] |= 1u << (p % 32);
      continue;
    }
    std::uniform_int_distribution<int64_t> pick(0, visible - 1);
    for (int kept = 0; kept < keep;) {
      const int64_t p = pick(gen);
      if ((row[p / 32] >> (p % 32)) & 1u) continue;
      row[p / 32] |= 1u << (p % 32);
      ++kept;
    }
  }
  return be.to_device(make_view(bits.data(), DType::kI32, Device::kCpu, {t, words}));
}

// The dense MHA kernels alone over one batch of requests (prefix P_r, extend E_r), every compiled
// kernel forced in turn: K / V as the halves of one [N, H, d_nope + d_v] buffer (what the layer's
// up-projection writes), bottom-right causal. FLOPs count visible (query, key) pairs. With
// mask_keep > 0 (one fresh prompt), also "dense_mha_masked": the same call with kv_mask keeping
// mask_keep positions per query (random_topk_mask): the sparse path's function as dense
// attention, the same blocks visited.
std::vector<Row> bench_dense(cuda::CudaBackend& be, const ModelConfig& c,
                             const std::vector<std::pair<int32_t, int32_t>>& prefix_extend,
                             int mask_keep = 0) {
  std::string batch;
  std::vector<int32_t> cu_q{0}, cu_kv{0};
  double pairs = 0;
  for (const auto& [p, e] : prefix_extend) {
    batch += fmt::format("{}{}{}", batch.empty() ? "" : ",", p > 0 ? fmt::format("{}+", p) : "", e);
    cu_q.push_back(cu_q.back() + e);
    cu_kv.push_back(cu_kv.back() + p + e);
    pairs += double(e) * p + double(e) * (e + 1) / 2;
  }
  const std::string shape = fmt::format("{} H={} [{}]", c.name, c.num_heads, batch);
  if (!selected(shape, "dense ")) return {};
  const int64_t h = c.num_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim,
                dv = c.v_head_dim, t = cu_q.back(), n = cu_kv.back();
  be.options().host_value_checks = false;
  const auto dev_i32 = [&](std::vector<int32_t>& v) {
    return be.to_device(make_view(v.data(), DType::kI32, Device::kCpu, {int64_t(v.size())}));
  };
  const Tensor cu_q_d = dev_i32(cu_q), cu_kv_d = dev_i32(cu_kv);
  std::vector<Tensor> q_nope, q_pe, kv_up;
  for (int i = 0; i < kSets; ++i) {
    q_nope.push_back(uniform_bf16_device(be, {t, h, dn}, 10 + i, 1.f));
    q_pe.push_back(uniform_bf16_device(be, {t, h, dr}, 20 + i, 1.f));
    kv_up.push_back(uniform_bf16_device(be, {n, h, dn + dv}, 30 + i, 1.f));
  }
  const Tensor k_pe = uniform_bf16_device(be, {n, dr}, 40, 1.f);
  Tensor o = be.empty(DType::kBF16, {t, h, dv}), lse = be.empty(DType::kF32, {t, h});
  Tensor mask;
  std::vector<Row> rows;
  const auto call = [&](int i) {
    const KvHalves halves = kv_halves(kv_up[size_t(i % kSets)], dn);
    DenseMhaArgs a;
    a.q_nope = q_nope[size_t(i % kSets)];
    a.q_pe = q_pe[size_t(i % kSets)];
    a.k_nope = halves.k_nope;
    a.k_pe = k_pe;
    a.v = halves.v;
    a.cu_q = cu_q_d;
    a.cu_kv = cu_kv_d;
    a.cu_q_host = cu_q.data();
    a.cu_kv_host = cu_kv.data();
    a.num_requests = int(prefix_extend.size());
    a.sm_scale = c.softmax_scale();
    a.o = o;
    a.lse = lse;
    a.kv_mask = mask;
    be.dense_mha(a);
  };
  const double flops = 2.0 * h * pairs * (dn + dr + dv);
  time_each_kernel(be.options().dense_mha_kernel, be, shape, "dense_mha", flops, call, rows);
  if (mask_keep > 0 && prefix_extend.size() == 1 && prefix_extend[0].first == 0) {
    mask = random_topk_mask(be, t, mask_keep, (n + 31) / 32, 50);
    time_each_kernel(be.options().dense_mha_kernel, be, shape, "dense_mha_masked", flops, call,
                     rows);
  }
  be.options().host_value_checks = true;
  return rows;
}

// One fresh causal prompt of T tokens at pool locations 0 … T-1, on the device: kv_locs,
// kv_start (all 0) and ctx_len (t + 1) for the indexer and the sparse kernels.
struct CausalPrompt {
  Tensor locs, start, ctx;
};
CausalPrompt causal_prompt(Backend& be, int64_t t) {
  std::vector<int32_t> locs(static_cast<size_t>(t)), start(static_cast<size_t>(t), 0),
      ctx(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) locs[size_t(i)] = int32_t(i), ctx[size_t(i)] = int32_t(i + 1);
  auto dev_i32 = [&](std::vector<int32_t>& v) {
    return be.to_device(make_view(v.data(), DType::kI32, Device::kCpu, {int64_t(v.size())}));
  };
  return {dev_i32(locs), dev_i32(start), dev_i32(ctx)};
}

// Pools the sparse rows rotate through: kSets, so a launch reads a pool the previous two did not
// (at 16K tokens three bf16 pools outgrow the 50 MB L2), or 1 (--one-pool: the layer's case, one
// pool written just before it is read).
int g_sparse_pools = kSets;

// The sparse MLA kernels alone over one fresh causal prompt of T tokens: the indexer's real top-k
// (pool locations), every compiled kernel forced in turn. FLOPs count valid (query, key) pairs.
std::vector<Row> bench_sparse(cuda::CudaBackend& be, const ModelConfig& c, int64_t t,
                              KvLayout layout) {
  const std::string shape = fmt::format("{} H={} T={} {}{}", c.name, c.num_heads, t,
                                        to_string(layout), g_sparse_pools == 1 ? " one-pool" : "");
  if (!selected(shape, "sparse ")) return {};
  const int64_t h = c.num_heads, dr = c.qk_rope_head_dim, dc = c.kv_lora_rank, hi = c.index_n_heads,
                di = c.index_head_dim;
  const int k = c.index_topk;
  be.options().host_value_checks = false;
  double sum_keff = 0;
  for (int64_t i = 0; i < t; ++i) sum_keff += double(std::min<int64_t>(i + 1, k));
  KvPoolDesc kd;
  kd.layout = layout;
  kd.num_pages = (t + 63) / 64;
  kd.d_c = int(dc);
  kd.d_rope = int(dr);
  // pow2 scales: the one policy both kernels read exactly (the wgmma kernel refuses amax).
  kd.scale_policy = ScalePolicy::kPow2;
  std::vector<PagedKvPool> pools;
  const CausalPrompt prompt = causal_prompt(be, t);
  const Tensor &locs = prompt.locs, &start = prompt.start, &ctx = prompt.ctx;
  for (int i = 0; i < g_sparse_pools; ++i) {
    pools.push_back(be.make_kv_pool(kd));
    be.store_kv(pools.back(), locs, random_device(be, DType::kBF16, {t, dc}, 30 + i),
                random_device(be, DType::kBF16, {t, dr}, 40 + i));
  }
  // One query set (read once per CTA, streamed); the pools rotate.
  const Tensor q_abs = uniform_bf16_device(be, {t, h, dc}, 10, 0.1f);
  const Tensor q_pe = uniform_bf16_device(be, {t, h, dr}, 20, 1.0f);
  IndexKeyPool ix = be.make_index_pool({64, kd.num_pages, int(di)});
  be.store_index_keys(ix, locs, random_device(be, DType::kBF16, {t, di}, 60));
  Tensor top = be.empty(DType::kI32, {t, k}), loc_top = be.empty(DType::kI32, {t, k});
  IndexerArgs a;
  a.keys = &ix;
  a.kv_locs = locs;
  a.kv_start = start;
  a.ctx_len = ctx;
  be.indexer_topk(random_device(be, DType::kBF16, {t, hi, di}, 50),
                  random_device(be, DType::kF32, {t, hi}, 70), a, k, top);
  be.positions_to_locations(top, locs, start, ctx, loc_top);
  Tensor o_lat = be.empty(DType::kBF16, {t, h, dc}), lse = be.empty(DType::kF32, {t, h});
  std::vector<Row> rows;
  const double flops = 2.0 * h * sum_keff * (576 + 512);
  const auto run = [&](int i) {
    SparseMlaArgs s;
    s.q_abs = q_abs;
    s.q_pe = q_pe;
    s.kv = &pools[size_t(i) % pools.size()];
    s.indices = loc_top;
    s.topk_length = ctx;
    s.sm_scale = c.softmax_scale();
    s.o_lat = o_lat;
    s.lse = lse;
    be.sparse_mla(s);
  };
  time_each_kernel(be.options().sparse_mla_kernel, be, shape, "sparse_mla", flops, run, rows);
  // Beside sparse_mla_sm90 (the kernel chosen by H and layout), the other wgmma variants that
  // take these heads: the 64-head kernel, and the keys-on-M kernel's items of 16 heads and (past
  // 16 heads) of 32 where it has them (sparse_mla_sm90_hN: DSAKIT_SPARSE_MLA_SM90_HEADS=N).
  {
    const bool few = cuda::attention::sparse_mla_sm90_few_heads_by_default(layout, h);
    const int chosen = few ? cuda::attention::sparse_mla_sm90_few_heads_item(layout, h) : 64;
    for (const int heads : {16, 32, 64}) {
      if (heads == chosen || (heads == 32 && h <= 16)) continue;
      if (heads != 64 &&
          (!cuda::attention::sparse_mla_sm90_few_heads_take(layout, h) ||
           !cuda::attention::dispatch_sparse_mla_sm90_few_heads(heads, layout, [](auto, auto) {})))
        continue;
      const cuda::CudaBackendOptions saved = be.options();
      be.options().sparse_mla_kernel = AttentionKernel::kWgmma;
      be.options().sparse_mla_sm90_heads = heads;
      try {
        rows.push_back(
            {shape, fmt::format("sparse_mla_sm90_h{}", heads), time_ms(be, run), flops, 0});
      } catch (const Error& e) {
        if (e.kind() != ErrorKind::kUnsupported) throw;
      }
      be.options() = saved;
    }
  }
  be.options().host_value_checks = true;
  // The gather alone (bench/row_gather.cu), one CTA per token and per 64-head group as the wgmma
  // kernel runs: its time is the floor of a kernel that must bring these rows into shared
  // memory. TFLOP/s here is the sparse kernel's FLOPs over that floor.
  const int groups = int((h + 63) / 64);
  bench::RowGatherParams g{pools[0].storage().ptr<const uint8_t>(),
                           loc_top.ptr<const int32_t>(),
                           ctx.ptr<const int32_t>(),
                           t,
                           kd.num_locations(),
                           kd.bytes_per_token(),
                           k,
                           groups};
  const Timing tg = time_ms(be, [&](int i) {
    g.pool = pools[size_t(i) % pools.size()].storage().ptr<const uint8_t>();
    DSAKIT_CHECK(bench::launch_row_gather(g, be.stream()) == cudaSuccess, kBackend,
                 "row_gather launch");
  });
  rows.push_back({shape, fmt::format("row_gather x{}", groups), tg,
                  2.0 * h * sum_keff * (576 + 512), sum_keff * groups * kd.bytes_per_token()});
  return rows;
}

// The indexer's kernels alone over one fresh causal prompt of T tokens (DeepSeek-V3.2: H_i 64,
// d_i 128, k 2048): the logits of every row past k (as indexer_topk computes them) by each
// logits kernel, top-k over those logits, and indexer_topk whole (the driver's row blocks).
// FLOPs: 2 · H_i · d_i per visible (row, key) pair of those rows.
std::vector<Row> bench_indexer(cuda::CudaBackend& be, const ModelConfig& c, int64_t t) {
  const std::string shape = fmt::format("{} H_i={} T={}", c.name, c.index_n_heads, t);
  if (!selected(shape, "indexer ")) return {};
  const int64_t hi = c.index_n_heads, di = c.index_head_dim;
  const int k = c.index_topk;
  be.options().host_value_checks = false;
  double pairs = 0;
  for (int64_t i = k; i < t; ++i) pairs += double(i + 1);
  const CausalPrompt prompt = causal_prompt(be, t);
  const Tensor &locs = prompt.locs, &start = prompt.start, &ctx = prompt.ctx;
  IndexKeyPool ix = be.make_index_pool({64, (t + 63) / 64, int(di)});
  be.store_index_keys(ix, locs, random_device(be, DType::kBF16, {t, di}, 60));
  const Tensor idx_q = random_device(be, DType::kBF16, {t, hi, di}, 50);
  const Tensor idx_w = random_device(be, DType::kF32, {t, hi}, 70);
  const Tensor q8 = be.empty(DType::kU8, {t, hi, di}), gate = be.empty(DType::kF32, {t, hi});
  be.indexer_quantize_q(idx_q, idx_w, q8, gate);
  IndexerArgs a;
  a.keys = &ix;
  a.q8 = q8;
  a.gate = gate;
  a.kv_locs = locs;
  a.kv_start = start;
  a.ctx_len = ctx;
  IndexerLogitsOptions o;
  o.skip_ctx_at_most = k;
  o.fill_masked = false;
  const Tensor logits = be.empty(DType::kF32, {t, t});
  std::vector<Row> rows;
  const int runs = t > 16384 ? 5 : 10;
  const cuda::CudaBackendOptions previous = be.options();
  constexpr std::pair<cuda::IndexerKernel, const char*> kLogitsKernels[] = {
      {cuda::IndexerKernel::kTensorCore, "mma_sync"},
      {cuda::IndexerKernel::kWgmmaExact, "wgmma_exact"},
      {cuda::IndexerKernel::kWgmma, "wgmma"}};
  for (const auto& [kernel, name] : kLogitsKernels) {
    be.options().indexer_kernel = kernel;
    rows.push_back({shape, fmt::format("logits_{}", name),
                    time_ms(
                        be, [&](int) { be.indexer_logits(a, 0, t, logits, o); }, runs),
                    2.0 * hi * di * pairs, 0});
  }
  // The e4m3 wgmma kernel over fixed key splits (work items per row group; the rows above choose
  // by indexer_logits_key_splits): what the split costs or saves at this length.
  be.options().indexer_kernel = cuda::IndexerKernel::kWgmma;
  for (int splits : {1, 2, 3, 4, 6}) {
    be.options().indexer_key_splits = splits;
    rows.push_back({shape, fmt::format("logits_wgmma x{}", splits),
                    time_ms(
                        be, [&](int) { be.indexer_logits(a, 0, t, logits, o); }, runs),
                    2.0 * hi * di * pairs, 0});
  }
  be.options().indexer_key_splits = 0;
  // Every row of the prompt, identity rows included: the problem DeepGEMM's fp8_mqa_logits was
  // timed on (docs/perf.md), FLOPs over all T (T + 1) / 2 pairs.
  IndexerLogitsOptions all_rows = o;
  all_rows.skip_ctx_at_most = -1;
  const double all_flops = 2.0 * hi * di * (double(t) * double(t + 1) / 2);
  rows.push_back({shape, "logits_wgmma all rows",
                  time_ms(
                      be, [&](int) { be.indexer_logits(a, 0, t, logits, all_rows); }, runs),
                  all_flops, 0});
  // The e4m3 kernel's device time: every row above starts its call on an idle GPU, so its time
  // includes the host's enqueue (host_ms); here kBackToBack launches go between one pair of
  // events and each launch's enqueue overlaps the kernel before it (per launch: the kernel and
  // the gap between two launches; DeepGEMM's figures are kernel durations). Ten launches in a
  // row also run the GPU longer under its power cap: at long prompts these rows can come out
  // slower than the single calls (docs/perf.md).
  constexpr int kBackToBack = 10;
  const auto back_to_back = [&](const IndexerLogitsOptions& opts) {
    Timing tm = time_ms(
        be,
        [&](int) {
          for (int j = 0; j < kBackToBack; ++j) be.indexer_logits(a, 0, t, logits, opts);
        },
        runs);
    tm.ms /= kBackToBack;
    tm.host_ms /= kBackToBack;
    return tm;
  };
  rows.push_back({shape, "logits_wgmma back-to-back", back_to_back(o), 2.0 * hi * di * pairs, 0});
  rows.push_back(
      {shape, "logits_wgmma all rows back-to-back", back_to_back(all_rows), all_flops, 0});
  be.options() = previous;  // host_value_checks stays off
  Tensor top = be.empty(DType::kI32, {t, k});
  // Each block size of the top-k kernel, then its choice by width ("topk").
  for (int threads : {256, 512, 1024, 0}) {
    be.options().topk_threads = threads;
    rows.push_back({shape, threads ? fmt::format("topk t{}", threads) : std::string("topk"),
                    time_ms(
                        be, [&](int) { be.topk(logits, ctx, k, top); }, runs),
                    0, 4.0 * pairs});
  }
  rows.push_back({shape, "quantize_q",
                  time_ms(
                      be, [&](int) { be.indexer_quantize_q(idx_q, idx_w, q8, gate); }, runs),
                  0, double(t * hi) * (2.0 * di + di + 8)});
  // indexer_topk whole on the default logits kernel, then on each other one.
  rows.push_back({shape, "indexer_topk",
                  time_ms(
                      be, [&](int) { be.indexer_topk(idx_q, idx_w, a, k, top); }, runs),
                  0, 0});
  for (const auto& [kernel, name] : kLogitsKernels) {
    if (kernel == previous.indexer_kernel) continue;
    be.options().indexer_kernel = kernel;
    rows.push_back({shape, fmt::format("indexer_topk {}", name),
                    time_ms(
                        be, [&](int) { be.indexer_topk(idx_q, idx_w, a, k, top); }, runs),
                    0, 0});
  }
  be.options().indexer_kernel = previous.indexer_kernel;
  // With every row in one block (no 256 MiB bound): what the blocking costs.
  constexpr const char* kBoundEnv = "DSAKIT_INDEXER_WORKSPACE_BYTES";
  const char* user_bound = std::getenv(kBoundEnv);
  const std::optional<std::string> saved =
      user_bound ? std::optional<std::string>(user_bound) : std::nullopt;
  const std::string bound = fmt::format("{}", int64_t(t) * (hi * di + 4 * hi + 4 * t));
  setenv(kBoundEnv, bound.c_str(), 1);
  rows.push_back({shape, "indexer_topk 1blk",
                  time_ms(
                      be, [&](int) { be.indexer_topk(idx_q, idx_w, a, k, top); }, runs),
                  0, 0});
  if (saved)  // the user's bound again for the next rows
    setenv(kBoundEnv, saved->c_str(), 1);
  else
    unsetenv(kBoundEnv);
  be.options().host_value_checks = true;
  return rows;
}

// Whole layer (store + plan + path + outputs, host staging included) for fresh prompts, dense
// vs sparse, contexts within index_topk (where both are exact).
std::vector<Row> bench_layer(cuda::CudaBackend& be, const ModelConfig& c, int64_t t,
                             KvLayout layout) {
  std::vector<Row> rows;
  const std::string shape =
      fmt::format("{} H={} T={} layer {}", c.name, c.num_heads, t, to_string(layout));
  if (!selected(shape, "")) return {};
  const std::vector<int32_t> len = {int32_t(t)};
  const TokenStore tokens = random_token_store(c, len, 5);
  // kv_b_proj in its FP8 checkpoint form and as bf16 (the same weights exactly).
  const Fp8KvBProj w_fp8 = random_fp8_kv_b_proj(c, 6);
  const Tensor w = be.to_device(w_fp8.bf16);
  const Tensor w_codes = be.to_device(w_fp8.codes), w_scales = be.to_device(w_fp8.scales);
  KvPoolDesc kd;
  kd.layout = layout;
  kd.num_pages = (t + 63) / 64 + 1;
  kd.d_c = c.kv_lora_rank;
  kd.d_rope = c.qk_rope_head_dim;
  kd.scale_policy = ScalePolicy::kPow2;  // as dsakit's own writers store (the wgmma sparse kernel)
  PagedKvPool kv = be.make_kv_pool(kd);
  IndexKeyPool ix = be.make_index_pool({64, kd.num_pages, c.index_head_dim});
  const auto tables = allocate_pages(len, 64, kd.num_pages, 7);
  std::vector<int64_t> all(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) all[size_t(i)] = i;
  const auto in = tokens.slice(be, all);
  Batch b;
  b.prefix_lens = {0};
  b.extend_lens = {int32_t(t)};
  b.page_tables = tables;
  for (DispatchMode m : {DispatchMode::kDense, DispatchMode::kSparse}) {
    LayerOptions o;
    o.policy.mode = m;
    DsaAttention layer(c, be, kv, ix, w, o);
    const Timing t = time_ms(
        be, [&](int) { layer.forward(b, in.view()); }, 10);
    rows.push_back({shape, std::string("layer_") + to_string(m), t, 0, 0});
  }
  // The dense layer as an engine calls it: the batch prepared once per step for all of the
  // model's layers (plan, page tables, their upload), the outputs its own buffers; per layer
  // the store and the path's launches.
  LayerOptions o;
  o.policy.mode = DispatchMode::kDense;
  const Tensor out_o = be.empty(o.output_dtype, {t, c.num_heads, c.v_head_dim});
  const Tensor out_lse = be.empty(DType::kF32, {t, c.num_heads});
  LayerOutputs outs;
  outs.o = out_o;
  outs.lse = out_lse;
  {
    DsaAttention layer(c, be, kv, ix, w, o);
    const PreparedBatch prepared = layer.prepare(b);
    rows.push_back({shape, "layer_dense prepared",
                    time_ms(
                        be, [&](int) { layer.forward(prepared, in.view(), outs); }, 10),
                    0, 0});
  }
  if (layout == KvLayout::kBf16 || !be.capabilities().fp8_up_proj) return rows;
  // The same with kv_b_proj's FP8 form (LayerOptions::kv_b_proj_fp8): the K/V up-projection
  // as a block-scaled FP8 GEMM on the pool's codes.
  o.kv_b_proj_fp8 = {w_codes, w_scales};
  DsaAttention layer(c, be, kv, ix, w, o);
  rows.push_back({shape, "layer_dense fp8-weights",
                  time_ms(
                      be, [&](int) { layer.forward(b, in.view()); }, 10),
                  0, 0});
  const PreparedBatch prepared = layer.prepare(b);
  rows.push_back({shape, "layer_dense fp8-weights prepared",
                  time_ms(
                      be, [&](int) { layer.forward(prepared, in.view(), outs); }, 10),
                  0, 0});
  // The two up-projections alone over the prompt's rows (FLOPs 2 · T · H (d_nope + d_v) · d_c):
  // gather (dequantize) + bf16 GEMM, and the FP8 GEMM on the codes.
  const int64_t h = c.num_heads, dn = c.qk_nope_head_dim, dv = c.v_head_dim;
  const double flop = 2.0 * double(t) * double(h * (dn + dv)) * c.kv_lora_rank;
  std::vector<int32_t> locs(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i)
    locs[size_t(i)] = tables[0][size_t(i / 64)] * 64 + int32_t(i % 64);
  Tensor host_locs = Tensor::host(DType::kI32, {t});
  std::copy(locs.begin(), locs.end(), host_locs.ptr<int32_t>());
  const Tensor d_locs = be.to_device(host_locs);
  const Tensor c_all = be.empty(DType::kBF16, {t, c.kv_lora_rank});
  const Tensor kpe_all = be.empty(DType::kBF16, {t, c.qk_rope_head_dim});
  const Tensor kv_up = be.empty(DType::kBF16, {t, h, dn + dv});
  const KvHalves halves = kv_halves(kv_up, dn);
  rows.push_back({shape, "gather + up_proj_kv",
                  time_ms(
                      be,
                      [&](int) {
                        be.gather_kv(kv, d_locs, c_all, kpe_all);
                        be.up_proj_kv(c_all, w, halves.k_nope, halves.v);
                      },
                      10),
                  flop, 0});
  rows.push_back({shape, "up_proj_kv_fp8",
                  time_ms(
                      be,
                      [&](int) {
                        be.up_proj_kv_fp8(kv, d_locs, o.kv_b_proj_fp8, halves.k_nope, halves.v,
                                          kpe_all);
                      },
                      10),
                  flop, 0});
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  bool quick = false, sparse = false, indexer = false, dense = false, layer = false;
  bool issue_rates = false;
  std::vector<KvLayout> sparse_layouts = {KvLayout::kBf16, KvLayout::kFp8Scaled, KvLayout::kFp8Raw};
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc)
      json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--quick"))
      quick = true;
    else if (!std::strcmp(argv[i], "--sparse"))
      sparse = true;
    else if (!std::strcmp(argv[i], "--indexer"))
      indexer = true;
    else if (!std::strcmp(argv[i], "--dense"))
      dense = true;
    else if (!std::strcmp(argv[i], "--layer"))
      layer = true;
    else if (!std::strcmp(argv[i], "--issue-rates"))
      issue_rates = true;
    else if (!std::strcmp(argv[i], "--wgmma-only"))
      g_time_mma_sync = false;
    else if (!std::strcmp(argv[i], "--one-pool"))
      g_sparse_pools = 1;
    else if (!std::strcmp(argv[i], "--kv") && i + 1 < argc) {
      try {
        sparse_layouts = {parse_kv_layout(argv[++i])};
      } catch (const Error& e) {
        std::fprintf(stderr, "dsakit_bench_cuda: --kv: %s\n", e.what());
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) {
      try {
        g_filter.emplace(argv[++i]);
      } catch (const std::regex_error& e) {
        std::fprintf(stderr, "dsakit_bench_cuda: --filter: not a regular expression: %s (%s)\n",
                     argv[i], e.what());
        return 2;
      }
    } else {
      std::fprintf(stderr,
                   "usage: dsakit_bench_cuda [--json FILE] [--quick] [--sparse] [--indexer] "
                   "[--dense] [--layer] [--issue-rates] [--wgmma-only] [--kv bf16|fp8|fp8-raw] "
                   "[--one-pool] [--filter REGEX]\n"
                   "  --sparse: only the sparse MLA kernels, every compiled kernel per shape\n"
                   "  --dense: only the dense MHA kernels, every compiled kernel per shape\n"
                   "  --layer: only the whole-layer rows (dsakit's layer, end to end)\n"
                   "  --indexer: only the indexer's logits kernels, top-k and indexer_topk\n"
                   "  --issue-rates: warp instructions an SM issues per clock of the widening\n"
                   "    conversion, the widening by bits and the ALU instructions beside them\n"
                   "    (bench/issue_rate.cu)\n"
                   "  --wgmma-only: with --sparse / --dense, time the sm90 kernels alone\n"
                   "  --kv: with --sparse, one pool layout instead of all three\n"
                   "  --one-pool: with --sparse, every launch reads one pool (shapes labelled\n"
                   "    'one-pool'; by default three pools rotate, so L2 holds no launch's pool\n"
                   "    from the one before it once three pools outgrow it)\n"
                   "  --filter: only the shapes whose label (as printed in the table's first\n"
                   "    column) contains a match, e.g. --filter 'glm-5 H=64 \\[(4096|8192)\\]'\n");
      return 2;
    }
  }
  try {
    if (cuda_device_count() == 0) {
      std::fprintf(stderr, "dsakit_bench_cuda: no GPU visible\n");
      return 2;
    }
    const bool kernels_only = sparse || indexer || dense || issue_rates;  // no stage or layer rows
    const bool stages = !kernels_only && !layer;
    cuda::CudaBackend be(0);
    const Backend::Ceilings ceil = be.measure_ceilings();
    std::vector<Row> rows;
    const ModelConfig ds = ModelConfig::preset("deepseek-v3.2");
    const ModelConfig glm = ModelConfig::preset("glm-5");
    if (indexer) {
      for (int64_t t : quick ? std::vector<int64_t>{4096}
                             : std::vector<int64_t>{4096, 8192, 16384, 32768, 65536}) {
        auto r = bench_indexer(be, ds, t);
        rows.insert(rows.end(), r.begin(), r.end());
      }
    }
    if (dense) {
      using Batch = std::vector<std::pair<int32_t, int32_t>>;
      const std::vector<int32_t> lengths =
          quick ? std::vector<int32_t>{4096}
                : std::vector<int32_t>{256, 512, 1024, 2048, 4096, 8192, 16384};
      for (const ModelConfig& m : {ds, ds.with_tp(4), ds.with_tp(8), glm, glm.with_tp(4)})
        for (int32_t t : lengths) {
          // The TP-shard targets stop at 4K; short prompts (grids of one wave or less) on the
          // shards only.
          if (m.num_heads < 64 ? t > 4096 : t < 1024) continue;
          // DeepSeek-V3.2 beyond its top-k: also with the top-k as kv_mask (the sparse path's
          // output; compare with --sparse's rows of the same length).
          const int keep = m.name == ds.name && t > m.index_topk ? m.index_topk : 0;
          auto r = bench_dense(be, m, Batch{{0, t}}, keep);
          rows.insert(rows.end(), r.begin(), r.end());
        }
      // Varlen batches with cached prefixes, each followed by the fresh prompt of the same
      // FLOPs (issue 15's comparison): T with T (T + 1) / 2 nearest the batch's visible pairs.
      // The third: short extends over prefixes only (chunked prefill's last chunks), tiles of
      // <= 64 rows.
      for (const ModelConfig& m : {ds, ds.with_tp(4), ds.with_tp(8)})
        for (const Batch& b : {Batch{{0, 1500}, {0, 700}}, Batch{{1984, 64}, {0, 512}, {1900, 100}},
                               Batch{{1984, 64}, {1000, 40}}}) {
          double pairs = 0;
          for (const auto& [prefix, extend] : b)
            pairs += double(extend) * prefix + double(extend) * (extend + 1) / 2;
          const auto fresh = int32_t(std::lround((std::sqrt(8 * pairs + 1) - 1) / 2));
          for (const Batch& run : {b, Batch{{0, fresh}}}) {
            auto r = bench_dense(be, m, run);
            rows.insert(rows.end(), r.begin(), r.end());
          }
        }
    }
    if (sparse) {
      for (KvLayout layout : sparse_layouts)
        for (int tp : {1, 2, 4, 8}) {
          // H = 128 and 64 at 4K, 8K and 16K (the lengths of the sparse targets, docs/perf.md);
          // the TP shards at 4K and 16K.
          const std::vector<int64_t> lengths = quick     ? std::vector<int64_t>{4096}
                                               : tp <= 2 ? std::vector<int64_t>{4096, 8192, 16384}
                                                         : std::vector<int64_t>{4096, 16384};
          for (int64_t t : lengths) {
            auto r = bench_sparse(be, ds.with_tp(tp), t, layout);
            rows.insert(rows.end(), r.begin(), r.end());
          }
        }
      // Short prompts at 16 heads (every row within k), on the default pool and a bf16 one.
      for (KvLayout layout : {KvLayout::kFp8Scaled, KvLayout::kBf16})
        for (int64_t t : {256, 2048}) {
          auto r = bench_sparse(be, ds.with_tp(8), t, layout);
          rows.insert(rows.end(), r.begin(), r.end());
        }
    }
    for (int tp : !stages ? std::vector<int>{} : std::vector<int>{1, 8})
      for (int64_t t : quick ? std::vector<int64_t>{4096} : std::vector<int64_t>{4096, 16384}) {
        auto r = bench_shape(be, ds.with_tp(tp), t, KvLayout::kFp8Scaled);
        rows.insert(rows.end(), r.begin(), r.end());
      }
    for (int tp : !stages ? std::vector<int>{} : std::vector<int>{1, 4}) {
      auto r = bench_shape(be, glm.with_tp(tp), 4096, KvLayout::kBf16);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    // Short prompts with 16 heads, where the host's enqueue cost competes with the GPU's time.
    for (const ModelConfig& c : !stages ? std::vector<ModelConfig>{}
                                        : std::vector<ModelConfig>{ds.with_tp(8), glm.with_tp(4)}) {
      auto r = bench_shape(be, c, 256, KvLayout::kBf16);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    for (int tp : kernels_only ? std::vector<int>{} : std::vector<int>{1, 8})
      for (int64_t t : {1024, 2048}) {
        auto r = bench_layer(be, ds.with_tp(tp), t, KvLayout::kFp8Scaled);
        rows.insert(rows.end(), r.begin(), r.end());
      }
    for (const ModelConfig& c : kernels_only
                                    ? std::vector<ModelConfig>{}
                                    : std::vector<ModelConfig>{ds.with_tp(8), glm.with_tp(4)}) {
      auto r = bench_layer(be, c, 256, KvLayout::kBf16);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    if (g_filter && g_selected == 0) {
      std::fprintf(stderr, "dsakit_bench_cuda: --filter matched no shape of this run\n");
      return 2;
    }
    fmt::print("device {}  ceilings: copy {:.0f} GB/s, cuBLAS bf16 GEMM {:.0f} TFLOP/s\n",
               be.capabilities().device_name, ceil.copy_gbs, ceil.gemm_tflops);
    nlohmann::json j;
    if (issue_rates) {
      int num_sms = 0;
      DSAKIT_CHECK(
          cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess,
          kBackend, "multiprocessor count");
      fmt::print(
          "{:<28} {:>12} {:>10} {:>10} {:>10}  (warp instructions per SM per clock, one CTA an "
          "SM; steps: pairs widened, for the widenings)\n",
          "issue rate", "median", "min", "max", "steps");
      for (bench::IssueOp op : bench::kIssueOps) {
        std::vector<double> per_sm;
        const cudaError_t err = bench::measure_issue_rate(op, num_sms, per_sm, be.stream());
        DSAKIT_CHECK(err == cudaSuccess && !per_sm.empty(), kBackend, "issue rate of ",
                     bench::issue_op_name(op), ": ", cudaGetErrorString(err));
        std::sort(per_sm.begin(), per_sm.end());
        const double median = per_sm[per_sm.size() / 2];
        fmt::print("{:<28} {:>12.3f} {:>10.3f} {:>10.3f} {:>10.3f}\n", bench::issue_op_name(op),
                   median, per_sm.front(), per_sm.back(),
                   median / bench::issue_op_instructions(op));
        j["issue_rates"][bench::issue_op_name(op)] = median;
      }
    }
    fmt::print("{:<34} {:<18} {:>9} {:>9} {:>7} {:>9} {:>7} {:>9}\n", "shape", "stage", "ms",
               "TFLOP/s", "%gemm", "GB/s", "%copy", "host ms");
    j["device"] = be.capabilities().device_name;
    j["copy_gbs"] = ceil.copy_gbs;
    j["gemm_tflops"] = ceil.gemm_tflops;
    for (const Row& r : rows) {
      const double tf = r.flops > 0 ? r.flops / (r.t.ms * 1e-3) / 1e12 : 0;
      const double gb = r.bytes > 0 ? r.bytes / (r.t.ms * 1e-3) / 1e9 : 0;
      fmt::print("{:<34} {:<18} {:>9.3f} {:>9.1f} {:>6.0f}% {:>9.0f} {:>6.0f}% {:>9.4f}\n", r.shape,
                 r.stage, r.t.ms, tf, 100 * tf / ceil.gemm_tflops, gb, 100 * gb / ceil.copy_gbs,
                 r.t.host_ms);
      j["rows"].push_back({{"shape", r.shape},
                           {"stage", r.stage},
                           {"ms", r.t.ms},
                           {"host_ms", r.t.host_ms},
                           {"tflops", tf},
                           {"gbs", gb}});
    }
    if (!json_path.empty()) std::ofstream(json_path) << j.dump(2) << "\n";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsakit_bench_cuda: %s\n", e.what());
    return 3;
  }
  return 0;
}
