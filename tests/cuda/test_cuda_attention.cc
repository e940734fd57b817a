// CUDA attention kernels (sparse MLA, dense MHA) through the Backend interface against the
// float64 reference, on random data. Skipped without a GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "dsakit/formats.h"
#include "src/cuda/attention/attention_ops.h"
#include "src/cuda/attention/dense_mha_schedule.h"
#include "src/cuda/attention/dispatch.h"
#include "src/cuda/cuda_backend.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::Rng;

class CudaAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = make_backend("cuda");
  }
  Tensor to_dev(const Tensor& host) { return backend_->to_device(host.view()); }
  Tensor poisoned(DType dtype, const std::vector<int64_t>& shape) {
    return testing::poisoned(*backend_, dtype, shape);
  }
  std::unique_ptr<Backend> backend_;
};

// Forces one attention kernel ("sm80" | "sm90") through its environment variable while alive.
struct KernelScope {
  KernelScope(const char* env, const char* name) : env_(env) { ::setenv(env, name, 1); }
  ~KernelScope() { ::unsetenv(env_); }
  const char* env_;
};

Tensor host_i32(const std::vector<int32_t>& v) {
  Tensor t = Tensor::host(DType::kI32, {int64_t(v.size())});
  std::memcpy(t.ptr<int32_t>(), v.data(), v.size() * sizeof(int32_t));
  return t;
}

// ---- sparse MLA --------------------------------------------------------------------------------

struct SparseCase {
  KvLayout layout;
  int num_tokens;
  int num_heads;
  int topk;
  bool use_topk_length;
  ScalePolicy scale_policy = ScalePolicy::kAmax;  // 656-byte pools only
  // Q's standard deviation; sm_scale is divided by it, so the logits keep their spread. Far
  // from 1 it checks the kernels that scale Q into a narrower type (the fp8-raw wgmma kernel's
  // f16 operands: beyond 65504 Q would overflow, below 2^-14 lose precision).
  float q_stddev = 1.f;
  // Logits rising with the pool location: `trend` log2 units per location (k_pe[i][0] grows with
  // i, q_pe[..][0] = q_stddev) and each token's indices in ascending order, so the running max
  // moves again and again across blocks (the wgmma kernel's deferred O rescale). Pools with a
  // bf16 rope only (the fp8-raw pool's codes saturate at 448 · k_scale).
  double trend = 0;
  // Values rising with the pool location: c_kv[i] times 2^(value_trend · i), its 128-column tile
  // t also times 2^(3t - 5), and each token's indices in ascending order, so a 656-byte pool's
  // tile scales differ and grow across blocks (the keys-on-M FP8 kernel's per-tile running
  // scale, few_heads_fp8_kernel.cuh). sm_scale is divided by the largest gain, so the logits stay
  // within a few units (fp32 logits of thousands would miss lse's absolute tolerance).
  double value_trend = 0;
  // With use_topk_length: a token whose topk_length is 0, so its work item has no block at all
  // (the keys-on-M kernels pair it in one CTA with a token that has blocks). -1: none.
  int no_block_token = -1;
};

struct SparseResult {
  std::vector<double> o_lat, lse, max_logits;
  std::vector<uint8_t> o_bits, lse_bits;
  reference::Attention ref;
};

class CudaSparseMla : public CudaAttention {
 protected:
  // Random pool (filled with store_kv), random indices with invalid and duplicate entries,
  // token 1 (if any) with no valid slot. Runs the kernel `runs` times (bits must agree).
  SparseResult run(const SparseCase& c, uint64_t seed) {
    Rng rng(seed);
    constexpr int kDc = 512, kDr = 64;
    KvPoolDesc desc;
    desc.layout = c.layout;
    desc.page_size = 64;
    desc.num_pages = 24;
    desc.k_scale = 0.05f;
    desc.scale_policy = c.scale_policy;
    PagedKvPool pool = backend_->make_kv_pool(desc);
    const int n = int(desc.num_locations());

    Tensor c_kv = testing::random_tensor(rng, DType::kBF16, {n, kDc}, 0.5f);
    Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {n, kDr}, 0.5f);
    const int max_gain = int(std::lround((n - 1) * c.value_trend)) + 4;  // log2, value_trend only
    const double sm_scale =
        1.0 / std::sqrt(192.0) / c.q_stddev / (c.value_trend != 0 ? std::ldexp(1.0, max_gain) : 1);
    for (int i = 0; i < n && c.value_trend != 0; ++i)
      for (int d = 0; d < kDc; ++d) {
        bf16_t& x = c_kv.ptr<bf16_t>()[int64_t(i) * kDc + d];
        x = f32_to_bf16(
            std::ldexp(bf16_to_f32(x), int(std::lround(i * c.value_trend)) + 3 * (d / 128) - 5));
      }
    for (int i = 0; i < n && c.trend != 0; ++i)
      k_pe.ptr<bf16_t>()[int64_t(i) * kDr] =
          f32_to_bf16(float(double(i) * c.trend / (sm_scale * c.q_stddev * 1.4426950408889634)));
    std::vector<int32_t> all_locs(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) all_locs[size_t(i)] = i;
    backend_->store_kv(pool, to_dev(host_i32(all_locs)).view(), to_dev(c_kv).view(),
                       to_dev(k_pe).view());

    const int t_n = c.num_tokens, h = c.num_heads, k = c.topk;
    std::vector<int32_t> idx(static_cast<size_t>(t_n) * k), len(static_cast<size_t>(t_n));
    for (int t = 0; t < t_n; ++t) {
      for (int j = 0; j < k; ++j) {
        int32_t v = int32_t(rng.randint(0, n - 1));
        switch (rng.randint(0, 15)) {
          case 0:
            v = -1;
            break;
          case 1:
            v = n + int32_t(rng.randint(0, 100));
            break;  // past the pool: skipped
          case 2:
            v = std::numeric_limits<int32_t>::min();
            break;
          case 3:
            if (j > 0) v = idx[size_t(t) * k + j - 1];
            break;  // duplicate
          default:
            break;
        }
        idx[size_t(t) * k + j] = v;
      }
      len[size_t(t)] = int32_t(rng.randint(0, k + 3));
      if (c.trend != 0 || c.value_trend != 0)
        std::sort(idx.begin() + int64_t(t) * k, idx.begin() + int64_t(t + 1) * k);
    }
    if (t_n > 1)
      for (int j = 0; j < k; ++j) idx[size_t(k) + j] = (j % 2) ? -1 : n;  // no valid slot
    if (c.no_block_token >= 0) len[size_t(c.no_block_token)] = 0;

    Tensor q_abs = testing::random_tensor(rng, DType::kBF16, {t_n, h, kDc}, c.q_stddev);
    Tensor q_pe = testing::random_tensor(rng, DType::kBF16, {t_n, h, kDr}, c.q_stddev);
    for (int64_t th = 0; th < int64_t(t_n) * h && c.trend != 0; ++th)
      q_pe.ptr<bf16_t>()[th * kDr] = f32_to_bf16(c.q_stddev);
    Tensor idx_h = Tensor::host(DType::kI32, {t_n, k});
    std::memcpy(idx_h.ptr<int32_t>(), idx.data(), idx.size() * sizeof(int32_t));
    Tensor q_abs_d = to_dev(q_abs), q_pe_d = to_dev(q_pe), idx_d = to_dev(idx_h);
    Tensor len_d = to_dev(host_i32(len));

    SparseMlaArgs a;
    a.q_abs = q_abs_d.view();
    a.q_pe = q_pe_d.view();
    a.kv = &pool;
    a.indices = idx_d.view();
    if (c.use_topk_length) a.topk_length = len_d.view();
    a.sm_scale = sm_scale;

    SparseResult out;
    for (int run = 0; run < 2; ++run) {
      Tensor o = poisoned(DType::kBF16, {t_n, h, kDc});
      Tensor lse = poisoned(DType::kF32, {t_n, h});
      Tensor max_logits = poisoned(DType::kF32, {t_n, h});
      a.o_lat = o.view();
      a.lse = lse.view();
      a.max_logits = max_logits.view();
      backend_->sparse_mla(a);
      Tensor o_h = backend_->to_host(o.view()), lse_h = backend_->to_host(lse.view());
      std::vector<uint8_t> ob(o_h.nbytes()), lb(lse_h.nbytes());
      std::memcpy(ob.data(), o_h.ptr<uint8_t>(), ob.size());
      std::memcpy(lb.data(), lse_h.ptr<uint8_t>(), lb.size());
      if (run == 0) {
        out.o_lat = testing::to_double(o_h.view());
        out.lse = testing::to_double(lse_h.view());
        out.max_logits = testing::to_double(backend_->to_host(max_logits.view()).view());
        out.o_bits = std::move(ob);
        out.lse_bits = std::move(lb);
      } else {
        EXPECT_EQ(ob, out.o_bits) << "o_lat differs between two identical runs";
        EXPECT_EQ(lb, out.lse_bits) << "lse differs between two identical runs";
      }
    }

    // Reference over the pool as the kernel reads it (dequantized rows).
    Tensor storage = backend_->to_host(pool.storage());
    const int row_bytes = desc.bytes_per_token();
    std::vector<double> kv(size_t(n) * (kDc + kDr));
    for (int i = 0; i < n; ++i)
      reference::decode_kv_row(desc.row(), storage.ptr<uint8_t>() + size_t(i) * row_bytes,
                               desc.k_scale, &kv[size_t(i) * (kDc + kDr)],
                               &kv[size_t(i) * (kDc + kDr) + kDc]);
    std::vector<double> q(size_t(t_n) * h * (kDc + kDr));
    const auto qa = testing::to_double(q_abs.view()), qp = testing::to_double(q_pe.view());
    for (size_t th = 0; th < size_t(t_n) * h; ++th) {
      for (int d = 0; d < kDc; ++d) q[th * (kDc + kDr) + d] = qa[th * kDc + d];
      for (int d = 0; d < kDr; ++d) q[th * (kDc + kDr) + kDc + d] = qp[th * kDr + d];
    }
    out.ref = reference::sparse_attention(q, kv, t_n, h, kDc + kDr, kDc, n, idx, k,
                                          c.use_topk_length ? &len : nullptr, a.sm_scale);
    return out;
  }
};

// o_lat, lse and max_logits against the float64 reference; token 1 (no valid slot) exactly 0 and
// +inf / -inf.
void expect_matches_reference(const SparseCase& c, const SparseResult& r) {
  const double tol = c.layout == KvLayout::kBf16 ? testing::kTolBf16 : testing::kTolFp8Pool;
  EXPECT_LE(testing::rel_l2(r.o_lat, r.ref.o), tol) << "o_lat rel-L2";
  EXPECT_LE(testing::max_abs_diff(r.lse, r.ref.lse), testing::kTolLse) << "lse";
  EXPECT_LE(testing::max_abs_diff(r.max_logits, r.ref.max_logit), testing::kTolLse) << "max_logits";
  // A token with nothing to attend to (token 1: no valid slot; no_block_token: topk_length 0):
  // o_lat exactly 0, lse +inf, max_logits -inf.
  const auto expect_empty = [&](size_t t) {
    const size_t h = size_t(c.num_heads);
    for (size_t i = t * h * 512; i < (t + 1) * h * 512; ++i)
      ASSERT_EQ(r.o_lat[i], 0.0) << "token " << t << " o_lat[" << i << "]";
    for (size_t i = t * h; i < (t + 1) * h; ++i) {
      ASSERT_EQ(r.lse[i], std::numeric_limits<double>::infinity()) << "token " << t;
      ASSERT_EQ(r.max_logits[i], -std::numeric_limits<double>::infinity()) << "token " << t;
    }
  };
  if (c.num_tokens > 1) expect_empty(1);
  if (c.no_block_token >= 0) expect_empty(size_t(c.no_block_token));
}

