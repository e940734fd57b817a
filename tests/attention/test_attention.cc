// Projection and attention kernels (absorb_q, up_proj_v, up_proj_kv, sparse_mla, dense_mha,
// merge_partials) through the Backend interface, on every test backend, against the float64
// reference (docs/design.md#sparse-mla to #equivalence, docs/layer.md,
// docs/reliability.md, docs/numerics.md). Inputs are random and fresh per run; outputs are
// poisoned before each kernel writes them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/error.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"
#include "tools/harness.h"

namespace dsakit {
namespace {

using reference::Vec;
using testing::expect_error_naming;
using testing::poisoned;
using testing::Rng;

constexpr int kDc = 512;
constexpr int kDrope = 64;
constexpr double kInf = std::numeric_limits<double>::infinity();

// Per-rank head shapes of the two model families (docs/config.md); d_c = 512, d_rope = 64.
struct HeadDims {
  const char* name;
  int heads;
  int d_nope;
  int d_v;
};
const HeadDims kAllDims[] = {{"DeepSeekV32_H128", 128, 128, 128},
                             {"DeepSeekV32_TP8_H16", 16, 128, 128},
                             {"GLM5_H64", 64, 192, 256},
                             {"GLM5_TP4_H16", 16, 192, 256}};

double default_sm_scale(const HeadDims& d) {
  return 1.0 / std::sqrt(double(d.d_nope + kDrope));
}

// ---- helpers ------------------------------------------------------------------------------

// Runs fn(backend) once per test backend whose attention intermediates are f32 (the CPU
// backend). The CUDA attention kernels take bf16 only; tests/cuda/test_cuda_attention.cc covers
// them against the same float64 reference.
void for_each_backend(const std::function<void(Backend&)>& fn) {
  int ran = 0;
  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE("backend " + name);
    std::unique_ptr<Backend> backend = make_backend(name);
    if (backend->capabilities().intermediate_dtype != DType::kF32) continue;
    fn(*backend);
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no backend under test has f32 attention intermediates";
}

Vec read(Backend& b, const TensorView& t) {
  return reference::to_vec(b.to_host(t));
}

Tensor host_i32(const std::vector<int32_t>& values) {
  Tensor t = Tensor::host(DType::kI32, {int64_t(values.size())});
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

Tensor host_i32_2d(const std::vector<int32_t>& values, int64_t rows, int64_t cols) {
  Tensor t = Tensor::host(DType::kI32, {rows, cols});
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

// Rel-L2 check with the measured error printed when DSAKIT_TEST_VERBOSE is set.
void expect_rel_l2(const Vec& out, const Vec& ref, double tol, const std::string& what) {
  const double err = testing::rel_l2(out, ref);
  if (std::getenv("DSAKIT_TEST_VERBOSE")) std::printf("  %-40s rel-L2 %.3e\n", what.c_str(), err);
  EXPECT_LE(err, tol) << what;
}

void expect_lse(const Vec& out, const Vec& ref, const std::string& what) {
  const double err = testing::max_abs_diff(out, ref);
  if (std::getenv("DSAKIT_TEST_VERBOSE")) std::printf("  %-40s lse abs %.3e\n", what.c_str(), err);
  EXPECT_LE(err, testing::kTolLse) << what;
}

double tolerance(DType out) {
  return out == DType::kF32 ? testing::kTolF32 : testing::kTolBf16;
}

// [rows, a] and [rows, b] -> [rows, a + b].
Vec concat_rows(const Vec& x, int64_t a, const Vec& y, int64_t b) {
  const int64_t rows = int64_t(x.size()) / a;
  Vec out(size_t(rows * (a + b)));
  for (int64_t r = 0; r < rows; ++r) {
    std::copy_n(x.begin() + r * a, a, out.begin() + r * (a + b));
    std::copy_n(y.begin() + r * b, b, out.begin() + r * (a + b) + a);
  }
  return out;
}

// k_nope [N, H, d_nope] and k_pe [N, d_rope] -> k [N, H, d_nope + d_rope] (k_pe on every head).
Vec per_head_keys(const Vec& k_nope, const Vec& k_pe, int64_t n, int heads, int d_nope) {
  Vec k_pe_heads(size_t(n * heads * kDrope));
  for (int64_t r = 0; r < n; ++r)
    for (int h = 0; h < heads; ++h)
      std::copy_n(k_pe.begin() + r * kDrope, kDrope, k_pe_heads.begin() + (r * heads + h) * kDrope);
  return concat_rows(k_nope, d_nope, k_pe_heads, kDrope);
}

// Row `row` of two [*, width] arrays holds the same bits in both.
bool rows_bitwise_equal(const Vec& a, const Vec& b, int64_t row, int64_t width) {
  return std::memcmp(a.data() + row * width, b.data() + row * width,
                     size_t(width) * sizeof(double)) == 0;
}

// A latent pool with every location written by store_kv from random bf16 c_kv / k_pe.
struct FilledPool {
  PagedKvPool pool;
  Vec kv;  // [num_locations, d_c + d_rope] the values a reader sees (reference decode)
};

FilledPool make_filled_pool(Backend& b, Rng& rng, const KvPoolDesc& desc) {
  FilledPool f{b.make_kv_pool(desc), {}};
  const int64_t n = desc.num_locations();
  std::vector<int32_t> locs(static_cast<size_t>(n));
  std::iota(locs.begin(), locs.end(), 0);
  std::shuffle(locs.begin(), locs.end(), rng.gen());
  const Tensor c_kv = testing::random_tensor(rng, DType::kBF16, {n, desc.d_c});
  const Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {n, desc.d_rope});
  b.store_kv(f.pool, b.to_device(host_i32(locs)), b.to_device(c_kv), b.to_device(k_pe));
  const Tensor bytes = b.to_host(f.pool.storage());
  const int d_qk = desc.d_c + desc.d_rope;
  f.kv.resize(size_t(n * d_qk));
  for (int64_t loc = 0; loc < n; ++loc) {
    double* row = f.kv.data() + loc * d_qk;
    reference::decode_kv_row(desc.row(), bytes.ptr<uint8_t>() + loc * desc.bytes_per_token(),
                             desc.k_scale, row, row + desc.d_c);
  }
  return f;
}

// ---- projections ----------------------------------------------------------------------------

class ProjectionTest : public ::testing::TestWithParam<HeadDims> {};

TEST_P(ProjectionTest, MatchesReference) {
  const HeadDims d = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t tokens = 5, rows = 9;
  const Tensor w = testing::random_tensor(rng, DType::kBF16,
                                          {int64_t(d.heads) * (d.d_nope + d.d_v), kDc}, 0.05f);
  const Vec w_ref = reference::to_vec(w);
  struct Case {
    DType in, out;
  };
  for (const Case c : {Case{DType::kF32, DType::kF32}, Case{DType::kBF16, DType::kF32},
                       Case{DType::kBF16, DType::kBF16}}) {
    const std::string tag = std::string(to_string(c.in)) + "->" + to_string(c.out);
    SCOPED_TRACE(tag);
    const Tensor q_nope = testing::random_tensor(rng, c.in, {tokens, d.heads, d.d_nope});
    const Tensor o_lat = testing::random_tensor(rng, c.in, {tokens, d.heads, kDc});
    const Tensor c_kv = testing::random_tensor(rng, c.in, {rows, kDc});
    const Vec ref_q_abs = reference::absorb_q(reference::to_vec(q_nope), w_ref, tokens, d.heads,
                                              d.d_nope, d.d_v, kDc);
    const Vec ref_o = reference::up_proj_v(reference::to_vec(o_lat), w_ref, tokens, d.heads,
                                           d.d_nope, d.d_v, kDc);
    Vec ref_k_nope, ref_v;
    reference::up_proj_kv(reference::to_vec(c_kv), w_ref, rows, d.heads, d.d_nope, d.d_v, kDc,
                          ref_k_nope, ref_v);
    for_each_backend([&](Backend& b) {
      const Tensor w_dev = b.to_device(w);
      const Tensor q_abs = poisoned(b, c.out, {tokens, d.heads, kDc});
      b.absorb_q(b.to_device(q_nope), w_dev, d.d_v, q_abs);
      expect_rel_l2(read(b, q_abs), ref_q_abs, tolerance(c.out), "absorb_q " + tag);

      const Tensor o = poisoned(b, c.out, {tokens, d.heads, d.d_v});
      b.up_proj_v(b.to_device(o_lat), w_dev, d.d_nope, o);
      expect_rel_l2(read(b, o), ref_o, tolerance(c.out), "up_proj_v " + tag);

      const Tensor k_nope = poisoned(b, c.out, {rows, d.heads, d.d_nope});
      const Tensor v = poisoned(b, c.out, {rows, d.heads, d.d_v});
      b.up_proj_kv(b.to_device(c_kv), w_dev, k_nope, v);
      expect_rel_l2(read(b, k_nope), ref_k_nope, tolerance(c.out), "up_proj_kv k_nope " + tag);
      expect_rel_l2(read(b, v), ref_v, tolerance(c.out), "up_proj_kv v " + tag);

      // k_nope / v as the halves of one [rows, H, d_nope + d_v] buffer: one GEMM on a backend
      // that takes them (bf16), a refusal naming k_nope on one that does not.
      const Tensor kv = poisoned(b, c.out, {rows, d.heads, d.d_nope + d.d_v});
      const KvHalves halves = kv_halves(kv, d.d_nope);
      if (!b.capabilities().kv_halves) {
        expect_error_naming(
            [&] { b.up_proj_kv(b.to_device(c_kv), w_dev, halves.k_nope, halves.v); }, "k_nope");
      } else if (c.in == DType::kBF16 && c.out == DType::kBF16) {
        b.up_proj_kv(b.to_device(c_kv), w_dev, halves.k_nope, halves.v);
        const Vec all = read(b, kv);
        Vec kn, vv;
        for (int64_t rh = 0; rh < rows * d.heads; ++rh) {
          const auto row = all.begin() + rh * (d.d_nope + d.d_v);
          kn.insert(kn.end(), row, row + d.d_nope);
          vv.insert(vv.end(), row + d.d_nope, row + d.d_nope + d.d_v);
        }
        expect_rel_l2(kn, ref_k_nope, tolerance(c.out), "up_proj_kv halves k_nope " + tag);
        expect_rel_l2(vv, ref_v, tolerance(c.out), "up_proj_kv halves v " + tag);
      }
      // Views that are not the halves of one buffer (v not right after k_nope) are refused.
      KvHalves wrong = halves;
      wrong.v.data = static_cast<char*>(wrong.v.data) + dtype_size(c.out);
      wrong.v.shape[2] -= 1;
      expect_error_naming([&] { b.up_proj_kv(b.to_device(c_kv), w_dev, wrong.k_nope, wrong.v); },
                          "k_nope");
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ProjectionTest, ::testing::ValuesIn(kAllDims),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- the FP8 K/V up-projection -----------------------------------------------------------------

// How a bf16 result lies against its float64 value's own bf16 rounding: the share of elements
// that rounded to another value, and the largest distance in units in the last place.
struct RoundingOffset {
  int64_t elements = 0, off = 0;
  double max_ulps = 0;
  void add(const Vec& got, const Vec& ref) {
    for (size_t i = 0; i < got.size(); ++i, ++elements) {
      if (got[i] == reference::bf16_round(ref[i])) continue;
      ++off;
      const double ulp = ref[i] != 0 ? std::ldexp(1.0, std::ilogb(ref[i]) - 7) : 1.0;
      max_ulps = std::max(max_ulps, std::fabs(got[i] - ref[i]) / ulp);
    }
  }
};

// up_proj_kv_fp8 on every backend that has it, against the float64 reference of the same pool
// values and weights: both FP8 layouts (fp8 with amax and pow2 tile scales, fp8-raw), row counts
// below, at and past multiples of 16 (CUDA runs the last n % 16 rows as a GEMM of their own),
// repeated locations; then the refusals (a bf16 pool, a wrong scale shape) before anything is
// written.
TEST(Fp8UpProjection, MatchesReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  int ran = 0;
  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE("backend " + name);
    std::unique_ptr<Backend> b = make_backend(name);
    if (!b->capabilities().fp8_up_proj) continue;
    ++ran;
    const DType mid = b->capabilities().intermediate_dtype;
    const bool halves = b->capabilities().kv_halves && mid == DType::kBF16;
    for (const ModelConfig& c : {ModelConfig::preset("deepseek-v3.2").with_tp(8),
                                 ModelConfig::preset("glm-5").with_tp(4)}) {
      const int h = c.num_heads, dn = c.qk_nope_head_dim, dv = c.v_head_dim;
      SCOPED_TRACE(c.name);
      RoundingOffset offset;  // bf16 outputs: k_nope and v against the float64 product
      const Fp8KvBProj w = random_fp8_kv_b_proj(c, rng.gen()());
      const Tensor w_codes = b->to_device(w.codes), w_scales = b->to_device(w.scales);
      const Fp8BlockWeights w_dev{w_codes, w_scales};
      const Vec w_ref = reference::to_vec(w.bf16);
      struct Layout {
        KvLayout layout;
        ScalePolicy policy;
      };
      for (const Layout l : {Layout{KvLayout::kFp8Scaled, ScalePolicy::kAmax},
                             Layout{KvLayout::kFp8Scaled, ScalePolicy::kPow2},
                             Layout{KvLayout::kFp8Raw, ScalePolicy::kAmax}}) {
        KvPoolDesc desc;
        desc.layout = l.layout;
        desc.scale_policy = l.policy;
        desc.page_size = 16;
        desc.num_pages = 4;
        desc.k_scale = 0.0625f;
        const FilledPool f = make_filled_pool(*b, rng, desc);
        const int d_qk = kDc + kDrope;
        for (const int64_t n : {1, 6, 16, 29, 64}) {
          const std::string tag = std::string(to_string(l.layout)) + " " + to_string(l.policy) +
                                  " n=" + std::to_string(n);
          SCOPED_TRACE(tag);
          std::vector<int32_t> locs(static_cast<size_t>(n));
          for (auto& loc : locs) loc = int32_t(rng.gen()() % uint64_t(desc.num_locations()));
          Vec c_ref, kpe_ref;
          for (const int32_t loc : locs) {
            const auto row = f.kv.begin() + int64_t(loc) * d_qk;
            c_ref.insert(c_ref.end(), row, row + kDc);
            kpe_ref.insert(kpe_ref.end(), row + kDc, row + d_qk);
          }
          Vec ref_k_nope, ref_v;
          reference::up_proj_kv(c_ref, w_ref, n, h, dn, dv, kDc, ref_k_nope, ref_v);
          const Tensor d_locs = b->to_device(host_i32(locs));
          const Tensor k_pe = poisoned(*b, mid, {n, kDrope});
          Vec k_nope_out, v_out;
          if (halves) {
            const Tensor kv = poisoned(*b, mid, {n, h, dn + dv});
            const KvHalves kvh = kv_halves(kv, dn);
            b->up_proj_kv_fp8(f.pool, d_locs, w_dev, kvh.k_nope, kvh.v, k_pe);
            const Vec all = read(*b, kv);
            for (int64_t rh = 0; rh < n * h; ++rh) {
              const auto row = all.begin() + rh * (dn + dv);
              k_nope_out.insert(k_nope_out.end(), row, row + dn);
              v_out.insert(v_out.end(), row + dn, row + dn + dv);
            }
          } else {
            const Tensor k_nope = poisoned(*b, mid, {n, h, dn});
            const Tensor v = poisoned(*b, mid, {n, h, dv});
            b->up_proj_kv_fp8(f.pool, d_locs, w_dev, k_nope, v, k_pe);
            k_nope_out = read(*b, k_nope);
            v_out = read(*b, v);
          }
          expect_rel_l2(k_nope_out, ref_k_nope, tolerance(mid), "k_nope " + tag);
          expect_rel_l2(v_out, ref_v, tolerance(mid), "v " + tag);
          expect_rel_l2(read(*b, k_pe), kpe_ref, tolerance(mid), "k_pe " + tag);
          if (mid == DType::kBF16) offset.add(k_nope_out, ref_k_nope), offset.add(v_out, ref_v);
        }
        // The figure behind the layer's lse bound after the FP8 up-projection (docs/numerics.md).
        if (offset.elements > 0 && l.layout == KvLayout::kFp8Raw)
          std::printf(
              "[ measure ] %s %s FP8 up-projection: %.2f%% of %lld k_nope/v elements off "
              "the float64 product's bf16 rounding, at most %.2f ulp\n",
              b->capabilities().device_name.c_str(), c.name.c_str(),
              100.0 * double(offset.off) / double(offset.elements),
              static_cast<long long>(offset.elements), offset.max_ulps);
        if (l.layout != KvLayout::kFp8Raw || c.num_heads != 16 || dn != 128) continue;
        // Refusals: a wrong scale shape, a bf16 pool (the outputs stay poisoned).
        const Tensor d_locs = b->to_device(host_i32({0, 1, 2}));
        const Tensor kv = poisoned(*b, mid, {3, h, dn + dv});
        const KvHalves kvh = halves ? kv_halves(kv, dn) : KvHalves{};
        const Tensor k_nope = poisoned(*b, mid, {3, h, dn}), v = poisoned(*b, mid, {3, h, dv});
        const TensorView out_k = halves ? kvh.k_nope : k_nope.view(),
                         out_v = halves ? kvh.v : v.view();
        const Tensor k_pe = poisoned(*b, mid, {3, kDrope});
        const Tensor short_scales = b->to_device(Tensor::host(DType::kF32, {1, kDc / 128}));
        expect_error_naming(
            [&] {
              b->up_proj_kv_fp8(f.pool, d_locs, {w_dev.codes, short_scales}, out_k, out_v, k_pe);
            },
            "kv_b_proj_fp8.scales");
        KvPoolDesc bf16_desc = desc;
        bf16_desc.layout = KvLayout::kBf16;
        const PagedKvPool bf16_pool = b->make_kv_pool(bf16_desc);
        expect_error_naming(
            [&] { b->up_proj_kv_fp8(bf16_pool, d_locs, w_dev, out_k, out_v, k_pe); }, "bf16");
        for (const double x : read(*b, k_pe)) EXPECT_TRUE(std::isnan(x));
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "no backend under test has up_proj_kv_fp8";
}

// ---- sparse MLA -------------------------------------------------------------------------------

struct PoolVariant {
  const char* name;
  KvLayout layout;
  ScalePolicy policy;
  float k_scale;
};
const PoolVariant kPoolVariants[] = {{"bf16", KvLayout::kBf16, ScalePolicy::kAmax, 1.0f},
                                     {"fp8_amax", KvLayout::kFp8Scaled, ScalePolicy::kAmax, 1.0f},
                                     {"fp8_pow2", KvLayout::kFp8Scaled, ScalePolicy::kPow2, 1.0f},
                                     {"fp8raw", KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.03f}};

// Random slot contents for `tokens` rows of k slots over a pool of n locations: mostly valid
// locations, with -1, out-of-range and duplicate entries mixed in.
std::vector<int32_t> random_indices(Rng& rng, int64_t tokens, int k, int64_t n) {
  std::vector<int32_t> idx(size_t(tokens * k));
  for (int64_t t = 0; t < tokens; ++t)
    for (int j = 0; j < k; ++j) {
      int32_t& slot = idx[size_t(t * k + j)];
      const int64_t kind = rng.randint(0, 19);
      if (kind == 0)
        slot = -1;
      else if (kind == 1)
        slot = int32_t(n + rng.randint(0, 5));  // past the pool
      else if (kind == 2)
        slot = std::numeric_limits<int32_t>::min();
      else if (kind == 3 && j > 0)
        slot = idx[size_t(t * k + rng.randint(0, j - 1))];  // repeat
      else
        slot = int32_t(rng.randint(0, n - 1));
    }
  return idx;
}

struct SparseOutputs {
  Vec o_lat, lse;
};

// Runs sparse_mla on device copies of host inputs; outputs poisoned first.
SparseOutputs run_sparse(Backend& b, const PagedKvPool& pool, const Tensor& q_abs,
                         const Tensor& q_pe, const std::vector<int32_t>& indices, int k,
                         const std::vector<int32_t>* topk_length, double sm_scale, DType out) {
  const int64_t tokens = q_abs.size(0), heads = q_abs.size(1);
  const Tensor q_abs_d = b.to_device(q_abs), q_pe_d = b.to_device(q_pe);
  const Tensor idx_d = b.to_device(host_i32_2d(indices, tokens, k));
  Tensor len_d;
  const Tensor o_lat = poisoned(b, out, {tokens, heads, kDc});
  const Tensor lse = poisoned(b, DType::kF32, {tokens, heads});
  SparseMlaArgs a;
  a.q_abs = q_abs_d;
  a.q_pe = q_pe_d;
  a.kv = &pool;
  a.indices = idx_d;
  if (topk_length) {
    len_d = b.to_device(host_i32(*topk_length));
    a.topk_length = len_d;
  }
  a.sm_scale = sm_scale;
  a.o_lat = o_lat;
  a.lse = lse;
  b.sparse_mla(a);
  return {read(b, o_lat), read(b, lse)};
}

reference::Attention sparse_reference(const Tensor& q_abs, const Tensor& q_pe, const Vec& kv,
                                      const std::vector<int32_t>& indices, int k,
                                      const std::vector<int32_t>* topk_length, double sm_scale) {
  const int64_t tokens = q_abs.size(0);
  const int heads = int(q_abs.size(1));
  const Vec q = concat_rows(reference::to_vec(q_abs), kDc, reference::to_vec(q_pe), kDrope);
  const int64_t n = int64_t(kv.size()) / (kDc + kDrope);
  return reference::sparse_attention(q, kv, tokens, heads, kDc + kDrope, kDc, n, indices, k,
                                     topk_length, sm_scale);
}

// Expects exactly o_lat = 0 and lse = +inf for token t (a query with no valid slot).
void expect_empty_token(const SparseOutputs& out, int64_t t, int64_t heads) {
  for (int64_t i = t * heads * kDc; i < (t + 1) * heads * kDc; ++i)
    ASSERT_EQ(out.o_lat[size_t(i)], 0.0) << "token " << t;
  for (int64_t h = 0; h < heads; ++h) EXPECT_EQ(out.lse[size_t(t * heads + h)], kInf);
}

class SparseMlaTest : public ::testing::TestWithParam<HeadDims> {};

TEST_P(SparseMlaTest, MatchesReferenceOnEveryLayoutAndPageSize) {
  const HeadDims d = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t tokens = 6;
  const int k = 48;
  const double sm_scale = default_sm_scale(d);
  for_each_backend([&](Backend& b) {
    for (const PoolVariant& pv : kPoolVariants)
      for (const int page_size : {1, 64}) {
        const std::string tag = std::string(pv.name) + " page " + std::to_string(page_size);
        SCOPED_TRACE(tag);
        KvPoolDesc desc;
        desc.layout = pv.layout;
        desc.scale_policy = pv.policy;
        desc.k_scale = pv.k_scale;
        desc.page_size = page_size;
        desc.num_pages = page_size == 1 ? 200 : 4;
        const FilledPool pool = make_filled_pool(b, rng, desc);
        const int64_t n = desc.num_locations();
        std::vector<int32_t> indices = random_indices(rng, tokens, k, n);
        std::fill_n(indices.begin() + 2 * k, k, -1);  // token 2: no valid slot
        std::vector<int32_t> topk_length(static_cast<size_t>(tokens));
        for (auto& len : topk_length) len = int32_t(rng.randint(0, k));
        topk_length[4] = 0;

        for (const bool use_length : {false, true}) {
          const std::vector<int32_t>* len = use_length ? &topk_length : nullptr;
          for (const DType dt : {DType::kF32, DType::kBF16}) {
            const Tensor q_abs = testing::random_tensor(rng, dt, {tokens, d.heads, kDc});
            const Tensor q_pe = testing::random_tensor(rng, dt, {tokens, d.heads, kDrope});
            const reference::Attention ref =
                sparse_reference(q_abs, q_pe, pool.kv, indices, k, len, sm_scale);
            const SparseOutputs out =
                run_sparse(b, pool.pool, q_abs, q_pe, indices, k, len, sm_scale, dt);
            const std::string what =
                "sparse_mla " + tag + (use_length ? " topk_length " : " ") + to_string(dt);
            expect_rel_l2(out.o_lat, ref.o, tolerance(dt), what);
            expect_lse(out.lse, ref.lse, what);
            expect_empty_token(out, 2, d.heads);
            if (use_length) expect_empty_token(out, 4, d.heads);
          }
        }
      }
  });
}

INSTANTIATE_TEST_SUITE_P(Models, SparseMlaTest, ::testing::ValuesIn(kAllDims),
                         [](const auto& info) { return std::string(info.param.name); });

// q_abs / q_pe as the two column ranges of one [T, H, 576] query (FlashMLA's q), and the
// optional max_logits output, with 16 and 64 heads (the CUDA backend's two kernels).
TEST(SparseMla, StridedQueryViewsAndMaxLogits) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t tokens = 5;
  const int k = 200;
  const double sm_scale = 0.1352;
  for_each_backend([&](Backend& b) {
    for (const KvLayout layout : {KvLayout::kBf16, KvLayout::kFp8Scaled})
      for (const int64_t heads : {16, 64}) {
        SCOPED_TRACE(std::string(to_string(layout)) + " H " + std::to_string(heads));
        KvPoolDesc desc;
        desc.layout = layout;
        desc.num_pages = 5;
        const FilledPool pool = make_filled_pool(b, rng, desc);
        std::vector<int32_t> indices = random_indices(rng, tokens, k, desc.num_locations());
        std::fill_n(indices.begin() + k, k, -1);  // token 1: no valid slot
        const Tensor q = testing::random_tensor(rng, DType::kBF16, {tokens, heads, kDc + kDrope});
        // The host reference reads contiguous copies of the two ranges.
        Tensor q_abs_h = Tensor::host(DType::kBF16, {tokens, heads, kDc});
        Tensor q_pe_h = Tensor::host(DType::kBF16, {tokens, heads, kDrope});
        for (int64_t th = 0; th < tokens * heads; ++th) {
          std::memcpy(q_abs_h.ptr<bf16_t>() + th * kDc, q.ptr<bf16_t>() + th * (kDc + kDrope),
                      kDc * sizeof(bf16_t));
          std::memcpy(q_pe_h.ptr<bf16_t>() + th * kDrope,
                      q.ptr<bf16_t>() + th * (kDc + kDrope) + kDc, kDrope * sizeof(bf16_t));
        }
        const reference::Attention ref =
            sparse_reference(q_abs_h, q_pe_h, pool.kv, indices, k, nullptr, sm_scale);

        const Tensor q_d = b.to_device(q);
        const auto columns = [&](int64_t begin, int64_t width) {
          TensorView v = q_d.view();
          v.shape[2] = width;
          v.data = static_cast<bf16_t*>(v.data) + begin;
          return v;
        };
        const Tensor idx_d = b.to_device(host_i32_2d(indices, tokens, k));
        const Tensor o_lat = poisoned(b, DType::kBF16, {tokens, heads, kDc});
        const Tensor lse = poisoned(b, DType::kF32, {tokens, heads});
        const Tensor max_logits = poisoned(b, DType::kF32, {tokens, heads});
        SparseMlaArgs a;
        a.q_abs = columns(0, kDc);
        a.q_pe = columns(kDc, kDrope);
        a.kv = &pool.pool;
        a.indices = idx_d;
        a.sm_scale = sm_scale;
        a.o_lat = o_lat;
        a.lse = lse;
        a.max_logits = max_logits;
        b.sparse_mla(a);
        const SparseOutputs out{read(b, o_lat), read(b, lse)};
        expect_rel_l2(out.o_lat, ref.o, tolerance(DType::kBF16), "o_lat");
        expect_lse(out.lse, ref.lse, "lse");
        expect_empty_token(out, 1, heads);
        const Vec got_max = read(b, max_logits);
        for (size_t i = 0; i < got_max.size(); ++i) {
          if (std::isinf(ref.max_logit[i])) {
            ASSERT_EQ(got_max[i], ref.max_logit[i]) << "max_logits[" << i << "]";
          } else {
            ASSERT_NEAR(got_max[i], ref.max_logit[i], 1e-3 * (1 + std::abs(ref.max_logit[i])))
                << "max_logits[" << i << "]";
          }
        }
      }
  });
}

TEST(SparseMla, NanStaysInItsTokenAndRunsAreDeterministic) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t tokens = 5, heads = 16;
  const int k = 32;
  for_each_backend([&](Backend& b) {
    KvPoolDesc desc;
    desc.layout = KvLayout::kFp8Scaled;
    desc.num_pages = 2;
    const FilledPool pool = make_filled_pool(b, rng, desc);
    // Every token selects the same locations, so they share pool rows and workspace shapes.
    std::vector<int32_t> indices(size_t(tokens * k));
    for (int j = 0; j < k; ++j) indices[size_t(j)] = int32_t(rng.randint(0, 127));
    for (int64_t t = 1; t < tokens; ++t) std::copy_n(indices.begin(), k, indices.begin() + t * k);
    const Tensor q_abs = testing::random_tensor(rng, DType::kF32, {tokens, heads, kDc});
    const Tensor q_pe = testing::random_tensor(rng, DType::kF32, {tokens, heads, kDrope});
    const SparseOutputs clean =
        run_sparse(b, pool.pool, q_abs, q_pe, indices, k, nullptr, 0.05, DType::kF32);
    const SparseOutputs again =
        run_sparse(b, pool.pool, q_abs, q_pe, indices, k, nullptr, 0.05, DType::kF32);
    EXPECT_EQ(std::memcmp(clean.o_lat.data(), again.o_lat.data(), clean.o_lat.size() * 8), 0);
    EXPECT_EQ(std::memcmp(clean.lse.data(), again.lse.data(), clean.lse.size() * 8), 0);

    const int64_t bad_token = 2, bad_head = 3;
    q_abs.ptr<float>()[(bad_token * heads + bad_head) * kDc + 7] =
        std::numeric_limits<float>::quiet_NaN();
    const SparseOutputs dirty =
        run_sparse(b, pool.pool, q_abs, q_pe, indices, k, nullptr, 0.05, DType::kF32);
    EXPECT_TRUE(std::isnan(dirty.lse[size_t(bad_token * heads + bad_head)]));
    EXPECT_TRUE(std::isnan(dirty.o_lat[size_t((bad_token * heads + bad_head) * kDc)]));
    for (int64_t t = 0; t < tokens; ++t) {
      if (t == bad_token) continue;
      EXPECT_TRUE(rows_bitwise_equal(dirty.o_lat, clean.o_lat, t, heads * kDc)) << "token " << t;
      EXPECT_TRUE(rows_bitwise_equal(dirty.lse, clean.lse, t, heads)) << "token " << t;
    }
  });
}

TEST(SparseMla, QueriesWithoutValidSlotsGiveZeroAndInfinity) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t heads = 16;
  const int k = 8;
  for_each_backend([&](Backend& b) {
    KvPoolDesc desc;
    desc.page_size = 1;
    desc.num_pages = 20;
    const FilledPool pool = make_filled_pool(b, rng, desc);
    const int32_t big = std::numeric_limits<int32_t>::max();
    const int32_t small = std::numeric_limits<int32_t>::min();
    // token 0: every slot invalid; token 1: valid slots cut to 0 by topk_length;
    // token 2: one valid slot listed three times, among invalid ones.
    const std::vector<int32_t> indices = {-1, 20, 21, big, small, -7, 1000, -1,  //
                                          3,  4,  5,  6,   7,     8,  9,    10,  //
                                          -1, 5,  20, 5,   -3,    5,  big,  -1};
    const std::vector<int32_t> topk_length = {8, 0, 8};
    const Tensor q_abs = testing::random_tensor(rng, DType::kF32, {3, heads, kDc});
    const Tensor q_pe = testing::random_tensor(rng, DType::kF32, {3, heads, kDrope});
    const SparseOutputs out =
        run_sparse(b, pool.pool, q_abs, q_pe, indices, k, &topk_length, 0.07, DType::kF32);
    expect_empty_token(out, 0, heads);
    expect_empty_token(out, 1, heads);
    // Three slots of one row: softmax weights 1/3 each, so o_lat is that row's c_kv exactly (to
    // fp32) and lse = s + log 3.
    const reference::Attention ref =
        sparse_reference(q_abs, q_pe, pool.kv, indices, k, &topk_length, 0.07);
    expect_rel_l2(out.o_lat, ref.o, testing::kTolF32, "sparse_mla repeated slot");
    expect_lse(out.lse, ref.lse, "sparse_mla repeated slot");
    for (int64_t i = 0; i < kDc; ++i)
      EXPECT_NEAR(out.o_lat[size_t(2 * heads * kDc + i)], pool.kv[size_t(5 * (kDc + kDrope) + i)],
                  1e-5 * (1 + std::fabs(pool.kv[size_t(5 * (kDc + kDrope) + i)])));
  });
}

// ---- dense MHA ----------------------------------------------------------------------------------

// A batch of requests for dense_mha: per request prefix P_r and extend E_r; kv rows [N] are the
// requests' positions 0 … L_r - 1 in batch order.
struct DenseBatch {
  std::vector<int32_t> cu_q{0}, cu_kv{0};
  explicit DenseBatch(const std::vector<std::pair<int32_t, int32_t>>& prefix_extend) {
    for (const auto& [p, e] : prefix_extend) {
      cu_q.push_back(cu_q.back() + e);
      cu_kv.push_back(cu_kv.back() + p + e);
    }
  }
  int64_t tokens() const { return cu_q.back(); }
  int64_t rows() const { return cu_kv.back(); }
  int requests() const { return int(cu_q.size()) - 1; }
};

struct DenseInputs {
  Tensor q_nope, q_pe, k_nope, k_pe, v;  // host
};

DenseInputs random_dense_inputs(Rng& rng, const HeadDims& d, const DenseBatch& batch, DType dt) {
  return {testing::random_tensor(rng, dt, {batch.tokens(), d.heads, d.d_nope}),
          testing::random_tensor(rng, dt, {batch.tokens(), d.heads, kDrope}),
          testing::random_tensor(rng, dt, {batch.rows(), d.heads, d.d_nope}),
          testing::random_tensor(rng, dt, {batch.rows(), kDrope}),
          testing::random_tensor(rng, dt, {batch.rows(), d.heads, d.d_v})};
}

struct DenseOutputs {
  Vec o, lse;
};

DenseOutputs run_dense(Backend& b, const DenseBatch& batch, const DenseInputs& in, int d_v,
                       double sm_scale, DType out, const std::vector<int32_t>* kv_visible = nullptr,
                       const Tensor* kv_mask = nullptr) {
  const int64_t heads = in.q_nope.size(1);
  const Tensor q_nope = b.to_device(in.q_nope), q_pe = b.to_device(in.q_pe);
  const Tensor k_nope = b.to_device(in.k_nope), k_pe = b.to_device(in.k_pe);
  const Tensor v = b.to_device(in.v);
  const Tensor cu_q = b.to_device(host_i32(batch.cu_q)), cu_kv = b.to_device(host_i32(batch.cu_kv));
  Tensor visible;
  const Tensor o = poisoned(b, out, {batch.tokens(), heads, d_v});
  const Tensor lse = poisoned(b, DType::kF32, {batch.tokens(), heads});
  DenseMhaArgs a;
  a.q_nope = q_nope;
  a.q_pe = q_pe;
  a.k_nope = k_nope;
  a.k_pe = k_pe;
  a.v = v;
  a.cu_q = cu_q;
  a.cu_kv = cu_kv;
  a.cu_q_host = batch.cu_q.data();
  a.cu_kv_host = batch.cu_kv.data();
  if (kv_visible) {
    visible = b.to_device(host_i32(*kv_visible));
    a.kv_visible = visible;
    a.kv_visible_host = kv_visible->data();
  }
  Tensor mask;
  if (kv_mask) {
    mask = b.to_device(*kv_mask);
    a.kv_mask = mask;
  }
  a.num_requests = batch.requests();
  a.sm_scale = sm_scale;
  a.o = o;
  a.lse = lse;
  b.dense_mha(a);
  return {read(b, o), read(b, lse)};
}

reference::Attention dense_reference(const DenseBatch& batch, const DenseInputs& in,
                                     const HeadDims& d, double sm_scale) {
  const Vec q =
      concat_rows(reference::to_vec(in.q_nope), d.d_nope, reference::to_vec(in.q_pe), kDrope);
  const Vec k = per_head_keys(reference::to_vec(in.k_nope), reference::to_vec(in.k_pe),
                              batch.rows(), d.heads, d.d_nope);
  return reference::dense_attention(q, k, reference::to_vec(in.v), d.heads, d.d_nope + kDrope,
                                    d.d_v, batch.cu_q, batch.cu_kv, sm_scale);
}

class DenseMhaTest : public ::testing::TestWithParam<HeadDims> {};

TEST_P(DenseMhaTest, MatchesReferenceWithPrefixes) {
  const HeadDims d = GetParam();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  // A fresh prompt, a chunk after a prefix, a decode-like single token and an empty request.
  const DenseBatch batch({{0, 6}, {9, 4}, {21, 1}, {3, 0}});
  const double sm_scale = default_sm_scale(d);
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(to_string(dt));
    const DenseInputs in = random_dense_inputs(rng, d, batch, dt);
    const reference::Attention ref = dense_reference(batch, in, d, sm_scale);
    for_each_backend([&](Backend& b) {
      const DenseOutputs out = run_dense(b, batch, in, d.d_v, sm_scale, dt);
      expect_rel_l2(out.o, ref.o, tolerance(dt), std::string("dense_mha ") + to_string(dt));
      expect_lse(out.lse, ref.lse, std::string("dense_mha ") + to_string(dt));
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DenseMhaTest, ::testing::ValuesIn(kAllDims),
                         [](const auto& info) { return std::string(info.param.name); });

// Spans several query and kv tiles, with tile edges falling inside requests.
TEST(DenseMha, ModerateBatchAcrossTiles) {
  const HeadDims d = kAllDims[1];
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const DenseBatch batch({{300, 150}, {0, 70}, {517, 3}});
  const DenseInputs in = random_dense_inputs(rng, d, batch, DType::kF32);
  const reference::Attention ref = dense_reference(batch, in, d, default_sm_scale(d));
  for_each_backend([&](Backend& b) {
    const DenseOutputs out = run_dense(b, batch, in, d.d_v, default_sm_scale(d), DType::kF32);
    expect_rel_l2(out.o, ref.o, testing::kTolF32, "dense_mha moderate");
    expect_lse(out.lse, ref.lse, "dense_mha moderate");
  });
}

// kv_visible replaces the causal count: each query is checked against a one-query request over
// exactly its visible rows; a query that sees nothing gets o = 0, lse = +inf.
TEST(DenseMha, ExplicitVisibleCounts) {
  const HeadDims d = kAllDims[3];
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const DenseBatch batch({{40, 5}, {0, 70}});
  std::vector<int32_t> visible = {0, 3, 3, 30, 45};
  for (int i = 0; i < 70; ++i) visible.push_back(std::min(70, 1 + i * 3 / 2));
  const DenseInputs in = random_dense_inputs(rng, d, batch, DType::kF32);
  // Reference: query t alone, over copies of its request's first visible[t] rows.
  const int64_t d_qk = d.d_nope + kDrope;
  const Vec q =
      concat_rows(reference::to_vec(in.q_nope), d.d_nope, reference::to_vec(in.q_pe), kDrope);
  const Vec k = per_head_keys(reference::to_vec(in.k_nope), reference::to_vec(in.k_pe),
                              batch.rows(), d.heads, d.d_nope);
  const Vec v = reference::to_vec(in.v);
  Vec ref_o, ref_lse;
  for (int r = 0; r < batch.requests(); ++r)
    for (int32_t t = batch.cu_q[r]; t < batch.cu_q[r + 1]; ++t) {
      const int64_t n = visible[size_t(t)];
      if (n == 0) {
        ref_o.insert(ref_o.end(), size_t(d.heads * d.d_v), 0.0);
        ref_lse.insert(ref_lse.end(), size_t(d.heads), kInf);
        continue;
      }
      const int64_t kv0 = batch.cu_kv[r] * d.heads;
      const Vec q_t(q.begin() + t * d.heads * d_qk, q.begin() + (t + 1) * d.heads * d_qk);
      const Vec k_t(k.begin() + kv0 * d_qk, k.begin() + (kv0 + n * d.heads) * d_qk);
      const Vec v_t(v.begin() + kv0 * d.d_v, v.begin() + (kv0 + n * d.heads) * d.d_v);
      const reference::Attention one = reference::dense_attention(
          q_t, k_t, v_t, d.heads, int(d_qk), d.d_v, {0, 1}, {0, int32_t(n)}, 0.09);
      ref_o.insert(ref_o.end(), one.o.begin(), one.o.end());
      ref_lse.insert(ref_lse.end(), one.lse.begin(), one.lse.end());
    }
  for_each_backend([&](Backend& b) {
    const DenseOutputs out = run_dense(b, batch, in, d.d_v, 0.09, DType::kF32, &visible);
    expect_rel_l2(out.o, ref_o, testing::kTolF32, "dense_mha kv_visible");
    expect_lse(out.lse, ref_lse, "dense_mha kv_visible");
    for (int64_t i = 0; i < d.heads * d.d_v; ++i) ASSERT_EQ(out.o[size_t(i)], 0.0);
  });
}

// NaN in one query stays in that query; NaN in the newest kv row reaches only the queries that
// see it (the last one), even inside a tile where earlier queries mask it out.
TEST(DenseMha, NanStaysWhereItIsVisible) {
  const HeadDims d = kAllDims[1];
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const DenseBatch batch({{10, 12}, {0, 9}});
  const int64_t width = d.heads * d.d_v;
  for_each_backend([&](Backend& b) {
    DenseInputs in = random_dense_inputs(rng, d, batch, DType::kF32);
    const DenseOutputs clean = run_dense(b, batch, in, d.d_v, 0.08, DType::kF32);
    const int64_t nan_query = 4, last_row = batch.cu_kv[1] - 1, last_query = batch.cu_q[1] - 1;
    const float nan = std::numeric_limits<float>::quiet_NaN();
    in.q_nope.ptr<float>()[nan_query * d.heads * d.d_nope] = nan;            // head 0
    in.v.ptr<float>()[last_row * width + 5] = nan;                           // head 0
    in.k_nope.ptr<float>()[last_row * d.heads * d.d_nope + d.d_nope] = nan;  // head 1
    const DenseOutputs dirty = run_dense(b, batch, in, d.d_v, 0.08, DType::kF32);
    for (int64_t t = 0; t < batch.tokens(); ++t) {
      if (t == nan_query || t == last_query) continue;
      EXPECT_TRUE(rows_bitwise_equal(dirty.o, clean.o, t, width)) << "token " << t;
      EXPECT_TRUE(rows_bitwise_equal(dirty.lse, clean.lse, t, d.heads)) << "token " << t;
    }
    EXPECT_TRUE(std::isnan(dirty.lse[size_t(nan_query * d.heads)]));  // q NaN: head 0
    EXPECT_TRUE(std::isnan(dirty.o[size_t(nan_query * width)]));
    EXPECT_TRUE(std::isnan(dirty.o[size_t(last_query * width + 5)]));      // v NaN: head 0, dim 5
    EXPECT_TRUE(std::isnan(dirty.lse[size_t(last_query * d.heads + 1)]));  // k NaN: head 1
  });
}

// kv_mask: a kv row masked out of every query never reaches an output (NaN in its k and v changes
// no bit), a query whose mask keeps nothing gets o = 0 and lse = +inf, and a mask too narrow
// for the longest request is refused naming kv_mask.
TEST(DenseMha, MaskedRowsNeverEnter) {
  const HeadDims d = kAllDims[1];
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const DenseBatch batch({{30, 12}, {0, 9}});
  const int64_t width = d.heads * d.d_v, tokens = batch.tokens();
  Tensor mask = Tensor::host(DType::kI32, {tokens, 2});
  for (int64_t i = 0; i < mask.numel(); ++i) mask.ptr<int32_t>()[i] = int32_t(rng.gen()() | 1u);
  const int64_t poisoned_row = 20;  // request 0's position 20: bit 20 cleared for every query
  for (int64_t t = 0; t < batch.cu_q[1]; ++t) mask.ptr<int32_t>()[t * 2] &= ~(1 << 20);
  const int64_t empty_query = 3;  // keeps nothing
  mask.ptr<int32_t>()[empty_query * 2] = mask.ptr<int32_t>()[empty_query * 2 + 1] = 0;
  for_each_backend([&](Backend& b) {
    if (!b.capabilities().dense_kv_mask) return;  // refusal: PathEquivalenceTest
    DenseInputs in = random_dense_inputs(rng, d, batch, DType::kF32);
    const DenseOutputs clean = run_dense(b, batch, in, d.d_v, 0.08, DType::kF32, nullptr, &mask);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill_n(in.k_nope.ptr<float>() + poisoned_row * d.heads * d.d_nope, d.heads * d.d_nope,
                nan);
    std::fill_n(in.v.ptr<float>() + poisoned_row * width, width, nan);
    const DenseOutputs dirty = run_dense(b, batch, in, d.d_v, 0.08, DType::kF32, nullptr, &mask);
    for (int64_t t = 0; t < tokens; ++t) {
      EXPECT_TRUE(rows_bitwise_equal(dirty.o, clean.o, t, width)) << "token " << t;
      EXPECT_TRUE(rows_bitwise_equal(dirty.lse, clean.lse, t, d.heads)) << "token " << t;
    }
    for (int64_t i = 0; i < width; ++i) ASSERT_EQ(clean.o[size_t(empty_query * width + i)], 0.0);
    for (int64_t h = 0; h < d.heads; ++h)
      ASSERT_EQ(clean.lse[size_t(empty_query * d.heads + h)], kInf);
    const Tensor narrow = Tensor::host(DType::kI32, {tokens, 1});  // 32 < 42 rows
    expect_error_naming(
        [&] { run_dense(b, batch, in, d.d_v, 0.08, DType::kF32, nullptr, &narrow); }, "kv_mask");
  });
}

// topk_to_kv_mask: bit p of row t set exactly for the positions in row t (-1 padding and
// repeats included in the input); a position beyond the mask's words is refused, naming it, and
// the mask keeps its bytes.
TEST(DenseMha, TopkAsAKvMask) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t tokens = 7, k = 12, words = 3;
  std::vector<int32_t> positions(size_t(tokens * k));
  for (auto& p : positions) p = rng.randint(0, 9) == 0 ? -1 : int32_t(rng.randint(0, 95));
  positions[5] = positions[4];  // a repeat
  std::vector<uint32_t> want(size_t(tokens * words), 0u);
  for (int64_t i = 0; i < tokens * k; ++i)
    if (positions[size_t(i)] >= 0)
      want[size_t((i / k) * words + positions[size_t(i)] / 32)] |= 1u
                                                                   << (positions[size_t(i)] % 32);
  for_each_backend([&](Backend& b) {
    const Tensor mask = poisoned(b, DType::kI32, {tokens, words});
    b.topk_to_kv_mask(b.to_device(host_i32_2d(positions, tokens, k)), mask);
    const Tensor got = b.to_host(mask);
    for (int64_t i = 0; i < tokens * words; ++i)
      ASSERT_EQ(uint32_t(got.ptr<int32_t>()[i]), want[size_t(i)]) << "word " << i;
    std::vector<int32_t> far = positions;
    far[size_t(2 * k + 3)] = 96;  // 3 words cover positions < 96
    const Tensor kept = poisoned(b, DType::kI32, {tokens, words});
    const uint64_t before = testing::checksum(b.to_host(kept));
    expect_error_naming([&] { b.topk_to_kv_mask(b.to_device(host_i32_2d(far, tokens, k)), kept); },
                        "positions[2, 3]");
    EXPECT_EQ(testing::checksum(b.to_host(kept)), before);
  });
}

// ---- both paths agree when top-k keeps every position (docs/design.md#equivalence) ----------

class PathEquivalenceTest : public ::testing::TestWithParam<HeadDims> {};

// Sparse MLA (absorb -> sparse_mla over the selected locations -> up_proj_v) against dense MHA
// (up_proj_kv over all rows -> dense_mha) on the same latent rows: each token keeps `select`
// random positions of those it sees (all of them when it sees fewer). With `masked`, dense_mha
// takes the selection as kv_mask; without, every token must keep every position it sees.
void expect_sparse_equals_dense(const HeadDims& d, int select, bool masked) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", select " + std::to_string(select) +
               (masked ? ", masked" : ""));
  Rng rng(seed);
  const std::vector<std::pair<int32_t, int32_t>> requests = {{0, 7}, {12, 5}, {66, 2}};
  const DenseBatch batch(requests);
  const int64_t tokens = batch.tokens(), rows = batch.rows();
  const double sm_scale = default_sm_scale(d);
  const Tensor w = testing::random_tensor(rng, DType::kBF16,
                                          {int64_t(d.heads) * (d.d_nope + d.d_v), kDc}, 0.044f);
  const Tensor q_nope = testing::random_tensor(rng, DType::kBF16, {tokens, d.heads, d.d_nope});
  const Tensor q_pe = testing::random_tensor(rng, DType::kBF16, {tokens, d.heads, kDrope});
  const Tensor c_kv = testing::random_tensor(rng, DType::kBF16, {rows, kDc});  // batch order
  const Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {rows, kDrope});
  const int k = select;

  // Per token the positions it keeps, and that selection as mask bits [T, W] (W = 3: 96 rows).
  std::vector<std::vector<int32_t>> kept(static_cast<size_t>(tokens));
  Tensor mask = Tensor::host(DType::kI32, {tokens, 3});
  std::fill_n(mask.ptr<int32_t>(), mask.numel(), 0);
  for (int r = 0; r < batch.requests(); ++r)
    for (int32_t t = batch.cu_q[r]; t < batch.cu_q[r + 1]; ++t) {
      const int32_t visible = requests[size_t(r)].first + (t - batch.cu_q[r]) + 1;
      std::vector<int32_t> all(static_cast<size_t>(visible));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng.gen());
      all.resize(size_t(std::min(visible, select)));
      ASSERT_TRUE(masked || int32_t(all.size()) == visible) << "unmasked needs every position";
      for (int32_t p : all)
        reinterpret_cast<uint32_t*>(mask.ptr<int32_t>())[t * 3 + p / 32] |= 1u << (p % 32);
      kept[size_t(t)] = std::move(all);
    }

  for_each_backend([&](Backend& b) {
    for (const int page_size : {1, 64}) {
      SCOPED_TRACE("page " + std::to_string(page_size));
      // Pages handed out in reverse so locations are not positions.
      KvPoolDesc desc;
      desc.page_size = page_size;
      desc.num_pages = page_size == 1 ? rows + 3 : 4;
      PagedKvPool pool = b.make_kv_pool(desc);
      std::vector<int32_t> kv_locs;
      int32_t next_page = int32_t(desc.num_pages) - 1;
      for (const auto& [p, e] : requests) {
        std::vector<int32_t> table;
        for (int32_t pos = 0; pos < p + e; ++pos) {
          if (pos % page_size == 0) table.push_back(next_page--);
          kv_locs.push_back(int32_t(location_of(table, page_size, pos)));
        }
      }
      b.store_kv(pool, b.to_device(host_i32(kv_locs)), b.to_device(c_kv), b.to_device(k_pe));

      // Sparse: absorb -> sparse_mla over the kept locations (shuffled, -1 padded) -> up_proj_v.
      std::vector<int32_t> indices(size_t(tokens * k), -1);
      for (int r = 0; r < batch.requests(); ++r)
        for (int32_t t = batch.cu_q[r]; t < batch.cu_q[r + 1]; ++t) {
          auto slots = indices.begin() + int64_t(t) * k;
          for (size_t i = 0; i < kept[size_t(t)].size(); ++i)
            slots[int64_t(i)] = kv_locs[size_t(batch.cu_kv[r] + kept[size_t(t)][i])];
          std::shuffle(slots, slots + k, rng.gen());
        }
      const Tensor w_dev = b.to_device(w);
      const Tensor q_abs = poisoned(b, DType::kF32, {tokens, d.heads, kDc});
      b.absorb_q(b.to_device(q_nope), w_dev, d.d_v, q_abs);
      const SparseOutputs lat =
          run_sparse(b, pool, b.to_host(q_abs), q_pe, indices, k, nullptr, sm_scale, DType::kF32);
      Tensor o_lat = Tensor::host(DType::kF32, {tokens, d.heads, kDc});
      std::copy(lat.o_lat.begin(), lat.o_lat.end(), o_lat.ptr<float>());
      const Tensor o_sparse = poisoned(b, DType::kF32, {tokens, d.heads, d.d_v});
      b.up_proj_v(b.to_device(o_lat), w_dev, d.d_nope, o_sparse);

      // Dense: up_proj_kv over all rows -> dense_mha (with the selection as its mask).
      const Tensor k_nope = poisoned(b, DType::kF32, {rows, d.heads, d.d_nope});
      const Tensor v = poisoned(b, DType::kF32, {rows, d.heads, d.d_v});
      b.up_proj_kv(b.to_device(c_kv), w_dev, k_nope, v);
      const DenseInputs in{q_nope, q_pe, b.to_host(k_nope), k_pe, b.to_host(v)};
      if (masked && !b.capabilities().dense_kv_mask) {
        expect_error_naming(
            [&] { run_dense(b, batch, in, d.d_v, sm_scale, DType::kF32, nullptr, &mask); },
            "kv_mask", ErrorKind::kUnsupported);
        continue;
      }
      const DenseOutputs dense =
          run_dense(b, batch, in, d.d_v, sm_scale, DType::kF32, nullptr, masked ? &mask : nullptr);
      expect_rel_l2(read(b, o_sparse), dense.o, testing::kTolF32, "sparse vs dense o");
      expect_lse(lat.lse, dense.lse, "sparse vs dense lse");
    }
  });
}

TEST_P(PathEquivalenceTest, SparseOverAllPositionsEqualsDense) {
  expect_sparse_equals_dense(GetParam(), /*select=*/80, /*masked=*/false);  // 80 >= every L_r
  expect_sparse_equals_dense(GetParam(), /*select=*/80, /*masked=*/true);   // a mask of all bits
}

// The sparse path's function as dense MHA: a top-k of 9 positions per token as kv_mask.
TEST_P(PathEquivalenceTest, SparseOverSelectedPositionsEqualsMaskedDense) {
  expect_sparse_equals_dense(GetParam(), /*select=*/9, /*masked=*/true);
}

INSTANTIATE_TEST_SUITE_P(Models, PathEquivalenceTest, ::testing::ValuesIn(kAllDims),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- merge_partials -------------------------------------------------------------------------

// Attention over a key set split W ways, merged by lse, equals attention over the whole set.
TEST(MergePartials, SplitKeySetMergesToTheUnsplitResult) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t tokens = 5, heads = 16;
  const int k = 40;
  for_each_backend([&](Backend& b) {
    KvPoolDesc desc;
    desc.num_pages = 2;
    const FilledPool pool = make_filled_pool(b, rng, desc);
    const Tensor q_abs = testing::random_tensor(rng, DType::kF32, {tokens, heads, kDc});
    const Tensor q_pe = testing::random_tensor(rng, DType::kF32, {tokens, heads, kDrope});
    std::vector<int32_t> indices = random_indices(rng, tokens, k, desc.num_locations());
    std::fill_n(indices.begin() + 4 * k, k, -1);  // token 4: empty in every part
    const SparseOutputs whole =
        run_sparse(b, pool.pool, q_abs, q_pe, indices, k, nullptr, 0.06, DType::kF32);
    for (const int parts : {2, 3}) {
      SCOPED_TRACE(std::to_string(parts) + " parts");
      // Slot j of token t goes to one part; token 0 puts all its slots in part 0.
      std::vector<std::vector<int32_t>> part_indices(size_t(parts),
                                                     std::vector<int32_t>(indices.size(), -1));
      for (size_t i = 0; i < indices.size(); ++i) {
        const int64_t owner = i < size_t(k) ? 0 : rng.randint(0, parts - 1);
        part_indices[size_t(owner)][i] = indices[i];
      }
      Tensor o_parts = Tensor::host(DType::kF32, {parts, tokens, heads, kDc});
      Tensor lse_parts = Tensor::host(DType::kF32, {parts, tokens, heads});
      for (int w = 0; w < parts; ++w) {
        const SparseOutputs part = run_sparse(b, pool.pool, q_abs, q_pe, part_indices[size_t(w)], k,
                                              nullptr, 0.06, DType::kF32);
        std::copy(part.o_lat.begin(), part.o_lat.end(),
                  o_parts.ptr<float>() + w * tokens * heads * kDc);
        std::copy(part.lse.begin(), part.lse.end(), lse_parts.ptr<float>() + w * tokens * heads);
      }
      for (const DType dt : {DType::kF32, DType::kBF16}) {
        const Tensor o = poisoned(b, dt, {tokens, heads, kDc});
        const Tensor lse = poisoned(b, DType::kF32, {tokens, heads});
        b.merge_partials(b.to_device(o_parts), b.to_device(lse_parts), o, lse);
        const SparseOutputs merged{read(b, o), read(b, lse)};
        expect_rel_l2(merged.o_lat, whole.o_lat, tolerance(dt),
                      "merge " + std::to_string(parts) + " parts " + to_string(dt));
        expect_lse(merged.lse, whole.lse, "merge lse");
        expect_empty_token(merged, 4, heads);
      }
    }
  });
}

// ---- bad input --------------------------------------------------------------------------------

TEST(AttentionBadInput, ErrorsNameTheArgumentAndWriteNothing) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const HeadDims d = kAllDims[3];
  const int64_t tokens = 3;
  const int k = 8;
  for_each_backend([&](Backend& b) {
    KvPoolDesc desc;
    desc.layout = KvLayout::kFp8Scaled;
    desc.num_pages = 1;
    const FilledPool pool = make_filled_pool(b, rng, desc);
    const uint64_t pool_sum = testing::checksum(b.to_host(pool.pool.storage()));

    const auto dev = [&](DType dt, std::vector<int64_t> shape) {
      return b.to_device(testing::random_tensor(rng, dt, shape));
    };
    const Tensor q_abs = dev(DType::kF32, {tokens, d.heads, kDc});
    const Tensor q_pe = dev(DType::kF32, {tokens, d.heads, kDrope});
    const Tensor indices = b.to_device(host_i32_2d(std::vector<int32_t>(tokens * k, 1), tokens, k));
    const Tensor o_lat = poisoned(b, DType::kF32, {tokens, d.heads, kDc});
    const Tensor lse = poisoned(b, DType::kF32, {tokens, d.heads});
    const uint64_t o_sum = testing::checksum(b.to_host(o_lat));
    SparseMlaArgs good;
    good.q_abs = q_abs;
    good.q_pe = q_pe;
    good.kv = &pool.pool;
    good.indices = indices;
    good.sm_scale = 0.1;
    good.o_lat = o_lat;
    good.lse = lse;
    const auto sparse_with = [&](const std::function<void(SparseMlaArgs&)>& edit) {
      return [&, edit] {
        SparseMlaArgs a = good;
        edit(a);
        b.sparse_mla(a);
      };
    };
    const Tensor wrong_pe = dev(DType::kF32, {tokens, d.heads, kDrope + 1});
    const Tensor f32_indices = dev(DType::kF32, {tokens, k});
    const Tensor short_lengths = b.to_device(host_i32({1, 2}));
    const Tensor bf16_lse = poisoned(b, DType::kBF16, {tokens, d.heads});
    const Tensor short_o = poisoned(b, DType::kF32, {tokens, d.heads, kDc - 1});
    expect_error_naming(sparse_with([&](SparseMlaArgs& a) { a.q_pe = wrong_pe; }), "q_pe");
    expect_error_naming(sparse_with([&](SparseMlaArgs& a) { a.indices = f32_indices; }), "indices");
    expect_error_naming(sparse_with([&](SparseMlaArgs& a) { a.topk_length = short_lengths; }),
                        "topk_length");
    expect_error_naming(sparse_with([&](SparseMlaArgs& a) { a.lse = bf16_lse; }), "lse");
    expect_error_naming(sparse_with([&](SparseMlaArgs& a) { a.o_lat = short_o; }), "o_lat");
    expect_error_naming(sparse_with([&](SparseMlaArgs& a) { a.sm_scale = 0; }), "sm_scale");
    EXPECT_EQ(testing::checksum(b.to_host(pool.pool.storage())), pool_sum);
    EXPECT_EQ(testing::checksum(b.to_host(o_lat)), o_sum);

    // dense_mha
    const DenseBatch batch({{2, 3}});
    const DenseInputs in = random_dense_inputs(rng, d, batch, DType::kF32);
    const Tensor dq_nope = b.to_device(in.q_nope), dq_pe = b.to_device(in.q_pe);
    const Tensor dk_nope = b.to_device(in.k_nope), dk_pe = b.to_device(in.k_pe);
    const Tensor dv = b.to_device(in.v);
    const Tensor cu_q = b.to_device(host_i32(batch.cu_q)),
                 cu_kv = b.to_device(host_i32(batch.cu_kv));
    const Tensor o = poisoned(b, DType::kF32, {tokens, d.heads, d.d_v});
    const Tensor dense_lse = poisoned(b, DType::kF32, {tokens, d.heads});
    const uint64_t dense_o_sum = testing::checksum(b.to_host(o));
    DenseMhaArgs dense;
    dense.q_nope = dq_nope;
    dense.q_pe = dq_pe;
    dense.k_nope = dk_nope;
    dense.k_pe = dk_pe;
    dense.v = dv;
    dense.cu_q = cu_q;
    dense.cu_kv = cu_kv;
    dense.cu_q_host = batch.cu_q.data();
    dense.cu_kv_host = batch.cu_kv.data();
    dense.num_requests = 1;
    dense.sm_scale = 0.1;
    dense.o = o;
    dense.lse = dense_lse;
    const auto dense_with = [&](const std::function<void(DenseMhaArgs&)>& edit) {
      return [&, edit] {
        DenseMhaArgs a = dense;
        edit(a);
        b.dense_mha(a);
      };
    };
    const std::vector<int32_t> bad_cu_q = {0, 2};
    const Tensor v_wrong_heads = dev(DType::kF32, {batch.rows(), d.heads - 1, d.d_v});
    expect_error_naming(dense_with([&](DenseMhaArgs& a) { a.cu_q_host = bad_cu_q.data(); }),
                        "cu_q");
    expect_error_naming(dense_with([&](DenseMhaArgs& a) { a.v = v_wrong_heads; }), "v:");
    expect_error_naming(dense_with([&](DenseMhaArgs& a) { a.num_requests = 0; }), "num_requests");
    EXPECT_EQ(testing::checksum(b.to_host(o)), dense_o_sum);

    // projections and merge
    const Tensor w = dev(DType::kBF16, {int64_t(d.heads) * (d.d_nope + d.d_v), kDc});
    const Tensor w_short = dev(DType::kBF16, {int64_t(d.heads) * (d.d_nope + d.d_v) - 1, kDc});
    const Tensor q_abs_wide = poisoned(b, DType::kF32, {tokens, d.heads, kDc + 1});
    expect_error_naming([&] { b.absorb_q(dq_nope, w_short, d.d_v, q_abs); }, "kv_b_proj");
    expect_error_naming([&] { b.absorb_q(dq_nope, w, d.d_v, dv); }, "q_abs");
    const Tensor c_kv = dev(DType::kF32, {5, kDc});
    const Tensor v_short = poisoned(b, DType::kF32, {4, d.heads, d.d_v});
    expect_error_naming([&] { b.up_proj_kv(c_kv, w, dk_nope, v_short); }, "v:");
    const Tensor o_parts = dev(DType::kF32, {2, tokens, d.heads, kDc});
    const Tensor lse_parts_short = dev(DType::kF32, {1, tokens, d.heads});
    const Tensor f64_parts = dev(DType::kF64, {2, tokens, d.heads, kDc});
    const Tensor lse_parts = dev(DType::kF32, {2, tokens, d.heads});
    expect_error_naming([&] { b.merge_partials(o_parts, lse_parts_short, o_lat, lse); },
                        "lse_parts");
    expect_error_naming([&] { b.merge_partials(f64_parts, lse_parts, o_lat, lse); }, "o_parts");
    EXPECT_EQ(testing::checksum(b.to_host(o_lat)), o_sum);
  });
}

TEST(AttentionEmptyBatch, ZeroTokensIsANoOp) {
  for_each_backend([&](Backend& b) {
    const HeadDims d = kAllDims[1];
    KvPoolDesc desc;
    desc.num_pages = 1;
    const PagedKvPool pool = b.make_kv_pool(desc);
    const Tensor empty_q = b.empty(DType::kF32, {0, d.heads, kDc});
    const Tensor empty_pe = b.empty(DType::kF32, {0, d.heads, kDrope});
    const Tensor empty_idx = b.empty(DType::kI32, {0, 4});
    const Tensor empty_lse = b.empty(DType::kF32, {0, d.heads});
    SparseMlaArgs a;
    a.q_abs = empty_q;
    a.q_pe = empty_pe;
    a.kv = &pool;
    a.indices = empty_idx;
    a.sm_scale = 0.1;
    a.o_lat = empty_q;
    a.lse = empty_lse;
    EXPECT_NO_THROW(b.sparse_mla(a));
    Rng rng(testing::fresh_seed());
    const Tensor w =
        b.to_device(testing::random_tensor(rng, DType::kBF16, {d.heads * (d.d_nope + d.d_v), kDc}));
    const Tensor empty_nope = b.empty(DType::kF32, {0, d.heads, d.d_nope});
    EXPECT_NO_THROW(b.absorb_q(empty_nope, w, d.d_v, empty_q));
  });
}

}  // namespace
}  // namespace dsakit