// Each case runs on every compiled kernel with an instance for its layout (the mma.sync kernel
// has all; the wgmma kernel's rows are in src/cuda/attention/instances.h), forced through
// DSAKIT_SPARSE_MLA_KERNEL.
TEST_F(CudaSparseMla, MatchesReferenceAcrossLayoutsHeadsAndTopk) {
  const std::vector<SparseCase> cases = {
      {KvLayout::kBf16, 5, 128, 100, false},
      {KvLayout::kBf16, 3, 16, 1, false},
      {KvLayout::kBf16, 3, 20, 2048, true},
      {KvLayout::kBf16, 4, 64, 300, true},
      {KvLayout::kBf16, 2, 128, 2048, false},
      {KvLayout::kBf16, 3, 65, 129, true},
      {KvLayout::kFp8Scaled, 5, 128, 100, true},
      {KvLayout::kFp8Scaled, 3, 16, 2048, false},
      {KvLayout::kFp8Scaled, 4, 64, 1, false},
      {KvLayout::kFp8Scaled, 3, 64, 700, true},
      {KvLayout::kFp8Raw, 4, 128, 2048, false},
      {KvLayout::kFp8Raw, 3, 16, 100, true},
      {KvLayout::kFp8Raw, 2, 7, 65, false},
      {KvLayout::kFp8Raw, 3, 32, 256, true},
      {KvLayout::kFp8Scaled, 5, 128, 100, true, ScalePolicy::kPow2},
      {KvLayout::kFp8Scaled, 4, 64, 1, false, ScalePolicy::kPow2},
      {KvLayout::kFp8Scaled, 3, 33, 700, true, ScalePolicy::kPow2},
      {KvLayout::kFp8Scaled, 2, 16, 2048, false, ScalePolicy::kPow2},
      {KvLayout::kFp8Raw, 3, 64, 300, true, ScalePolicy::kAmax, 3e4f},
      {KvLayout::kFp8Raw, 3, 20, 300, false, ScalePolicy::kAmax, 1e-6f},
      {KvLayout::kBf16, 2, 64, 300, true, ScalePolicy::kAmax, 3e4f},
      // The running max passing the 8-unit slack within every block (0.5 log2 units a
      // location: the 1536 locations under 2048 slots, about 24 per 64-slot block) and once in
      // about eight blocks (0.02).
      {KvLayout::kBf16, 3, 128, 2048, true, ScalePolicy::kAmax, 1.f, 0.5},
      {KvLayout::kBf16, 3, 64, 2048, false, ScalePolicy::kAmax, 1.f, 0.02},
      {KvLayout::kFp8Scaled, 3, 64, 1000, true, ScalePolicy::kPow2, 1.f, 0.5},
      {KvLayout::kFp8Scaled, 3, 16, 2048, false, ScalePolicy::kPow2, 1.f, 0.02},
      // More CTAs than an H200 has SMs (150-600), with slot counts (topk_length) of odd and
      // even block-pair counts and a few of zero: CTAs start while others drain.
      {KvLayout::kBf16, 300, 64, 200, true},
      {KvLayout::kBf16, 150, 128, 130, true},
      {KvLayout::kFp8Raw, 300, 16, 130, true},
      {KvLayout::kBf16, 301, 16, 130, true},
      {KvLayout::kFp8Scaled, 200, 128, 64, true, ScalePolicy::kPow2},
      // FP8 pools at 65-128 heads (656-byte: the paired wgmma kernel, two CTAs of a cluster
      // widening half of every block each; fp8-raw unpaired): many CTAs, a partly empty second
      // head group, the max moving, Q's scale far from 1.
      {KvLayout::kFp8Raw, 300, 128, 130, true},
      {KvLayout::kFp8Scaled, 3, 100, 2048, true, ScalePolicy::kPow2, 1.f, 0.5},
      {KvLayout::kFp8Scaled, 3, 72, 1000, false, ScalePolicy::kPow2, 1.f, 0.02},
      {KvLayout::kFp8Raw, 3, 128, 300, true, ScalePolicy::kAmax, 3e4f},
      // H <= 16 (the keys-on-M wgmma kernel): Q's scale far from 1, the running max moving
      // within every block, a head count below 8.
      {KvLayout::kFp8Raw, 3, 12, 300, false, ScalePolicy::kAmax, 1e-6f},
      {KvLayout::kBf16, 3, 16, 700, true, ScalePolicy::kAmax, 3e4f},
      {KvLayout::kBf16, 3, 7, 300, true},
      {KvLayout::kBf16, 3, 16, 2048, true, ScalePolicy::kAmax, 1.f, 0.5},
      {KvLayout::kFp8Scaled, 4, 5, 2048, true, ScalePolicy::kPow2},
      // 656-byte tile scales spread over 2^9 within a row and growing 2^12 across the pool.
      {KvLayout::kFp8Scaled, 3, 16, 2048, true, ScalePolicy::kPow2, 1.f, 0, 0.008},
      {KvLayout::kFp8Scaled, 3, 40, 1000, false, ScalePolicy::kPow2, 1.f, 0, 0.008},
      // FP8 pools at 17-32 heads: the keys-on-M kernel by default (fp8-raw: one 32-head item a
      // token, two tokens a CTA; 656-byte: a token's two 16-head groups); at 24 heads Q's scale
      // far from 1, an odd token count and the full top-k.
      {KvLayout::kFp8Raw, 3, 32, 300, true},
      {KvLayout::kFp8Raw, 5, 24, 2048, true, ScalePolicy::kAmax, 3e4f},
      {KvLayout::kFp8Scaled, 3, 20, 700, false, ScalePolicy::kPow2, 1.f, 0.5},
  };
  for (const SparseCase& c : cases)
    for (const std::string kernel : {"sm80", "sm90", "sm90-h64", "sm90-h16", "sm90-h32"}) {
      // sm90: the wgmma kernel by H and layout (keys on M for H <= 16, on FP8 pools H <= 32);
      // sm90-h64: its 64-head variant where sm90 runs keys on M; sm90-h16 / sm90-h32: the
      // keys-on-M kernel's 16- / 32-head items forced where sm90 runs another variant.
      const bool wgmma = kernel != "sm80";
      const bool few_by_default =
          cuda::attention::sparse_mla_sm90_few_heads_by_default(c.layout, c.num_heads);
      const int item = cuda::attention::sparse_mla_sm90_few_heads_item(c.layout, c.num_heads);
      // Whether the keys-on-M kernel's `forced`-head items run here and differ from sm90's.
      const auto other_items = [&](int forced) {
        return !(few_by_default && item == forced) &&
               cuda::attention::sparse_mla_sm90_few_heads_take(c.layout, c.num_heads) &&
               cuda::attention::dispatch_sparse_mla_sm90_few_heads(forced, c.layout,
                                                                   [](auto, auto) {});
      };
      if (kernel == "sm90-h64" &&
          (!few_by_default ||
           !cuda::attention::dispatch_sparse_mla_sm90_few_heads(item, c.layout, [](auto, auto) {})))
        continue;
      if ((kernel == "sm90-h16" && !other_items(16)) || (kernel == "sm90-h32" && !other_items(32)))
        continue;
      if (wgmma && !cuda::attention::dispatch_sparse_mla_sm90(c.layout, [](auto) {})) continue;
      const KernelScope scope("DSAKIT_SPARSE_MLA_KERNEL", wgmma ? "sm90" : "sm80");
      const KernelScope heads("DSAKIT_SPARSE_MLA_SM90_HEADS",
                              kernel.rfind("sm90-h", 0) == 0 ? kernel.c_str() + 6 : "auto");
      const uint64_t seed = testing::fresh_seed();
      SCOPED_TRACE(::testing::Message()
                   << "seed " << seed << " kernel " << kernel << " layout " << to_string(c.layout)
                   << " scales " << to_string(c.scale_policy) << " T " << c.num_tokens << " H "
                   << c.num_heads << " k " << c.topk << " topk_length " << c.use_topk_length
                   << " q_stddev " << c.q_stddev << " trend " << c.trend << " value_trend "
                   << c.value_trend);
      if (wgmma && c.layout == KvLayout::kFp8Scaled && c.scale_policy == ScalePolicy::kAmax) {
        // The wgmma kernel widens code x scale to bf16: exact for pow2 scales only, so it
        // refuses amax-scaled pools rather than round their values.
        try {
          run(c, seed);
          ADD_FAILURE() << "expected Error(kUnsupported) from the wgmma kernel on amax scales";
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
          EXPECT_NE(std::string(e.what()).find("pow2"), std::string::npos) << e.what();
        }
        continue;
      }
      expect_matches_reference(c, run(c, seed));
    }
}

// The keys-on-M kernels (few_heads_kernel.cuh, few_heads_fp8_kernel.cuh) alone on every layout
// and item size, small enough for racecheck: a CTA's two work items (adjacent tokens' head groups,
// or, on FP8 pools, one token's two 16-head groups at 20 and 32 heads, forced) with equal block
// counts, unequal ones (topk_length drawn from [0, k + 3]) and none (token 1 reads nothing), and
// odd item counts (the last CTA's second consumer group idle), at 16 heads, 7, 20, 32, 48 and 64
// (the bf16 kernel takes H <= 16 only; fp8-raw's 32-head items any H, a token's two sharing the
// ring's rows past 32).
TEST_F(CudaSparseMla, KeysOnMKernelMatchesReference) {
  const KernelScope scope("DSAKIT_SPARSE_MLA_KERNEL", "sm90");
  int ran = 0;
  for (const int item : {16, 32})
    for (const KvLayout layout : {KvLayout::kBf16, KvLayout::kFp8Raw, KvLayout::kFp8Scaled}) {
      if (!cuda::attention::dispatch_sparse_mla_sm90_few_heads(item, layout, [](auto, auto) {}))
        continue;
      const KernelScope heads("DSAKIT_SPARSE_MLA_SM90_HEADS", std::to_string(item).c_str());
      const ScalePolicy pow2 = ScalePolicy::kPow2;  // fp8-raw and bf16 pools ignore it
      for (const SparseCase& c :
           {SparseCase{layout, 3, 16, 2048, true, pow2}, SparseCase{layout, 3, 7, 129, false, pow2},
            SparseCase{layout, 2, 32, 300, true, pow2}, SparseCase{layout, 9, 16, 600, true, pow2},
            SparseCase{layout, 5, 20, 500, true, pow2}, SparseCase{layout, 4, 16, 300, true, pow2},
            // One item of a CTA's pair with no block: the first (token 2 of 2 and 3), the second
            // (token 5 of 4 and 5).
            SparseCase{layout, 4, 16, 300, true, pow2, 1.f, 0, 0, 2},
            SparseCase{layout, 6, 16, 200, true, pow2, 1.f, 0, 0, 5},
            // 32-head items past 32 heads: a token's two items in one CTA share the ring's rows
            // (the second item partly empty at 48).
            SparseCase{layout, 3, 64, 300, true, pow2},
            SparseCase{layout, 2, 48, 129, false, pow2}}) {
        if (!cuda::attention::sparse_mla_sm90_few_heads_take(layout, c.num_heads)) continue;
        const uint64_t seed = testing::fresh_seed();
        SCOPED_TRACE(::testing::Message()
                     << "seed " << seed << " items of " << item << " heads, layout "
                     << to_string(layout) << " T " << c.num_tokens << " H " << c.num_heads << " k "
                     << c.topk);
        expect_matches_reference(c, run(c, seed));
        ++ran;
      }
    }
  if (ran == 0) GTEST_SKIP() << "no keys-on-M instance";
}

// Every e4m3 code at every column reads as its exact value: pool bytes written directly (each
// code at many columns, subnormals included; pow2 tile scales from 2^-13 to 2^15), each token
// attending to one location, so o_lat is that row's V as the kernel widened it (P = 1). The
// 656-byte rows' values are bf16(code · scale) exactly; fp8-raw's fp32(code · k_scale) rounded
// to bf16, within one bf16 step. A NaN code anywhere in a row (nope or rope) makes its
// token's o_lat and lse NaN, and the other tokens stay exact. 8 heads, 128 (656-byte pools: the
// wgmma kernel's paired CTAs), and 32 (fp8-raw pools: the keys-on-M kernel's 32-head items).
TEST_F(CudaSparseMla, EveryFp8CodeReadsAsItsValue) {
  constexpr int kDc = 512, kDr = 64;
  for (const int kHeads : {8, 32, 128})
    for (const KvLayout layout : {KvLayout::kFp8Raw, KvLayout::kFp8Scaled})
      for (const std::string kernel : {"sm80", "sm90"}) {
        if (kernel == "sm90" && !cuda::attention::dispatch_sparse_mla_sm90(layout, [](auto) {}))
          continue;
        SCOPED_TRACE(::testing::Message() << "kernel " << kernel << " layout " << to_string(layout)
                                          << " heads " << kHeads);
        const KernelScope scope("DSAKIT_SPARSE_MLA_KERNEL", kernel.c_str());
        KvPoolDesc desc;
        desc.layout = layout;
        desc.page_size = 64;
        desc.num_pages = 4;
        desc.k_scale = 0.05f;
        desc.scale_policy = ScalePolicy::kPow2;
        PagedKvPool pool = backend_->make_kv_pool(desc);
        const int n = int(desc.num_locations()), row_bytes = desc.bytes_per_token();
        const KvRowLayout row = desc.row();
        Rng rng(testing::fresh_seed());
        // Rows 0..n-5 finite; rows n-4..n-1 hold one NaN code (at nope columns 0, 255, 300 and,
        // fp8-raw, rope column 40; the 656-byte layout's rope is bf16: nope column 511 there).
        Tensor bytes = Tensor::host(DType::kU8, {n, row_bytes});
        uint8_t* b = bytes.ptr<uint8_t>();
        const auto finite = [](int c) { return uint8_t((c & 0x7f) == 0x7f ? c & 0x80 : c); };
        for (int r = 0; r < n; ++r) {
          uint8_t* rb = b + int64_t(r) * row_bytes;
          for (int d = 0; d < kDc; ++d) rb[d] = finite((r * 37 + d * 5) & 0xff);
          if (layout == KvLayout::kFp8Raw) {
            for (int d = 0; d < kDr; ++d) rb[kDc + d] = finite((r * 11 + d * 3 + 1) & 0xff);
          } else {
            for (int t = 0; t < kDc / kFp8TileSize; ++t) {
              const float s = std::ldexp(1.0f, (r + 7 * t) % 29 - 13);
              std::memcpy(rb + row.scales_offset() + 4 * t, &s, 4);
            }
            for (int d = 0; d < kDr; ++d) {
              const bf16_t v = f32_to_bf16(float(rng.normal()));
              std::memcpy(rb + row.rope_offset() + 2 * d, &v, 2);
            }
          }
        }
        const int nan_cols[4] = {0, 255, 300, layout == KvLayout::kFp8Raw ? kDc + 40 : 511};
        for (int i = 0; i < 4; ++i)
          b[int64_t(n - 4 + i) * row_bytes + nan_cols[i]] = 0x7f | (i % 2) << 7;
        backend_->copy(pool.storage(), bytes.view());

        // Token t reads location t; token n reads two (a finite row and a NaN one).
        const int t_n = n + 1, k = 2;
        std::vector<int32_t> idx(size_t(t_n) * k, -1);
        for (int t = 0; t < n; ++t) idx[size_t(t) * k] = t;
        idx[size_t(n) * k] = 3;
        idx[size_t(n) * k + 1] = n - 2;
        // Q small enough that every logit times the softmax scale stays far below 2^15: there
        // the max slot's weight, exp2 of its product's rounding error, is 1 in bf16 as well.
        Tensor q_abs = testing::random_tensor(rng, DType::kBF16, {t_n, kHeads, kDc}, 1e-6f);
        Tensor q_pe = testing::random_tensor(rng, DType::kBF16, {t_n, kHeads, kDr}, 1e-6f);
        Tensor idx_h = Tensor::host(DType::kI32, {t_n, k});
        std::memcpy(idx_h.ptr<int32_t>(), idx.data(), idx.size() * sizeof(int32_t));
        Tensor q_abs_d = to_dev(q_abs), q_pe_d = to_dev(q_pe), idx_d = to_dev(idx_h);
        Tensor o = poisoned(DType::kBF16, {t_n, kHeads, kDc});
        Tensor lse = poisoned(DType::kF32, {t_n, kHeads});
        SparseMlaArgs a;
        a.q_abs = q_abs_d.view();
        a.q_pe = q_pe_d.view();
        a.kv = &pool;
        a.indices = idx_d.view();
        a.sm_scale = 1.0 / std::sqrt(192.0);
        a.o_lat = o.view();
        a.lse = lse.view();
        backend_->sparse_mla(a);
        const std::vector<double> o_h = testing::to_double(backend_->to_host(o.view()).view());
        const std::vector<double> lse_h = testing::to_double(backend_->to_host(lse.view()).view());

        std::vector<double> c_kv(kDc), k_pe(kDr);
        int wrong = 0;
        for (int t = 0; t < n - 4 && wrong < 10; ++t) {
          reference::decode_kv_row(row, b + int64_t(t) * row_bytes, desc.k_scale, c_kv.data(),
                                   k_pe.data());
          for (int h = 0; h < kHeads; ++h)
            for (int d = 0; d < kDc; ++d) {
              const double got = o_h[(size_t(t) * kHeads + h) * kDc + d], want = c_kv[size_t(d)];
              const bool ok = layout == KvLayout::kFp8Scaled
                                  ? got == want
                                  : std::abs(got - want) <= std::ldexp(std::abs(want), -8);
              if (!ok && ++wrong <= 10)
                ADD_FAILURE() << "token " << t << " head " << h << " column " << d << " (code 0x"
                              << std::hex << int(b[int64_t(t) * row_bytes + d]) << std::dec
                              << "): " << got << ", expected " << want;
            }
        }
        for (int t = n - 4; t <= n; ++t)
          for (int h = 0; h < kHeads; ++h) {
            EXPECT_TRUE(std::isnan(lse_h[size_t(t) * kHeads + h])) << "lse, token " << t;
            for (int d = 0; d < kDc; ++d)
              ASSERT_TRUE(std::isnan(o_h[(size_t(t) * kHeads + h) * kDc + d]))
                  << "o_lat, token " << t << " head " << h << " column " << d;
          }
      }
}

TEST_F(CudaSparseMla, UnsupportedDtypeIsRejectedNamingTheArgument) {
  KvPoolDesc desc;
  desc.num_pages = 1;
  PagedKvPool pool = backend_->make_kv_pool(desc);
  Tensor q_abs = poisoned(DType::kF32, {2, 16, 512});
  Tensor q_pe = poisoned(DType::kF32, {2, 16, 64});
  Tensor idx = to_dev(host_i32({0, 1, 2, 3}));
  SparseMlaArgs a;
  a.q_abs = q_abs.view();
  a.q_pe = q_pe.view();
  a.kv = &pool;
  a.indices = idx.view();
  a.indices.ndim = 2;
  a.indices.shape = {2, 2, 0, 0};
  a.indices.stride = {2, 1, 0, 0};
  Tensor o = poisoned(DType::kF32, {2, 16, 512});
  Tensor lse = poisoned(DType::kF32, {2, 16});
  a.o_lat = o.view();
  a.lse = lse.view();
  a.sm_scale = 0.1;
  const uint64_t before = testing::checksum(backend_->to_host(pool.storage()).view());
  try {
    backend_->sparse_mla(a);
    // A backend may compute f32 through another path; then nothing is left to check here.
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("q_abs"), std::string::npos) << e.what();
  }
  EXPECT_EQ(before, testing::checksum(backend_->to_host(pool.storage()).view()));
}

// ---- dense MHA ---------------------------------------------------------------------------------

// ---- dense MHA schedule (host only: runs without a GPU) -----------------------------------------

using cuda::dense_mha::build_dense_schedule;
using cuda::dense_mha::DenseSchedule;
using cuda::dense_mha::DenseTile;
using cuda::dense_mha::DenseTileShape;

// Every (request row, kv block the row sees) is covered by exactly one tile, every tile's rows
// lie in one request, parts and slots are consistent, tiles go costliest first, and the merge
// segments cover exactly the split tiles' rows (q * heads + h), each over its tile's runs.
void expect_schedule_covers(const DenseSchedule& s, const std::vector<int32_t>& cu_q,
                            const std::vector<int32_t>& cu_kv, int64_t heads,
                            DenseTileShape shape = cuda::dense_mha::kDenseSm80Shape) {
  using cuda::dense_mha::kDenseWholeTile;
  const int b = int(cu_q.size()) - 1;
  // Runs per query row: 0 = written whole, else the split tile's run count.
  std::vector<int> runs_of_row(size_t(cu_q.back()), -1);
  // covered[row][block] counts over all tiles.
  std::vector<std::vector<int>> covered(size_t(cu_q.back()));
  for (int r = 0; r < b; ++r)
    for (int32_t i = cu_q[r]; i < cu_q[r + 1]; ++i) {
      const int32_t pos = cu_kv[r + 1] - cu_kv[r] - (cu_q[r + 1] - i);  // row's position
      covered[size_t(i)].assign(size_t(pos / shape.block_n + 1), 0);
    }
  for (size_t k = 0; k < s.tiles.size(); ++k) {
    const DenseTile& t = s.tiles[k];
    ASSERT_GE(t.q_len, 1);
    ASSERT_LE(t.q_len, shape.block_m);
    if (s.parts == 1) {
      ASSERT_EQ(t.part, 0);
    } else if (t.part != kDenseWholeTile) {
      ASSERT_GE(t.part, 0);
      ASSERT_LT(t.part, s.parts);
    }
    ASSERT_LT(t.block_begin, t.block_end) << "every tile has work";
    int runs = 0;  // tiles over these rows
    for (const DenseTile& u : s.tiles) runs += u.q_begin == t.q_begin ? 1 : 0;
    if (t.part == kDenseWholeTile || s.parts == 1) {
      ASSERT_EQ(runs, 1);
    } else {
      ASSERT_GE(runs, 2) << "a split tile has two runs or more";
      ASSERT_LT(t.part, runs);
    }
    for (int32_t i = 0; i < t.q_len; ++i)
      runs_of_row[size_t(t.q_begin + i)] = t.part == kDenseWholeTile || s.parts == 1 ? 0 : runs;
    if (k > 0) {
      const DenseTile& u = s.tiles[k - 1];
      EXPECT_GE(cuda::dense_mha::dense_run_cost(u, u.block_begin, u.block_end, shape),
                cuda::dense_mha::dense_run_cost(t, t.block_begin, t.block_end, shape));
    }
    for (int32_t i = 0; i < t.q_len; ++i) {
      auto& row = covered[size_t(t.q_begin + i)];
      const int32_t pos = t.first_query_pos + i;
      for (int32_t blk = t.block_begin; blk < t.block_end && blk * shape.block_n <= pos; ++blk)
        ++row[size_t(blk)];
    }
  }
  for (size_t i = 0; i < covered.size(); ++i)
    for (size_t blk = 0; blk < covered[i].size(); ++blk)
      ASSERT_EQ(covered[i][blk], 1) << "row " << i << " block " << blk;
  // The merge: the segments' rows, in launch order, are exactly the split rows (row-major).
  std::vector<int> merged_runs(size_t(cu_q.back() * heads), 0);
  ASSERT_LE(s.merge_segments.size(), size_t(cuda::kMergeMaxSegments));
  for (size_t k = 0; k < s.merge_segments.size(); ++k) {
    const auto& g = s.merge_segments[k];
    const int32_t end =
        k + 1 < s.merge_segments.size() ? s.merge_segments[k + 1].merged_begin : s.merged_rows;
    ASSERT_LT(g.merged_begin, end);
    ASSERT_GE(g.parts, 2);
    ASSERT_LE(g.parts, s.parts);
    for (int64_t r = g.row_begin; r < g.row_begin + (end - g.merged_begin); ++r) {
      ASSERT_LT(r, int64_t(merged_runs.size()));
      ASSERT_EQ(merged_runs[size_t(r)], 0) << "row " << r << " merged twice";
      merged_runs[size_t(r)] = g.parts;
    }
  }
  if (s.parts == 1) {
    EXPECT_TRUE(s.merge_segments.empty());
    return;
  }
  for (size_t r = 0; r < merged_runs.size(); ++r)
    ASSERT_EQ(merged_runs[r], runs_of_row[r / size_t(heads)]) << "row " << r;
  // The merge launch's rows as the kernel finds them: each split row once, with its run count,
  // in row order within a segment; nothing past merged_rows.
  cuda::MergePartialsParams p{};
  p.rows = cu_q.back() * heads;
  cuda::dense_mha::set_merge_rows(s, p);
  std::vector<int> seen(merged_runs.size(), 0);
  for (int64_t i = 0; i < p.merged_rows; ++i) {
    int64_t row = -1;
    int parts = 0;
    ASSERT_TRUE(cuda::merged_row(p, i, row, parts));
    ASSERT_TRUE(row >= 0 && row < int64_t(seen.size()));
    ASSERT_EQ(parts, merged_runs[size_t(row)]) << "row " << row;
    ++seen[size_t(row)];
  }
  int64_t row = 0;
  int parts = 0;
  EXPECT_FALSE(cuda::merged_row(p, p.merged_rows, row, parts));
  for (size_t r = 0; r < seen.size(); ++r) ASSERT_EQ(seen[r], merged_runs[r] > 0 ? 1 : 0);
}

// Partial rows of DeepSeek-V3.2's d_v = 128 (f32 o + lse) and its bf16 K/V row per head: the
// budget cuda_dense_mha gives the schedule is the K/V buffers' size.
constexpr int64_t kPartialRowBytes = 4 * (128 + 1), kKvRowBytes = 2 * (128 + 128);

// The cost model's estimate of a schedule (docs/kernels.md, split-KV): its CTAs' longest-first
// list schedule over the kernel's CTA slots, plus the merge when it splits.
int64_t estimated_time(const DenseSchedule& s, int64_t heads, int sms, DenseTileShape shape) {
  using namespace cuda::dense_mha;
  std::vector<std::pair<int64_t, int64_t>> ctas;
  for (const DenseTile& t : s.tiles)
    ctas.emplace_back(kDenseCtaCost + dense_run_cost(t, t.block_begin, t.block_end, shape), heads);
  return dense_makespan(ctas, int64_t(shape.ctas_per_sm) * sms) +
         (s.parts > 1 ? kDenseMergeCost : 0);
}

TEST(DenseMhaSchedule, RunCostCountsEachRowGroupsVisibleBlocks) {
  using cuda::dense_mha::dense_run_cost;
  const DenseTileShape wgmma = cuda::dense_mha::dense_sm90_shape(128);  // blocks of 128 rows
  // 100 rows at positions 1900..1999: rows 0-63 see 16 blocks (last position 1963), rows 64-99
  // see 16 (1999).
  const DenseTile extend{0, 100, 0, 1900, 0, 16, 0};
  EXPECT_EQ(dense_run_cost(extend, 0, 16, wgmma), 32);
  EXPECT_EQ(dense_run_cost(extend, 8, 16, wgmma), 16);
  EXPECT_EQ(dense_run_cost(extend, 0, 20, wgmma), 32) << "blocks past the rows cost nothing";
  // A fresh prompt's tile 1 (rows 128-255): rows 128-191 see 2 blocks, rows 192-255 see 2.
  EXPECT_EQ(dense_run_cost({128, 128, 0, 128, 0, 2, 0}, 0, 2, wgmma), 4);
  // 64-row blocks (mma.sync): rows 128-191 see 3, rows 192-255 see 4.
  EXPECT_EQ(dense_run_cost({128, 128, 0, 128, 0, 4, 0}, 0, 4, cuda::dense_mha::kDenseSm80Shape), 7);
  // Rows 0-63 of a tile at position 0, 128-row blocks: one block each group.
  EXPECT_EQ(dense_run_cost({0, 128, 0, 0, 0, 1, 0}, 0, 1, wgmma), 2);
}

TEST(DenseMhaSchedule, MakespanIsTheLongestFirstListSchedule) {
  using cuda::dense_mha::dense_makespan;
  // 5 4 3 3 3 on 2 slots, each to the least loaded: 5|4, 5|7, 8|7, 8|10.
  EXPECT_EQ(dense_makespan({{3, 3}, {5, 1}, {4, 1}}, 2), 10);
  EXPECT_EQ(dense_makespan({{2, 5}}, 2), 6);  // rounds of 2 and one more
  EXPECT_EQ(dense_makespan({{7, 3}}, 8), 7);  // fewer CTAs than slots
  EXPECT_EQ(dense_makespan({}, 4), 0);
  // Random lists against one CTA at a time to the least loaded slot.
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Rng rng(seed);
  for (int trial = 0; trial < 100; ++trial) {
    const int64_t slots = rng.randint(1, 40);
    std::vector<std::pair<int64_t, int64_t>> groups;
    std::vector<int64_t> ctas;
    for (int g = int(rng.randint(0, 12)); g > 0; --g) {
      groups.emplace_back(rng.randint(0, 30), rng.randint(1, 50));
      ctas.insert(ctas.end(), size_t(groups.back().second), groups.back().first);
    }
    std::sort(ctas.rbegin(), ctas.rend());
    std::vector<int64_t> load(size_t(slots), 0);
    for (const int64_t c : ctas) *std::min_element(load.begin(), load.end()) += c;
    ASSERT_EQ(dense_makespan(groups, slots), *std::max_element(load.begin(), load.end()));
  }
}

TEST(DenseMhaSchedule, SplitsLongTilesWhereTheCostModelGains) {
  struct Case {
    const char* what;
    int32_t prefix, extend;
    int64_t heads;
    int parts;
    int32_t blocks_per_split;  // 0: no split
  };
  const Case cases[] = {
      // 4 tiles x 16 heads = 64 CTAs on 132 SMs, but the longest tile has only 4 blocks
      // (256 kv rows < kDenseMinSplitRows).
      {"T=256, 16 heads", 0, 256, 16, 1, 0},
      // 4 tiles x 128 heads fill the SMs already.
      {"T=256, 128 heads", 0, 256, 128, 1, 0},
      // One tile over 32 blocks, 16 heads: runs of 2 blocks -> 16 parts x 16 heads = 256 CTAs,
      // one wave of 2 x 132 slots.
      {"P=1984 E=64, 16 heads", 1984, 64, 16, 16, 2},
      // 16 tiles of 1..16 blocks, one head: a split would pay, but 2 slots of partials outgrow
      // the K/V buffers of a fresh prompt (N = T): no split.
      {"T=1024, 1 head", 0, 1024, 1, 1, 0},
      // Two requests of 64 new tokens over 1984 cached, 8 heads: 2 tiles x 8 heads; runs of 2
      // blocks give 32 x 8 = 256 CTAs.
      {"2 x (P=1984 E=64), 8 heads", 1984, 64, 8, 16, 2},
  };
  // kDenseSm80Shape's 64 x 64 tiles: blocks of 64 kv rows, CTAs 2 per SM on 132 SMs.
  const DenseTileShape sm80 = cuda::dense_mha::kDenseSm80Shape;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const bool two = std::string(c.what).rfind("2 x", 0) == 0;
    std::vector<int32_t> cu_q{0, c.extend}, cu_kv{0, c.prefix + c.extend};
    if (two) {
      cu_q.push_back(2 * c.extend);
      cu_kv.push_back(2 * (c.prefix + c.extend));
    }
    const int b = two ? 2 : 1;
    const int64_t budget = int64_t(cu_kv.back()) * c.heads * kKvRowBytes;
    const DenseSchedule s =
        build_dense_schedule(cu_q.data(), cu_kv.data(), b, c.heads, 132, kPartialRowBytes, budget);
    EXPECT_EQ(s.parts, c.parts);
    // The split's run length: the longest tile's first run has it.
    int32_t longest_run = 0;
    if (s.parts > 1)
      for (const auto& t : s.tiles)
        longest_run = std::max(longest_run, t.block_end - t.block_begin);
    EXPECT_EQ(longest_run, c.blocks_per_split);
    expect_schedule_covers(s, cu_q, cu_kv, c.heads);
    // A split is taken only where the model estimates it faster than the whole tiles.
    const DenseSchedule whole =
        build_dense_schedule(cu_q.data(), cu_kv.data(), b, c.heads, 132, kPartialRowBytes, 0);
    ASSERT_EQ(whole.parts, 1);
    if (s.parts > 1) {
      EXPECT_LT(estimated_time(s, c.heads, 132, sm80), estimated_time(whole, c.heads, 132, sm80));
    }
  }
  // A batch of long and short tiles, the wgmma kernel's shape (128 x 128, one CTA per SM), 16
  // heads: the extend of 64 over 1984 (16 blocks of one row group: 16 units) and of 100 over
  // 1900 (16 blocks of two: 32 units) set the whole schedule's time (34 of 8 x 16 = 128 CTAs).
  // Cut into 2 and 3 runs (8 + 8 and 6 + 6 + 4 blocks; 10-14 units each) the heaviest wave
  // ends first and the fresh 512-token request's 4 tiles (1-4 blocks, staying whole) fill the
  // 12 CTAs past one wave: 9 tiles x 16 heads; the merge covers the extends' rows only, two
  // segments (2 and 3 runs) with the whole tiles' rows between.
  const std::vector<int32_t> cu_q{0, 64, 576, 676}, cu_kv{0, 2048, 2560, 4560};
  const DenseTileShape wgmma = cuda::dense_mha::dense_sm90_shape(128);
  const DenseSchedule s = build_dense_schedule(cu_q.data(), cu_kv.data(), 3, 16, 132,
                                               kPartialRowBytes, 4560 * 16 * kKvRowBytes, wgmma);
  EXPECT_TRUE(s.few_waves);
  EXPECT_EQ(s.parts, 3);
  EXPECT_EQ(s.tiles.size(), size_t(9));
  ASSERT_EQ(s.merge_segments.size(), size_t(2));
  EXPECT_EQ(s.merge_segments[0].parts, 2);
  EXPECT_EQ(s.merge_segments[1].parts, 3);
  EXPECT_EQ(s.merge_segments[1].row_begin, 576 * 16);
  EXPECT_EQ(s.merged_rows, (64 + 100) * 16);
  expect_schedule_covers(s, {cu_q.begin(), cu_q.end()}, {cu_kv.begin(), cu_kv.end()}, 16, wgmma);
  const DenseSchedule whole =
      build_dense_schedule(cu_q.data(), cu_kv.data(), 3, 16, 132, kPartialRowBytes, 0, wgmma);
  EXPECT_EQ(estimated_time(whole, 16, 132, wgmma), 2 + 32);
  EXPECT_LT(estimated_time(s, 16, 132, wgmma), estimated_time(whole, 16, 132, wgmma));
  // 128 heads: 6 tiles x 128 = 768 CTAs, many waves: never split, L2 head groups.
  const DenseSchedule many = build_dense_schedule(
      cu_q.data(), cu_kv.data(), 3, 128, 132, kPartialRowBytes, 4560 * 128 * kKvRowBytes, wgmma);
  EXPECT_FALSE(many.few_waves);
  EXPECT_EQ(many.parts, 1);
}

TEST(DenseMhaSchedule, RandomBatchesAreCoveredExactlyOnce) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  Rng rng(seed);
  for (int trial = 0; trial < 200; ++trial) {
    const int b = int(rng.randint(1, 5));
    std::vector<int32_t> cu_q{0}, cu_kv{0};
    for (int r = 0; r < b; ++r) {
      const auto e = int32_t(rng.randint(0, 299)), p = int32_t(rng.randint(0, 2999));
      cu_q.push_back(cu_q.back() + e);
      cu_kv.push_back(cu_kv.back() + p + e);
    }
    const int64_t heads = std::vector<int64_t>{1, 4, 16, 64, 128}[size_t(rng.randint(0, 4))];
    const int sms = int(rng.randint(1, 200));
    const int64_t budget = rng.randint(0, int64_t(1) << 28);
    // Every kernel's tile shape: mma.sync's, and the wgmma kernel's for d_v 128 and 256.
    for (const DenseTileShape shape :
         {cuda::dense_mha::kDenseSm80Shape, cuda::dense_mha::dense_sm90_shape(128),
          cuda::dense_mha::dense_sm90_shape(256)}) {
      SCOPED_TRACE(::testing::Message()
                   << "block_m " << shape.block_m << " block_n " << shape.block_n);
      const DenseSchedule s = build_dense_schedule(cu_q.data(), cu_kv.data(), b, heads, sms,
                                                   kPartialRowBytes, budget, shape);
      expect_schedule_covers(s, cu_q, cu_kv, heads, shape);
      if (s.parts > 1) {
        EXPECT_LE(s.parts * int64_t(cu_q.back()) * heads * kPartialRowBytes, budget);
        EXPECT_TRUE(s.few_waves);
        // Taken only where the model estimates it faster; the tiles within the scratch bound.
        const DenseSchedule whole = build_dense_schedule(cu_q.data(), cu_kv.data(), b, heads, sms,
                                                         kPartialRowBytes, 0, shape);
        EXPECT_LT(estimated_time(s, heads, sms, shape), estimated_time(whole, heads, sms, shape));
        EXPECT_LE(int64_t(s.tiles.size()),
                  cuda::dense_mha::kDenseMaxSplit * int64_t(whole.tiles.size()));
        EXPECT_LE(int64_t(s.tiles.size()) * heads, cuda::dense_mha::kDenseMaxSplit *
                                                       cuda::dense_mha::kDenseSplitWaves *
                                                       shape.ctas_per_sm * sms);
      }
    }
    if (HasFatalFailure()) return;
  }
}

// The wgmma kernel's grid order visits every (head, tile) once, in groups of head_group heads
// (the last one smaller), tile-major within a group; the group keeps its heads' K / V in the
// L2 budget.
TEST(DenseMhaSchedule, CtaOrderVisitsEveryHeadAndTileOnceGroupByGroup) {
  using cuda::dense_mha::dense_sm90_cta_work;
  for (const int heads : {1, 3, 16, 128})
    for (const int tiles : {1, 5, 32})
      for (int group = 1; group <= heads; group += group < 4 ? 1 : 5) {
        SCOPED_TRACE(::testing::Message()
                     << "heads " << heads << " tiles " << tiles << " group " << group);
        std::vector<int> seen(size_t(heads) * tiles, 0);
        int previous_tile = -1, previous_group = 0;
        for (int cta = 0; cta < heads * tiles; ++cta) {
          const auto w = dense_sm90_cta_work(unsigned(cta), tiles, heads, group);
          ASSERT_TRUE(w.head >= 0 && w.head < heads && w.tile >= 0 && w.tile < tiles);
          ++seen[size_t(w.head) * tiles + w.tile];
          // Within a group the tiles never go back; a new group starts at tile 0.
          if (w.head / group != previous_group) {
            EXPECT_EQ(w.head / group, previous_group + 1);
            EXPECT_EQ(w.tile, 0);
            previous_group = w.head / group;
          } else {
            EXPECT_GE(w.tile, previous_tile);
          }
          previous_tile = w.tile;
        }
        for (const int n : seen) ASSERT_EQ(n, 1);
      }
  using cuda::dense_mha::dense_head_group;
  using cuda::dense_mha::kDenseHeadGroupBytes;
  // K / V rows of a head: DeepSeek-V3.2's 512 bytes (128 + 128 bf16), GLM-5's 896 (192 + 256).
  EXPECT_EQ(dense_head_group(4096, 16, 128, 128), 8);    // 2 MiB a head
  EXPECT_EQ(dense_head_group(2048, 128, 128, 128), 16);  // 1 MiB
  EXPECT_EQ(dense_head_group(2048, 64, 192, 256), 8);    // 9 fit, 8 divides 64
  EXPECT_EQ(dense_head_group(1024, 16, 192, 256), 16);   // 18 fit: capped at H
  EXPECT_EQ(dense_head_group(2200, 12, 128, 128), 12);   // 14 fit
  EXPECT_EQ(dense_head_group(5000, 7, 128, 128), 1);     // 6 fit, 7 is prime
  EXPECT_EQ(dense_head_group(65536, 128, 192, 256), 1);  // 56 MiB a head: one at a time
  EXPECT_EQ(dense_head_group(0, 4, 128, 128), 4);
  for (const int64_t n : {1, 1000, 4096, 100000})
    for (const int64_t h : {1, 6, 16, 128}) {
      const int g = dense_head_group(n, h, 128, 128);
      ASSERT_TRUE(g >= 1 && g <= h && h % g == 0);
      if (g > 1) {
        EXPECT_LE(g * n * 512, kDenseHeadGroupBytes);
      }
      // No larger divisor of h fits.
      for (int64_t d = g + 1; d <= h; ++d) {
        if (h % d == 0) {
          EXPECT_GT(d * n * 512, kDenseHeadGroupBytes) << "n " << n << " h " << h << " d " << d;
        }
      }
    }
}

// kAuto's sparse MLA kernel, decided on the host from the pool alone: wgmma for every pool it
// reads exactly (bf16, fp8-raw, 656-byte with pow2 scales), mma.sync for amax-scaled 656-byte
// pools.
TEST(SparseMlaKernelChoice, WgmmaForEveryPoolItReadsExactly) {
  const auto pool = [](KvLayout layout, ScalePolicy policy) {
    KvPoolDesc d;
    d.layout = layout;
    d.scale_policy = policy;
    return d;
  };
  for (ScalePolicy policy : {ScalePolicy::kAmax, ScalePolicy::kPow2}) {
    EXPECT_EQ(sparse_mla_kernel_for(pool(KvLayout::kBf16, policy)), AttentionKernel::kWgmma);
    EXPECT_EQ(sparse_mla_kernel_for(pool(KvLayout::kFp8Raw, policy)), AttentionKernel::kWgmma);
  }
  EXPECT_EQ(sparse_mla_kernel_for(pool(KvLayout::kFp8Scaled, ScalePolicy::kPow2)),
            AttentionKernel::kWgmma);
  EXPECT_EQ(sparse_mla_kernel_for(pool(KvLayout::kFp8Scaled, ScalePolicy::kAmax)),
            AttentionKernel::kMmaSync);
  EXPECT_FALSE(sparse_mla_wgmma_reads(pool(KvLayout::kFp8Scaled, ScalePolicy::kAmax)));
}

// The wgmma kernel's preconditions, decided on the host before anything touches the device (the
// views' addresses are never dereferenced): an instance for the head dims and operands TMA can
// address. kAuto falls back to mma.sync; forcing wgmma is kUnsupported naming what it needs.
TEST(DenseMhaKernelChoice, WgmmaNeedsAnInstanceAndTmaAddressableOperands) {
  constexpr int64_t kT = 8, kH = 4, kDr = 64;
  const auto at = [](uintptr_t address) { return reinterpret_cast<void*>(address); };
  const auto args = [&](int64_t d_nope, int64_t d_v) {
    DenseMhaArgs a;
    a.q_nope = make_view(at(0x100000), DType::kBF16, Device::kCuda, {kT, kH, d_nope});
    a.q_pe = make_view(at(0x200000), DType::kBF16, Device::kCuda, {kT, kH, kDr});
    a.k_nope = make_view(at(0x300000), DType::kBF16, Device::kCuda, {kT, kH, d_nope});
    a.k_pe = make_view(at(0x400000), DType::kBF16, Device::kCuda, {kT, kDr});
    a.v = make_view(at(0x500000), DType::kBF16, Device::kCuda, {kT, kH, d_v});
    a.o = make_view(at(0x600000), DType::kBF16, Device::kCuda, {kT, kH, d_v});
    a.lse = make_view(at(0x700000), DType::kF32, Device::kCuda, {kT, kH});
    return a;
  };
  EXPECT_EQ(dense_mha_kernel_for(args(128, 128)), AttentionKernel::kWgmma);
  EXPECT_EQ(dense_mha_kernel_for(args(192, 256)), AttentionKernel::kWgmma);
  EXPECT_EQ(dense_mha_kernel_for(args(192, 128)), AttentionKernel::kMmaSync);  // no sm90 row

  DenseMhaArgs misaligned = args(128, 128);
  misaligned.q_pe.data = at(0x200002);
  DenseMhaArgs odd_stride = args(128, 128);
  odd_stride.v.stride[1] = 132;  // heads 264 bytes apart: not a multiple of 16
  for (const DenseMhaArgs& a : {misaligned, odd_stride}) {
    EXPECT_FALSE(dense_mha_wgmma_reads(a));
    EXPECT_EQ(dense_mha_kernel_for(a), AttentionKernel::kMmaSync);
    try {
      cuda_dense_mha(
          a, 132, nullptr, [](size_t) -> void* { return nullptr; }, AttentionKernel::kWgmma);
      ADD_FAILURE() << "expected Error(kUnsupported) from the forced wgmma kernel";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
    }
  }
}

struct DenseCase {
  int d_nope, d_v, num_heads;
  std::vector<std::pair<int, int>> prefix_extend;  // per request (P_r, E_r)
  // Logits rising with the kv position: `trend` log2 units per row (k_pe[n][0] grows with n,
  // q_pe[..][0] = 1), so a row's running max passes the softmax offset again and again and the
  // kernels' deferred O rescale (sm90: kRescaleSlack) runs between blocks, not only at the first.
  double trend = 0;
};

// dense_mha's arguments over device tensors, cu_q / cu_kv with their host copies; o and lse are
// the caller's.
DenseMhaArgs dense_args(const Tensor& q_nope, const Tensor& q_pe, const Tensor& k_nope,
                        const Tensor& k_pe, const Tensor& v, const Tensor& cu_q_d,
                        const Tensor& cu_kv_d, const std::vector<int32_t>& cu_q,
                        const std::vector<int32_t>& cu_kv, double sm_scale) {
  DenseMhaArgs a;
  a.q_nope = q_nope.view();
  a.q_pe = q_pe.view();
  a.k_nope = k_nope.view();
  a.k_pe = k_pe.view();
  a.v = v.view();
  a.cu_q = cu_q_d.view();
  a.cu_kv = cu_kv_d.view();
  a.cu_q_host = cu_q.data();
  a.cu_kv_host = cu_kv.data();
  a.num_requests = int(cu_q.size()) - 1;
  a.sm_scale = sm_scale;
  return a;
}

// The float64 reference's operands: q = [q_nope | q_pe] and k = [k_nope | k_pe] per (row, head),
// k_pe one row shared by the heads.
struct ReferenceQk {
  std::vector<double> q, k;
};
ReferenceQk reference_qk(const Tensor& q_nope, const Tensor& q_pe, const Tensor& k_nope,
                         const Tensor& k_pe) {
  const int64_t t_n = q_nope.size(0), n = k_nope.size(0), h = q_nope.size(1);
  const int64_t d_nope = q_nope.size(2), d_rope = q_pe.size(2), d_qk = d_nope + d_rope;
  ReferenceQk r{std::vector<double>(size_t(t_n * h * d_qk)),
                std::vector<double>(size_t(n * h * d_qk))};
  const auto qn = testing::to_double(q_nope.view()), qp = testing::to_double(q_pe.view());
  const auto kn = testing::to_double(k_nope.view()), kp = testing::to_double(k_pe.view());
  for (int64_t th = 0; th < t_n * h; ++th) {
    std::copy_n(&qn[size_t(th * d_nope)], d_nope, &r.q[size_t(th * d_qk)]);
    std::copy_n(&qp[size_t(th * d_rope)], d_rope, &r.q[size_t(th * d_qk + d_nope)]);
  }
  for (int64_t nh = 0; nh < n * h; ++nh) {
    std::copy_n(&kn[size_t(nh * d_nope)], d_nope, &r.k[size_t(nh * d_qk)]);
    std::copy_n(&kp[size_t(nh / h * d_rope)], d_rope, &r.k[size_t(nh * d_qk + d_nope)]);
  }
  return r;
}

class CudaDenseMha : public CudaAttention {
 protected:
  // One 4-token request of 2 heads, every tensor poisoned: the argument checks' input.
  struct SmallCall {
    Tensor q_nope, q_pe, k_nope, k_pe, v, cu_d, o, lse;
    std::vector<int32_t> cu;
    DenseMhaArgs args;
  };
  SmallCall small_call(int d_nope, int d_v) {
    constexpr int kT = 4, kH = 2, kDr = 64;
    SmallCall c;
    c.q_nope = poisoned(DType::kBF16, {kT, kH, d_nope});
    c.q_pe = poisoned(DType::kBF16, {kT, kH, kDr});
    c.k_nope = poisoned(DType::kBF16, {kT, kH, d_nope});
    c.k_pe = poisoned(DType::kBF16, {kT, kDr});
    c.v = poisoned(DType::kBF16, {kT, kH, d_v});
    c.cu = {0, kT};
    c.cu_d = to_dev(host_i32(c.cu));
    c.o = poisoned(DType::kBF16, {kT, kH, d_v});
    c.lse = poisoned(DType::kF32, {kT, kH});
    c.args = dense_args(c.q_nope, c.q_pe, c.k_nope, c.k_pe, c.v, c.cu_d, c.cu_d, c.cu, c.cu, 0.1);
    c.args.o = c.o.view();
    c.args.lse = c.lse.view();
    return c;
  }
};

TEST_F(CudaDenseMha, MatchesReferenceForBothShapesWithPrefixes) {
  std::vector<DenseCase> cases = {
      {128, 128, 128, {{0, 70}, {64, 64}}},
      {128, 128, 16, {{0, 100}, {37, 5}, {200, 130}, {0, 1}}},
      {192, 256, 64, {{0, 100}, {37, 5}, {200, 130}}},
      {192, 256, 16, {{3, 1}, {0, 65}, {500, 0}, {10, 200}}},
  };
  // Split-KV (fewer tiles x heads than SMs): a short extend over a long prefix (16 parts), one
  // decode-like row with 128 heads (2 parts), and a split schedule too long for the launch
  // parameters (8 tiles x 17 parts).
  cases.push_back({128, 128, 16, {{1990, 64}}});
  cases.push_back({192, 256, 16, {{1000, 40}, {0, 3}, {1030, 0}}});
  cases.push_back({128, 128, 128, {{2047, 1}}});
  cases.push_back({128, 128, 1, std::vector<std::pair<int, int>>(8, {2000, 64})});
  // d_v = 256 on grids that leave SMs idle runs as two 128-column slices per head: alone (the
  // fourth case above: 7 tiles x 16 heads) and with split-KV (32 parts x 2 heads).
  cases.push_back({192, 256, 2, {{1990, 30}}});
  // More tiles than the launch parameters carry (kDenseInlineTiles): the schedule is copied.
  DenseCase many{128, 128, 4, {}};
  for (int r = 0; r < 150; ++r) many.prefix_extend.push_back({r % 7, 1 + r % 5});
  many.prefix_extend.push_back({0, 130});
  ASSERT_GT(many.prefix_extend.size(), size_t(cuda::dense_mha::kDenseInlineTiles));
  cases.push_back(many);
  // Longer prompts: many kv blocks per tile, a tile's last block reaching past its rows, a
  // second consumer group with no rows (E % 128 <= 64), and both kernels' tile shapes.
  cases.push_back({128, 128, 8, {{0, 700}, {300, 333}, {129, 64}}});
  cases.push_back({192, 256, 4, {{0, 517}, {64, 191}, {1, 1}}});
  // The running max passing the 8-unit slack within every block (0.2 log2 units a row: 12.8
  // per 64 rows) and once in about three 64-row blocks (0.05).
  cases.push_back({128, 128, 4, {{0, 700}, {300, 333}}, 0.2});
  cases.push_back({192, 256, 4, {{0, 517}, {400, 191}}, 0.2});
  cases.push_back({128, 128, 4, {{0, 900}}, 0.05});
  cases.push_back({192, 256, 4, {{0, 900}}, 0.05});
  // <= 64 rows over >= 2 blocks (the sm90 kernel's split blocks, each group every other block):
  // two blocks whose second is past the first rows (group 1 sees no key of rows 0..27 / 0..19),
  // odd and even block counts with the running max moving, and split-KV parts of several
  // blocks (one tile x 40 heads: 3 parts on a 132-SM H200).
  cases.push_back({128, 128, 16, {{100, 40}, {60, 4}}});
  cases.push_back({192, 256, 16, {{60, 40}, {5, 60}}});
  cases.push_back({128, 128, 4, {{300, 60}, {700, 33}}, 0.2});
  cases.push_back({192, 256, 4, {{300, 60}, {700, 33}}, 0.2});
  cases.push_back({128, 128, 40, {{2000, 48}}, 0.05});
  cases.push_back({192, 256, 40, {{2000, 48}}, 0.05});
  // Split-KV with whole tiles between the split ones (the wgmma kernel splits the two extends'
  // tiles only; the merge covers their rows in two segments).
  cases.push_back({128, 128, 16, {{1984, 64}, {0, 512}, {1900, 100}}});
  // One long extend's tiles in runs: a whole 128-row tile (d_v 128: 119 rows, second group 55)
  // and one over 80-row blocks (d_v 256: 113 rows), several runs each.
  cases.push_back({128, 128, 16, {{2977, 119}}});
  cases.push_back({192, 256, 16, {{2711, 113}}});
  constexpr int kDr = 64;
  for (const DenseCase& c : cases)
    for (const char* kernel : {"sm80", "sm90"}) {
      const KernelScope scope("DSAKIT_DENSE_MHA_KERNEL", kernel);
      const uint64_t seed = testing::fresh_seed();
      SCOPED_TRACE(::testing::Message()
                   << "seed " << seed << " kernel " << kernel << " d_nope " << c.d_nope << " d_v "
                   << c.d_v << " H " << c.num_heads << " trend " << c.trend);
      Rng rng(seed);
      std::vector<int32_t> cu_q{0}, cu_kv{0};
      for (auto [p, e] : c.prefix_extend) {
        cu_q.push_back(cu_q.back() + e);
        cu_kv.push_back(cu_kv.back() + p + e);
      }
      const int t_n = cu_q.back(), n = cu_kv.back(), h = c.num_heads;
      const int d_qk = c.d_nope + kDr;
      Tensor q_nope = testing::random_tensor(rng, DType::kBF16, {t_n, h, c.d_nope});
      Tensor q_pe = testing::random_tensor(rng, DType::kBF16, {t_n, h, kDr});
      Tensor k_nope = testing::random_tensor(rng, DType::kBF16, {n, h, c.d_nope});
      Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {n, kDr});
      Tensor v = testing::random_tensor(rng, DType::kBF16, {n, h, c.d_v});
      const double sm_scale = 1.0 / std::sqrt(double(d_qk));
      if (c.trend != 0) {
        for (int64_t th = 0; th < int64_t(t_n) * h; ++th)
          q_pe.ptr<bf16_t>()[th * kDr] = f32_to_bf16(1.f);
        for (int64_t i = 0; i < n; ++i)
          k_pe.ptr<bf16_t>()[i * kDr] =
              f32_to_bf16(float(double(i) * c.trend / (sm_scale * 1.4426950408889634)));
      }
      Tensor qn_d = to_dev(q_nope), qp_d = to_dev(q_pe), kn_d = to_dev(k_nope), kp_d = to_dev(k_pe),
             v_d = to_dev(v), cq_d = to_dev(host_i32(cu_q)), ck_d = to_dev(host_i32(cu_kv));

      DenseMhaArgs a = dense_args(qn_d, qp_d, kn_d, kp_d, v_d, cq_d, ck_d, cu_q, cu_kv, sm_scale);
      // K and V also as the halves of one [n, h, d_nope + d_v] buffer (what one up-projection
      // GEMM writes): the third run reads them there and must give the same bits.
      Tensor kv_host = Tensor::host(DType::kBF16, {n, h, c.d_nope + c.d_v});
      for (int64_t nh = 0; nh < int64_t(n) * h; ++nh) {
        bf16_t* row = kv_host.ptr<bf16_t>() + nh * (c.d_nope + c.d_v);
        std::memcpy(row, k_nope.ptr<bf16_t>() + nh * c.d_nope, size_t(c.d_nope) * 2);
        std::memcpy(row + c.d_nope, v.ptr<bf16_t>() + nh * c.d_v, size_t(c.d_v) * 2);
      }
      const Tensor kv_d = to_dev(kv_host);
      const KvHalves halves = kv_halves(kv_d, c.d_nope);
      std::vector<uint8_t> first_bits;
      std::vector<double> o_out, lse_out, o_unsplit, lse_unsplit;
      // The fourth run orders the wgmma kernel's grid in groups of 3 heads (and 1 on a single
      // head): the same bits. The fifth leaves a short tile's blocks to one consumer group (no
      // split blocks): another summation order, checked against the reference below.
      for (int run = 0; run < 5; ++run) {
        const KernelScope group("DSAKIT_DENSE_HEAD_GROUP", run == 3 ? "3" : "auto");
        const KernelScope split("DSAKIT_DENSE_SPLIT_BLOCKS", run == 4 ? "0" : "1");
        Tensor o = poisoned(DType::kBF16, {t_n, h, c.d_v});
        Tensor lse = poisoned(DType::kF32, {t_n, h});
        a.o = o.view();
        a.lse = lse.view();
        a.k_nope = run == 2 ? halves.k_nope : kn_d.view();
        a.v = run == 2 ? halves.v : v_d.view();
        backend_->dense_mha(a);
        Tensor o_h = backend_->to_host(o.view());
        std::vector<uint8_t> bits(o_h.nbytes());
        std::memcpy(bits.data(), o_h.ptr<uint8_t>(), bits.size());
        if (run == 0) {
          first_bits = std::move(bits);
          o_out = testing::to_double(o_h.view());
          lse_out = testing::to_double(backend_->to_host(lse.view()).view());
        } else if (run == 4) {
          o_unsplit = testing::to_double(o_h.view());
          lse_unsplit = testing::to_double(backend_->to_host(lse.view()).view());
        } else {
          EXPECT_EQ(bits, first_bits)
              << (run == 1   ? "o differs between two identical runs"
                  : run == 2 ? "o differs with K/V as halves of one buffer"
                             : "o differs with the grid in head groups of 3");
        }
      }

      const ReferenceQk qk = reference_qk(q_nope, q_pe, k_nope, k_pe);
      const auto ref = reference::dense_attention(qk.q, qk.k, testing::to_double(v.view()), h, d_qk,
                                                  c.d_v, cu_q, cu_kv, a.sm_scale);
      EXPECT_LE(testing::rel_l2(o_out, ref.o), testing::kTolBf16) << "o rel-L2";
      EXPECT_LE(testing::max_abs_diff(lse_out, ref.lse), testing::kTolLse) << "lse";
      EXPECT_LE(testing::rel_l2(o_unsplit, ref.o), testing::kTolBf16) << "o rel-L2, no split";
      EXPECT_LE(testing::max_abs_diff(lse_unsplit, ref.lse), testing::kTolLse) << "lse, no split";
    }
}

// kv_mask (the wgmma kernel) against the float64 reference under the same mask: each query keeps
// a random half of its positions, or `keep` random ones (a top-k: over long contexts whole
// split-KV parts and blocks where a row keeps nothing), with random bits set past its causal
// range (ignored) and one query keeping nothing (o 0, lse +inf); both tile shapes, split blocks
// on and off, two runs bit-identical. A mask of every bit gives the unmasked kernel's bits, and
// the mma.sync kernel refuses a mask, naming it, and writes nothing.
TEST_F(CudaDenseMha, MaskMatchesReference) {
  struct MaskCase {
    int d_nope, d_v, num_heads;
    std::vector<std::pair<int, int>> prefix_extend;
    int keep;  // positions a query keeps; 0: each with probability 1/2
  };
  const std::vector<MaskCase> cases = {
      {128, 128, 8, {{0, 700}, {300, 333}, {129, 64}}, 0},
      {192, 256, 4, {{0, 517}, {64, 191}, {1, 1}}, 0},
      {128, 128, 16, {{1990, 64}}, 96},  // split-KV over a long prefix
      {192, 256, 16, {{1000, 40}, {0, 3}}, 96},
      {128, 128, 16, {{100, 40}, {60, 4}}, 0},  // <= 64 rows over >= 2 blocks: split blocks
      {192, 256, 16, {{100, 40}, {60, 4}}, 0},  // the same over 80-row blocks
      {192, 256, 4, {{300, 60}, {700, 33}}, 12},
  };
  constexpr int kDr = 64;
  for (const MaskCase& c : cases)
    for (const char* split : {"1", "0"}) {
      const KernelScope sm90("DSAKIT_DENSE_MHA_KERNEL", "sm90");
      const KernelScope split_scope("DSAKIT_DENSE_SPLIT_BLOCKS", split);
      const uint64_t seed = testing::fresh_seed();
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " d_v " << c.d_v << " H "
                                        << c.num_heads << " keep " << c.keep << " split " << split);
      Rng rng(seed);
      std::vector<int32_t> cu_q{0}, cu_kv{0};
      int longest = 0;
      for (auto [p, e] : c.prefix_extend) {
        cu_q.push_back(cu_q.back() + e);
        cu_kv.push_back(cu_kv.back() + p + e);
        longest = std::max(longest, p + e);
      }
      const int t_n = cu_q.back(), n = cu_kv.back(), h = c.num_heads, d_qk = c.d_nope + kDr;
      const int64_t words = (longest + 31) / 32 + 1;  // one word more than the longest needs
      std::vector<uint32_t> bits(size_t(t_n * words), 0u);
      const int empty_query = 5;  // request 0's row 5 keeps nothing
      for (size_t r = 0; r + 1 < cu_q.size(); ++r)
        for (int32_t t = cu_q[r]; t < cu_q[r + 1]; ++t) {
          const int visible = cu_kv[r + 1] - cu_kv[r] - (cu_q[r + 1] - t) + 1;
          std::vector<int32_t> kept;
          for (int pos = 0; pos < visible; ++pos)
            if (c.keep > 0 || rng.randint(0, 1) == 1) kept.push_back(pos);
          if (c.keep > 0) {
            std::shuffle(kept.begin(), kept.end(), rng.gen());
            kept.resize(std::min<size_t>(kept.size(), size_t(c.keep)));
          }
          if (t == empty_query) kept.clear();
          for (int32_t pos : kept) bits[size_t(t * words + pos / 32)] |= 1u << (pos % 32);
          for (int i = 0; i < 8; ++i) {  // past the causal range: never read as a key
            const int64_t pos = rng.randint(visible, int(words * 32 - 1));
            bits[size_t(t * words + pos / 32)] |= 1u << (pos % 32);
          }
        }
      std::vector<uint32_t> ref_bits = bits;  // the reference's mask: causal positions only
      for (size_t r = 0; r + 1 < cu_q.size(); ++r)
        for (int32_t t = cu_q[r]; t < cu_q[r + 1]; ++t) {
          const int visible = cu_kv[r + 1] - cu_kv[r] - (cu_q[r + 1] - t) + 1;
          for (int64_t pos = visible; pos < words * 32; ++pos)
            ref_bits[size_t(t * words + pos / 32)] &= ~(1u << (pos % 32));
        }
      Tensor mask = Tensor::host(DType::kI32, {t_n, words});
      std::memcpy(mask.ptr<int32_t>(), bits.data(), bits.size() * 4);

      Tensor q_nope = testing::random_tensor(rng, DType::kBF16, {t_n, h, c.d_nope});
      Tensor q_pe = testing::random_tensor(rng, DType::kBF16, {t_n, h, kDr});
      Tensor k_nope = testing::random_tensor(rng, DType::kBF16, {n, h, c.d_nope});
      Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {n, kDr});
      Tensor v = testing::random_tensor(rng, DType::kBF16, {n, h, c.d_v});
      const Tensor qn_d = to_dev(q_nope), qp_d = to_dev(q_pe), kn_d = to_dev(k_nope),
                   kp_d = to_dev(k_pe), v_d = to_dev(v), cq_d = to_dev(host_i32(cu_q)),
                   ck_d = to_dev(host_i32(cu_kv)), mask_d = to_dev(mask);
      DenseMhaArgs a = dense_args(qn_d, qp_d, kn_d, kp_d, v_d, cq_d, ck_d, cu_q, cu_kv,
                                  1.0 / std::sqrt(double(d_qk)));
      // run(mask or null) -> (o bits, o, lse)
      const auto run = [&](const Tensor* m) {
        Tensor o = poisoned(DType::kBF16, {t_n, h, c.d_v});
        Tensor lse = poisoned(DType::kF32, {t_n, h});
        a.o = o.view();
        a.lse = lse.view();
        a.kv_mask = m ? m->view() : TensorView{};
        backend_->dense_mha(a);
        return std::pair{backend_->to_host(o.view()), backend_->to_host(lse.view())};
      };
      const auto [o1, lse1] = run(&mask_d);
      const auto [o2, lse2] = run(&mask_d);
      EXPECT_EQ(testing::checksum(o1.view()), testing::checksum(o2.view())) << "o, two runs";
      EXPECT_EQ(testing::checksum(lse1.view()), testing::checksum(lse2.view())) << "lse, two runs";

      const ReferenceQk qk = reference_qk(q_nope, q_pe, k_nope, k_pe);
      const auto ref = reference::dense_attention(qk.q, qk.k, testing::to_double(v.view()), h, d_qk,
                                                  c.d_v, cu_q, cu_kv, a.sm_scale, &ref_bits, words);
      const auto o = testing::to_double(o1.view()), lse = testing::to_double(lse1.view());
      EXPECT_LE(testing::rel_l2(o, ref.o), testing::kTolBf16) << "o rel-L2";
      EXPECT_LE(testing::max_abs_diff(lse, ref.lse), testing::kTolLse) << "lse";
      for (int hh = 0; hh < h; ++hh) {
        EXPECT_EQ(lse[size_t(empty_query * h + hh)], std::numeric_limits<double>::infinity());
        for (int d = 0; d < c.d_v; ++d)
          ASSERT_EQ(o[size_t((empty_query * h + hh) * c.d_v + d)], 0.0) << "empty query's o";
      }

      if (&c == &cases.front() && split[0] == '1') {
        Tensor all = Tensor::host(DType::kI32, {t_n, words});
        std::fill_n(all.ptr<int32_t>(), all.numel(), -1);
        const Tensor all_d = to_dev(all);
        const auto [o_all, lse_all] = run(&all_d);
        const auto [o_plain, lse_plain] = run(nullptr);
        EXPECT_EQ(testing::checksum(o_all.view()), testing::checksum(o_plain.view()))
            << "a mask of every bit changed o";
        EXPECT_EQ(testing::checksum(lse_all.view()), testing::checksum(lse_plain.view()));
        const KernelScope sm80("DSAKIT_DENSE_MHA_KERNEL", "sm80");
        const Tensor untouched = poisoned(DType::kBF16, {t_n, h, c.d_v});
        const uint64_t before = testing::checksum(backend_->to_host(untouched.view()).view());
        a.o = untouched.view();
        a.kv_mask = mask_d.view();
        try {
          backend_->dense_mha(a);
          ADD_FAILURE() << "the mma.sync kernel took kv_mask";
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
          EXPECT_NE(std::string(e.what()).find("kv_mask"), std::string::npos) << e.what();
        }
        EXPECT_EQ(testing::checksum(backend_->to_host(untouched.view()).view()), before);
      }
    }
}

// A request's output does not depend on the rows after it: NaN in every K / V row of the second
// request leaves the first request's o and lse bit-identical (the kernels read a block past a
// tile's last visible row as zeros, so P = 0 never multiplies another request's NaN).
TEST_F(CudaDenseMha, NanInALaterRequestDoesNotReachAnEarlierOne) {
  constexpr int kDr = 64;
  // The first request (prefix, extend) and a 50-token second one: 100 fresh rows (one tile,
  // both consumer groups), and 40 rows over a 100-position prefix (the sm90 kernel's split
  // blocks: its second block, group 1's, reaches into the NaN rows).
  for (const auto& [prefix, extend] : {std::pair{0, 100}, std::pair{100, 40}})
    for (const auto& [d_nope, d_v] : {std::pair{128, 128}, std::pair{192, 256}})
      for (const char* kernel : {"sm80", "sm90"}) {
        const KernelScope scope("DSAKIT_DENSE_MHA_KERNEL", kernel);
        const uint64_t seed = testing::fresh_seed();
        SCOPED_TRACE(::testing::Message() << "seed " << seed << " kernel " << kernel << " d_v "
                                          << d_v << " prefix " << prefix << " extend " << extend);
        Rng rng(seed);
        const int first = extend, first_kv = prefix + extend;  // the first request's q / kv rows
        const std::vector<int32_t> cu_q{0, first, first + 50}, cu_kv{0, first_kv, first_kv + 50};
        const int t_n = cu_q.back(), n = cu_kv.back(), h = 2;
        Tensor q_nope = testing::random_tensor(rng, DType::kBF16, {t_n, h, d_nope});
        Tensor q_pe = testing::random_tensor(rng, DType::kBF16, {t_n, h, kDr});
        Tensor k_nope = testing::random_tensor(rng, DType::kBF16, {n, h, d_nope});
        Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {n, kDr});
        Tensor v = testing::random_tensor(rng, DType::kBF16, {n, h, d_v});
        Tensor qn_d = to_dev(q_nope), qp_d = to_dev(q_pe), cq_d = to_dev(host_i32(cu_q)),
               ck_d = to_dev(host_i32(cu_kv));
        std::vector<uint8_t> clean_bits[2];
        for (int poison_second = 0; poison_second < 2; ++poison_second) {
          if (poison_second) {
            const bf16_t nan{uint16_t(0x7FC0)};
            for (int64_t i = int64_t(first_kv) * h * d_nope; i < int64_t(n) * h * d_nope; ++i)
              k_nope.ptr<bf16_t>()[i] = nan;
            for (int64_t i = int64_t(first_kv) * kDr; i < int64_t(n) * kDr; ++i)
              k_pe.ptr<bf16_t>()[i] = nan;
            for (int64_t i = int64_t(first_kv) * h * d_v; i < int64_t(n) * h * d_v; ++i)
              v.ptr<bf16_t>()[i] = nan;
          }
          Tensor kn_d = to_dev(k_nope), kp_d = to_dev(k_pe), v_d = to_dev(v);
          Tensor o = poisoned(DType::kBF16, {t_n, h, d_v});
          Tensor lse = poisoned(DType::kF32, {t_n, h});
          DenseMhaArgs a = dense_args(qn_d, qp_d, kn_d, kp_d, v_d, cq_d, ck_d, cu_q, cu_kv,
                                      1.0 / std::sqrt(double(d_nope + kDr)));
          a.o = o.view();
          a.lse = lse.view();
          backend_->dense_mha(a);
          const Tensor o_h = backend_->to_host(o.view()), lse_h = backend_->to_host(lse.view());
          // The first request's rows: o then lse.
          std::vector<uint8_t> bits(size_t(first) * h * (d_v * 2 + 4));
          std::memcpy(bits.data(), o_h.ptr<uint8_t>(), size_t(first) * h * d_v * 2);
          std::memcpy(bits.data() + size_t(first) * h * d_v * 2, lse_h.ptr<uint8_t>(),
                      size_t(first) * h * 4);
          const auto o_first = testing::to_double(o_h.view());
          for (size_t i = 0; i < size_t(first) * h * d_v; ++i)
            ASSERT_TRUE(std::isfinite(o_first[i])) << "o[" << i << "]";
          clean_bits[poison_second] = std::move(bits);
        }
        EXPECT_EQ(clean_bits[0], clean_bits[1]) << "NaN after the first request changed its rows";
      }
}

TEST_F(CudaDenseMha, UnsupportedHeadDimsAreRejected) {
  const SmallCall c = small_call(96, 96);
  const DenseMhaArgs& a = c.args;
  try {
    backend_->dense_mha(a);
    FAIL() << "expected Error(kUnsupported) for (96, 64, 96)";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("d_nope"), std::string::npos) << e.what();
  }
}

// A schedule longer than the launch parameters carry is copied from host memory that lives for
// the call only: while the stream captures a graph the op refuses it (a replay would read that
// memory after it is gone), naming the limit; the same batch runs outside the capture (and the
// "many" case above checks such a batch's values).
TEST_F(CudaDenseMha, LongScheduleIsRefusedWhileCapturing) {
  constexpr int kH = 2, kDn = 128, kDv = 128, kDr = 64;
  const int requests = cuda::dense_mha::kDenseInlineTiles + 4;  // one token, one tile each
  std::vector<int32_t> cu(size_t(requests) + 1);
  for (int r = 0; r <= requests; ++r) cu[size_t(r)] = r;
  Rng rng(testing::fresh_seed());
  const auto input = [&](std::vector<int64_t> shape) {
    return to_dev(testing::random_tensor(rng, DType::kBF16, shape));
  };
  const Tensor q_nope = input({requests, kH, kDn}), q_pe = input({requests, kH, kDr}),
               k_nope = input({requests, kH, kDn}), k_pe = input({requests, kDr}),
               v = input({requests, kH, kDv});
  const Tensor cu_d = to_dev(host_i32(cu));
  const Tensor o = poisoned(DType::kBF16, {requests, kH, kDv});
  const Tensor lse = poisoned(DType::kF32, {requests, kH});
  DenseMhaArgs a = dense_args(q_nope, q_pe, k_nope, k_pe, v, cu_d, cu_d, cu, cu, 0.1);
  a.o = o.view();
  a.lse = lse.view();
  backend_->dense_mha(a);  // outside a capture: runs, every output written
  const std::vector<double> eager = testing::to_double(backend_->to_host(o.view()));
  EXPECT_TRUE(std::all_of(eager.begin(), eager.end(), [](double x) { return std::isfinite(x); }));

  auto& gpu = static_cast<cuda::CudaBackend&>(*backend_);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  gpu.set_stream(stream);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
  ErrorKind kind = ErrorKind::kInternal;
  std::string message = "no error";
  try {
    backend_->dense_mha(a);
  } catch (const Error& e) {
    kind = e.kind();
    message = e.what();
  }
  cudaGraph_t graph = nullptr;
  cudaStreamEndCapture(stream, &graph);
  if (graph != nullptr) cudaGraphDestroy(graph);
  gpu.set_stream(nullptr);
  cudaStreamDestroy(stream);
  EXPECT_EQ(kind, ErrorKind::kUnsupported) << message;
  EXPECT_NE(message.find("CUDA graph"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(cuda::dense_mha::kDenseInlineTiles)), std::string::npos)
      << message;
}

// A malformed DSAKIT_DENSE_HEAD_GROUP is an argument error naming the variable, before any
// launch: o keeps its poison.
TEST_F(CudaDenseMha, MalformedSettingIsRejectedNamingTheVariable) {
  const SmallCall c = small_call(128, 128);
  const DenseMhaArgs& a = c.args;
  const Tensor& o = c.o;
  const Tensor before = backend_->to_host(o.view());
  for (const auto& [env, bad] :
       {std::pair{"DSAKIT_DENSE_HEAD_GROUP", "0"}, std::pair{"DSAKIT_DENSE_HEAD_GROUP", "-3"},
        std::pair{"DSAKIT_DENSE_HEAD_GROUP", "two"}, std::pair{"DSAKIT_DENSE_HEAD_GROUP", "4x"},
        std::pair{"DSAKIT_DENSE_SPLIT_BLOCKS", "yes"},
        std::pair{"DSAKIT_DENSE_SPLIT_BLOCKS", "2"}}) {
    SCOPED_TRACE(::testing::Message() << env << "=" << bad);
    const KernelScope setting(env, bad);
    try {
      backend_->dense_mha(a);
      ADD_FAILURE() << "expected Error(kInvalidArgument)";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(env), std::string::npos) << e.what();
    }
    const Tensor after = backend_->to_host(o.view());
    EXPECT_EQ(std::memcmp(after.ptr<uint8_t>(), before.ptr<uint8_t>(), before.nbytes()), 0);
  }
}

}  // namespace
}  // namespace dsakit
