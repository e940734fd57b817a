// Lightning indexer and top-k (docs/design.md#lightning-indexer, #top-k) through the Backend
// interface, for every backend of testing::test_backends(), against the float64 reference
// (src/reference).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/error.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::kSentinelByte;
using testing::poisoned;
using testing::Rng;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr const char* kWorkspaceEnv = "DSAKIT_INDEXER_WORKSPACE_BYTES";

struct IndexerDims {
  std::string preset;
  int h_i;
  int d_i;
};

std::vector<IndexerDims> preset_dims() {
  std::vector<IndexerDims> dims;
  for (const char* name : {"deepseek-v3.2", "glm-5"}) {
    const ModelConfig c = ModelConfig::preset(name);
    dims.push_back({name, c.index_n_heads, c.index_head_dim});
  }
  return dims;
}

Tensor host_i32(const std::vector<int32_t>& v) {
  Tensor t = Tensor::host(DType::kI32, {int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<int32_t>());
  return t;
}

std::vector<int32_t> i32_values(Backend& be, const TensorView& t) {
  const Tensor h = be.to_host(t);
  return std::vector<int32_t>(h.ptr<const int32_t>(), h.ptr<const int32_t>() + h.numel());
}

// bf16 tensor whose innermost vectors have random magnitudes 10^U(-5, 1) (so per-vector FP8
// scales differ, down to the 1e-4 amax floor).
Tensor random_vectors_bf16(Rng& rng, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::host(DType::kBF16, shape);
  const int64_t cols = shape.back(), rows = t.numel() / cols;
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = std::pow(10.0f, rng.uniform(-5.f, 1.f));
    for (int64_t c = 0; c < cols; ++c)
      t.ptr<bf16_t>()[r * cols + c] = f32_to_bf16(rng.normal(scale));
  }
  return t;
}

// A batch of requests with cached prefixes and shuffled page tables; every position's indexer
// key is stored in an index-key pool on the backend.
struct Scene {
  int h_i = 0, d_i = 0;
  Batch batch;
  BatchIndex index;
  IndexKeyPool pool;
  Tensor idx_q;                       // host bf16 [T, H_i, d_i]
  Tensor idx_w;                       // host f32 [T, H_i]
  Tensor kv_locs, kv_start, ctx_len;  // device i32

  int64_t num_tokens() const { return int64_t(index.token_ctx_len.size()); }
  int32_t max_ctx() const {
    return *std::max_element(index.token_ctx_len.begin(), index.token_ctx_len.end());
  }
  IndexerArgs layout() const {
    IndexerArgs a;
    a.keys = &pool;
    a.kv_locs = kv_locs.view();
    a.kv_start = kv_start.view();
    a.ctx_len = ctx_len.view();
    return a;
  }
};

// requests: {P_r, E_r} per request.
Scene make_scene(Backend& be, Rng& rng, int h_i, int d_i, int page_size,
                 const std::vector<std::pair<int, int>>& requests) {
  Scene s;
  s.h_i = h_i;
  s.d_i = d_i;
  auto pages_of = [page_size](int len) { return (len + page_size - 1) / page_size; };
  int64_t num_pages = 3;  // a few pages no request uses
  for (const auto& [p, e] : requests) num_pages += pages_of(p + e);
  std::vector<int32_t> ids(static_cast<size_t>(num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng.gen());
  auto next = ids.begin();
  for (const auto& [p, e] : requests) {
    s.batch.prefix_lens.push_back(p);
    s.batch.extend_lens.push_back(e);
    s.batch.page_tables.emplace_back(next, next + pages_of(p + e));
    next += pages_of(p + e);
  }
  s.batch.validate(page_size, num_pages);
  s.index = BatchIndex::build(s.batch, page_size);
  s.pool = be.make_index_pool({page_size, num_pages, d_i});

  // Keys of every position (cached prefix and new tokens) go through the pool's writer.
  const int64_t n_kv = int64_t(s.index.kv_locs.size());
  const Tensor idx_k = random_vectors_bf16(rng, {n_kv, d_i});
  be.store_index_keys(s.pool, be.to_device(host_i32(s.index.kv_locs)), be.to_device(idx_k));

  const int64_t t = s.num_tokens();
  s.idx_q = random_vectors_bf16(rng, {t, h_i, d_i});
  s.idx_w = testing::random_tensor(rng, DType::kF32, {t, h_i});
  s.kv_locs = be.to_device(host_i32(s.index.kv_locs));
  s.kv_start = be.to_device(host_i32(s.index.token_kv_start));
  s.ctx_len = be.to_device(host_i32(s.index.token_ctx_len));
  return s;
}

// The scene's indexer arguments with q8 and gate from the backend's indexer_quantize_q
// (outputs poisoned first).
struct QuantizedArgs {
  Tensor q8, gate;
  IndexerArgs args;
};

QuantizedArgs quantize_on_backend(Backend& be, const Scene& s) {
  const int64_t t = s.num_tokens();
  QuantizedArgs q{poisoned(be, DType::kU8, {t, s.h_i, s.d_i}),
                  poisoned(be, DType::kF32, {t, s.h_i}), s.layout()};
  be.indexer_quantize_q(be.to_device(s.idx_q), be.to_device(s.idx_w), q.q8, q.gate);
  q.args.q8 = q.q8.view();
  q.args.gate = q.gate.view();
  return q;
}

// The float64 reference inputs of a scene: quantized queries and gates from idx_q / idx_w, and
// the keys as the pool holds them.
struct ReferenceInputs {
  reference::Vec q;        // [T, H_i, d_i] e4m3 values
  reference::Vec gate;     // [T, H_i]
  reference::Vec k;        // [num_locations, d_i] e4m3 values
  reference::Vec k_scale;  // [num_locations]
};

ReferenceInputs reference_inputs(Backend& be, const Scene& s) {
  ReferenceInputs r;
  const int64_t t = s.num_tokens(), h = s.h_i, d = s.d_i;
  const reference::Vec x = reference::to_vec(s.idx_q.view());
  const reference::Vec w = reference::to_vec(s.idx_w.view());
  std::vector<uint8_t> codes(static_cast<size_t>(d));
  r.q.resize(size_t(t * h * d));
  r.gate.resize(size_t(t * h));
  for (int64_t i = 0; i < t * h; ++i) {
    double scale = 0;
    reference::indexer_quantize(x.data() + i * d, int(d), codes.data(), &scale);
    for (int64_t c = 0; c < d; ++c)
      r.q[size_t(i * d + c)] = reference::e4m3_value(codes[size_t(c)]);
    r.gate[size_t(i)] = w[size_t(i)] * scale / std::sqrt(double(h * d));
  }
  const Tensor bytes = be.to_host(s.pool.storage());
  const auto& desc = s.pool.desc();
  const int64_t n_locs = desc.num_locations();
  r.k.resize(size_t(n_locs * d));
  r.k_scale.resize(size_t(n_locs));
  for (int64_t loc = 0; loc < n_locs; ++loc) {
    const uint8_t* page = bytes.ptr<const uint8_t>() + (loc / desc.page_size) * desc.page_bytes();
    const int64_t slot = loc % desc.page_size;
    for (int64_t c = 0; c < d; ++c)
      r.k[size_t(loc * d + c)] = reference::e4m3_value(page[slot * d + c]);
    float scale;
    std::memcpy(&scale, page + desc.page_size * d + slot * 4, 4);
    r.k_scale[size_t(loc)] = scale;
  }
  return r;
}

reference::Vec reference_logits(const Scene& s, const ReferenceInputs& r, int64_t row_begin,
                                int64_t row_end, int64_t width) {
  auto slice = [&](const std::vector<int32_t>& v) {
    return std::vector<int32_t>(v.begin() + row_begin, v.begin() + row_end);
  };
  const int64_t rows = row_end - row_begin, hd = int64_t(s.h_i) * s.d_i;
  const reference::Vec q(r.q.begin() + row_begin * hd, r.q.begin() + row_end * hd);
  const reference::Vec gate(r.gate.begin() + row_begin * s.h_i, r.gate.begin() + row_end * s.h_i);
  return reference::indexer_logits(q, gate, r.k, r.k_scale, rows, s.h_i, s.d_i, s.index.kv_locs,
                                   slice(s.index.token_kv_start), slice(s.index.token_ctx_len),
                                   width);
}

// Logits against the reference: the -inf mask exactly, finite entries to the fp32 tolerance.
void expect_logits_match(const std::vector<double>& out, const reference::Vec& ref) {
  ASSERT_EQ(out.size(), ref.size());
  std::vector<double> out_finite, ref_finite;
  int64_t mask_mismatches = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) || std::isinf(out[i])) {
      mask_mismatches += out[i] != ref[i];
      continue;
    }
    out_finite.push_back(out[i]);
    ref_finite.push_back(ref[i]);
  }
  EXPECT_EQ(mask_mismatches, 0);
  ASSERT_FALSE(ref_finite.empty());
  const double err = testing::rel_l2(out_finite, ref_finite);
  EXPECT_LE(err, testing::kTolF32) << "logits rel-L2 over " << ref_finite.size() << " entries";
  char err_str[32];
  std::snprintf(err_str, sizeof err_str, "%.3e", err);
  ::testing::Test::RecordProperty("logits_rel_l2", err_str);
}

class IndexerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    rng_ = std::make_unique<Rng>(seed_);
    be_ = make_backend(GetParam());
  }
  std::string trace() const { return "seed " + std::to_string(seed_); }
  Backend& be() { return *be_; }
  Rng& rng() { return *rng_; }

  uint64_t seed_ = 0;
  std::unique_ptr<Rng> rng_;
  std::unique_ptr<Backend> be_;
};

// ---- quantization ------------------------------------------------------------------------

TEST_P(IndexerTest, QuantizeQMatchesReferenceBytesAndGate) {
  SCOPED_TRACE(trace());
  for (const IndexerDims& dims : preset_dims()) {
    SCOPED_TRACE(dims.preset);
    const int64_t t = 7, h = dims.h_i, d = dims.d_i;
    Tensor x = random_vectors_bf16(rng(), {t, h, d});
    // One head of exact zeros among random ones: amax takes the 1e-4 floor.
    std::fill_n(x.ptr<bf16_t>() + 3 * d, d, bf16_t{0});
    // A NaN after the largest value of its vector: amax ignores NaN, the NaN's own code is NaN.
    x.ptr<bf16_t>()[5 * d] = f32_to_bf16(1e3f);
    x.ptr<bf16_t>()[6 * d - 1] = f32_to_bf16(kNaN);
    const TensorView idx_q = x.view();
    const Tensor w = testing::random_tensor(rng(), DType::kF32, {t, h});
    const Tensor q8 = poisoned(be(), DType::kU8, {t, h, d});
    const Tensor gate = poisoned(be(), DType::kF32, {t, h});
    be().indexer_quantize_q(be().to_device(idx_q), be().to_device(w), q8, gate);

    const Tensor q8_host = be().to_host(q8), gate_host = be().to_host(gate);
    const reference::Vec xv = reference::to_vec(idx_q);
    // gate = fp32(idx_w · fp32((H_i·d_i)^-0.5)) · s_q, s_q a power of two.
    const float norm = float(1.0 / std::sqrt(double(h * d)));
    std::vector<uint8_t> codes(static_cast<size_t>(d));
    int64_t byte_mismatches = 0, gate_mismatches = 0;
    for (int64_t i = 0; i < t * h; ++i) {
      double scale = 0;
      reference::indexer_quantize(xv.data() + i * d, int(d), codes.data(), &scale);
      byte_mismatches += std::memcmp(codes.data(), q8_host.ptr<uint8_t>() + i * d, size_t(d)) != 0;
      const float w_i = w.ptr<float>()[i], g = gate_host.ptr<float>()[i];
      gate_mismatches += g != (w_i * norm) * float(scale);
      EXPECT_NEAR(g, double(w_i) * scale / std::sqrt(double(h * d)),
                  4e-7 * std::fabs(double(w_i) * scale));
    }
    EXPECT_EQ(byte_mismatches, 0) << "(token, head) vectors with differing e4m3 bytes";
    EXPECT_EQ(gate_mismatches, 0);
  }
}

// ---- logits ------------------------------------------------------------------------------

TEST_P(IndexerTest, LogitsMatchReference) {
  SCOPED_TRACE(trace());
  for (const IndexerDims& dims : preset_dims()) {
    for (int page_size : {1, 64}) {
      SCOPED_TRACE(dims.preset + " page_size " + std::to_string(page_size));
      // A fresh prompt, two extends over cached prefixes, one decode-like token.
      Scene s = make_scene(be(), rng(), dims.h_i, dims.d_i, page_size,
                           {{0, 37}, {70, 9}, {5, 3}, {130, 1}});
      const ReferenceInputs ref = reference_inputs(be(), s);
      const int64_t t = s.num_tokens();
      const QuantizedArgs q = quantize_on_backend(be(), s);

      // All rows, with 3 columns past the longest context; then a row range.
      const int64_t width = s.max_ctx() + 3;
      for (const auto& [begin, end] : {std::pair<int64_t, int64_t>{0, t}, {30, 44}}) {
        SCOPED_TRACE("rows [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
        const Tensor logits = poisoned(be(), DType::kF32, {end - begin, width});
        be().indexer_logits(q.args, begin, end, logits);
        expect_logits_match(testing::to_double(be().to_host(logits)),
                            reference_logits(s, ref, begin, end, width));
      }
    }
  }
}

TEST_P(IndexerTest, LogitsNaNStaysInTheAffectedToken) {
  SCOPED_TRACE(trace());
  Scene s = make_scene(be(), rng(), 32, 128, 64, {{20, 6}});
  const int64_t t = s.num_tokens(), bad = 2;
  s.idx_q.ptr<bf16_t>()[(bad * s.h_i + 5) * s.d_i + 17] = f32_to_bf16(kNaN);
  const QuantizedArgs q = quantize_on_backend(be(), s);
  const Tensor logits = poisoned(be(), DType::kF32, {t, s.max_ctx()});
  be().indexer_logits(q.args, 0, t, logits);
  const Tensor out = be().to_host(logits);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t p = 0; p < s.max_ctx(); ++p) {
      const float v = out.ptr<float>()[i * s.max_ctx() + p];
      if (p >= s.index.token_ctx_len[size_t(i)])
        EXPECT_EQ(v, -kInf) << "token " << i << " position " << p;
      else if (i == bad)
        EXPECT_TRUE(std::isnan(v)) << "position " << p;
      else
        EXPECT_TRUE(std::isfinite(v)) << "token " << i << " position " << p;
    }
  }
}

// ---- top-k -------------------------------------------------------------------------------

// Ranking under test (backend.h): larger first, -0.0 == +0.0, NaN below every number (-inf
// included) and NaNs equal to each other, equal scores to the lower position; the selection is
// returned in ascending position order, -1 padded.
void expect_topk_matches_reference(Backend& be, const std::vector<float>& logits, int64_t rows,
                                   int64_t width, const std::vector<int32_t>& ctx_len, int k) {
  Tensor host = Tensor::host(DType::kF32, {rows, width});
  std::copy(logits.begin(), logits.end(), host.ptr<float>());
  const Tensor out = poisoned(be, DType::kI32, {rows, k});
  be.topk(be.to_device(host), be.to_device(host_i32(ctx_len)), k, out);
  const std::vector<int32_t> got = i32_values(be, out);
  const std::vector<int32_t> want =
      reference::topk(reference::to_vec(host.view()), rows, width, ctx_len, k);
  for (int64_t r = 0; r < rows; ++r)
    EXPECT_TRUE(std::equal(want.begin() + r * k, want.begin() + (r + 1) * k, got.begin() + r * k))
        << "row " << r << " (ctx_len " << ctx_len[size_t(r)] << ", k " << k << ")";
}

TEST_P(IndexerTest, TopkLengthsAroundKWithTies) {
  SCOPED_TRACE(trace());
  for (int k : {1, 2, 16}) {
    SCOPED_TRACE("k " + std::to_string(k));
    const int64_t width = 40 * k + 7;
    // Lengths 0, 1, k-1, k, k+1, 3k and the whole row.
    const std::vector<int32_t> lens = {0, 1, std::max(k - 1, 0), k, k + 1, 3 * k, int32_t(width)};
    const std::vector<float> levels = {-1.f, 0.f, -0.f, 0.5f, 2.f, -kInf, kInf, kNaN};
    std::vector<int32_t> ctx_len;
    std::vector<float> logits;
    for (int32_t len : lens) {
      // Few distinct values: ties at the boundary are real.
      ctx_len.push_back(len);
      for (int64_t p = 0; p < width; ++p)
        logits.push_back(levels[size_t(rng().randint(0, int64_t(levels.size()) - 1))]);
    }
    // All-equal, all-NaN, all -inf and distinct random rows over the whole width.
    for (float fill : {1.5f, kNaN, -kInf}) {
      ctx_len.push_back(int32_t(width));
      logits.insert(logits.end(), size_t(width), fill);
    }
    ctx_len.push_back(int32_t(width));
    for (int64_t p = 0; p < width; ++p) logits.push_back(rng().normal());
    expect_topk_matches_reference(be(), logits, int64_t(ctx_len.size()), width, ctx_len, k);
  }
}

TEST_P(IndexerTest, TopkLongRowsManyTies) {
  SCOPED_TRACE(trace());
  // ctx much larger than k; values on a coarse grid (many equal scores) and in a narrow band
  // (keys share their high radix digits).
  const int64_t width = 6000, rows = 6;
  const int k = 256;
  std::vector<float> logits;
  std::vector<int32_t> ctx_len;
  for (int64_t r = 0; r < rows; ++r) {
    ctx_len.push_back(int32_t(width - rng().randint(0, 900)));
    for (int64_t p = 0; p < width; ++p) {
      const float v = r % 2 ? std::round(rng().normal(3.f)) : 1000.f + rng().uniform(0.f, 1e-3f);
      logits.push_back(v);
    }
  }
  expect_topk_matches_reference(be(), logits, rows, width, ctx_len, k);

  // Rows past the 40960 keys the CUDA kernel keeps in shared memory (those re-read the logits
  // every pass) beside one that fits, in one call, with index_topk's k.
  const int64_t long_width = 42000;
  logits.assign(size_t(3 * long_width), 0.f);
  ctx_len = {int32_t(long_width), 40000, int32_t(long_width - 7)};
  for (int64_t i = 0; i < 3 * long_width; ++i)
    logits[size_t(i)] = (i / long_width) == 2 ? std::round(rng().normal(4.f)) : rng().normal(1.f);
  expect_topk_matches_reference(be(), logits, 3, long_width, ctx_len, 2048);
}

TEST_P(IndexerTest, TopkNaNOrder) {
  SCOPED_TRACE(trace());
  // NaN ranks below -inf and NaNs tie with each other (the lower position wins); -0.0 == +0.0.
  const std::vector<float> logits = {kNaN, -kInf, kNaN, kNaN,  // -inf, then the first NaN
                                     5.f,  -0.f,  0.f,  0.f,   // 5, then -0.0 ties +0.0: pos 1
                                     kNaN, 2.f,   kNaN, 1.f};  // numbers beat every NaN
  Tensor host = Tensor::host(DType::kF32, {3, 4});
  std::copy(logits.begin(), logits.end(), host.ptr<float>());
  const Tensor out = poisoned(be(), DType::kI32, {3, 2});
  be().topk(be().to_device(host), be().to_device(host_i32({4, 4, 4})), 2, out);
  EXPECT_EQ(i32_values(be(), out), (std::vector<int32_t>{0, 1, 0, 1, 1, 3}));
}

// ---- the whole indexer -------------------------------------------------------------------

// Checks indexer_topk's output for every token: the identity shortcut where ctx_len <= k;
// elsewhere exactly the top-k of the backend's own logits, and a valid top-k of the float64
// logits (no unselected position scores above a selected one beyond fp32 rounding).
void expect_indexer_topk_valid(Backend& be, const Scene& s, int k,
                               const std::vector<int32_t>& got) {
  const int64_t t = s.num_tokens(), width = s.max_ctx();
  const QuantizedArgs q = quantize_on_backend(be, s);
  const Tensor logits = poisoned(be, DType::kF32, {t, width});
  be.indexer_logits(q.args, 0, t, logits);
  const std::vector<double> own = testing::to_double(be.to_host(logits));
  const std::vector<int32_t> want_own = reference::topk(own, t, width, s.index.token_ctx_len, k);
  const reference::Vec ref = reference_logits(s, reference_inputs(be, s), 0, t, width);

  for (int64_t i = 0; i < t; ++i) {
    const int32_t ctx = s.index.token_ctx_len[size_t(i)];
    const int32_t* row = got.data() + i * k;
    SCOPED_TRACE("token " + std::to_string(i) + " ctx_len " + std::to_string(ctx));
    if (ctx <= k) {
      for (int j = 0; j < k; ++j) ASSERT_EQ(row[j], j < ctx ? j : -1) << "slot " << j;
      continue;
    }
    ASSERT_TRUE(std::equal(row, row + k, want_own.begin() + i * k));
    std::vector<bool> chosen(size_t(ctx), false);
    for (int j = 0; j < k; ++j) chosen[size_t(row[j])] = true;
    double min_chosen = kInf, max_other = -kInf, magnitude = 0;
    for (int32_t p = 0; p < ctx; ++p) {
      const double v = ref[size_t(i * width + p)];
      magnitude = std::max(magnitude, std::fabs(v));
      if (chosen[size_t(p)])
        min_chosen = std::min(min_chosen, v);
      else
        max_other = std::max(max_other, v);
    }
    EXPECT_GE(min_chosen, max_other - 1e-5 * magnitude);
  }
}

TEST_P(IndexerTest, IndexerTopkMatchesLogitsAndReference) {
  SCOPED_TRACE(trace());
  const int k = 32;
  for (const IndexerDims& dims : preset_dims()) {
    for (int page_size : {1, 64}) {
      SCOPED_TRACE(dims.preset + " page_size " + std::to_string(page_size));
      // Tokens below, at and above k; a prefix longer than k; a short request.
      const Scene s = make_scene(be(), rng(), dims.h_i, dims.d_i, page_size,
                                 {{0, 45}, {100, 5}, {10, 3}, {31, 2}});
      const Tensor out = poisoned(be(), DType::kI32, {s.num_tokens(), k});
      be().indexer_topk(be().to_device(s.idx_q), be().to_device(s.idx_w), s.layout(), k, out);
      expect_indexer_topk_valid(be(), s, k, i32_values(be(), out));
    }
  }
}

TEST_P(IndexerTest, IdentityShortcutIgnoresScores) {
  SCOPED_TRACE(trace());
  const int k = 16;
  Scene s = make_scene(be(), rng(), 64, 128, 64, {{0, 20}, {3, 2}});
  // Tokens with ctx_len <= k get NaN queries and weights. Their selection must not depend on
  // scores at all, and the NaNs must not reach the tokens that are scored.
  const int64_t t = s.num_tokens(), hd = int64_t(s.h_i) * s.d_i;
  int64_t shortcut_tokens = 0;
  for (int64_t i = 0; i < t; ++i) {
    if (s.index.token_ctx_len[size_t(i)] > k) continue;
    ++shortcut_tokens;
    std::fill_n(s.idx_q.ptr<bf16_t>() + i * hd, hd, f32_to_bf16(kNaN));
    std::fill_n(s.idx_w.ptr<float>() + i * s.h_i, s.h_i, kNaN);
  }
  ASSERT_EQ(shortcut_tokens, 16 + 2);
  const Tensor out = poisoned(be(), DType::kI32, {t, k});
  be().indexer_topk(be().to_device(s.idx_q), be().to_device(s.idx_w), s.layout(), k, out);
  expect_indexer_topk_valid(be(), s, k, i32_values(be(), out));
}

// Every context of the batch fits k (here the whole kv range, 65 positions, is within k = 80): the
// CUDA backend then runs the top-k alone, without quantizing queries or computing logits. All
// queries and weights are NaN, so any score that was read would show.
TEST_P(IndexerTest, WholeKvRangeWithinKIsAllIdentity) {
  SCOPED_TRACE(trace());
  const int k = 80;
  Scene s = make_scene(be(), rng(), 64, 128, 64, {{0, 20}, {10, 5}, {0, 30}});
  ASSERT_EQ(s.layout().kv_locs.numel(), 65);
  const int64_t t = s.num_tokens();
  std::fill_n(s.idx_q.ptr<bf16_t>(), s.idx_q.numel(), f32_to_bf16(kNaN));
  std::fill_n(s.idx_w.ptr<float>(), s.idx_w.numel(), kNaN);
  const Tensor out = poisoned(be(), DType::kI32, {t, k});
  be().indexer_topk(be().to_device(s.idx_q), be().to_device(s.idx_w), s.layout(), k, out);
  const std::vector<int32_t> got = i32_values(be(), out);
  for (int64_t i = 0; i < t; ++i) {
    const int32_t ctx = s.index.token_ctx_len[size_t(i)];
    SCOPED_TRACE("token " + std::to_string(i) + " ctx_len " + std::to_string(ctx));
    for (int j = 0; j < k; ++j) ASSERT_EQ(got[size_t(i * k + j)], j < ctx ? j : -1) << "slot " << j;
  }
}

TEST_P(IndexerTest, BoundedWorkspaceGivesTheSameResult) {
  SCOPED_TRACE(trace());
  const int k = 64;
  const Scene s = make_scene(be(), rng(), 64, 128, 64, {{3000, 5}, {200, 4}, {0, 70}});
  const int64_t t = s.num_tokens();
  auto run = [&] {
    const Tensor out = poisoned(be(), DType::kI32, {t, k});
    be().indexer_topk(be().to_device(s.idx_q), be().to_device(s.idx_w), s.layout(), k, out);
    return i32_values(be(), out);
  };
  const std::vector<int32_t> whole = run();
  // Two rows per block (a row of this batch needs ~20.7 KB), then one row per block.
  for (const char* limit : {"50000", "1"}) {
    SCOPED_TRACE(std::string(kWorkspaceEnv) + "=" + limit);
    ::setenv(kWorkspaceEnv, limit, 1);
    const std::vector<int32_t> blocked = run();
    ::unsetenv(kWorkspaceEnv);
    EXPECT_EQ(blocked, whole);
  }
  expect_indexer_topk_valid(be(), s, k, whole);
}

// ---- bad input ---------------------------------------------------------------------------

// Runs fn, expecting Error(kInvalidArgument) whose message names `arg`.
void expect_rejected(const std::function<void()>& fn, const std::string& arg) {
  try {
    fn();
    ADD_FAILURE() << "expected an error naming " << arg;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(arg), std::string::npos)
        << "message '" << e.what() << "' does not name " << arg;
  }
}

bool all_bytes(Backend& be, const TensorView& t, uint8_t byte) {
  const Tensor h = be.to_host(t);
  const auto* p = h.ptr<const uint8_t>();
  return std::all_of(p, p + h.nbytes(), [byte](uint8_t b) { return b == byte; });
}

bool all_nan(Backend& be, const TensorView& t) {
  const Tensor h = be.to_host(t);
  return std::all_of(h.ptr<const float>(), h.ptr<const float>() + h.numel(),
                     [](float v) { return std::isnan(v); });
}

TEST_P(IndexerTest, BadInputNamesTheArgumentAndWritesNothing) {
  SCOPED_TRACE(trace());
  const int k = 4;
  const Scene s = make_scene(be(), rng(), 32, 128, 16, {{9, 3}, {0, 5}});
  const int64_t t = s.num_tokens(), h = s.h_i, d = s.d_i;
  const uint64_t pool_sum = testing::checksum(be().to_host(s.pool.storage()));
  const Tensor idx_q = be().to_device(s.idx_q), idx_w = be().to_device(s.idx_w);
  const Tensor out = poisoned(be(), DType::kI32, {t, k});
  const IndexerArgs good = s.layout();
  auto indexer_topk = [&](const TensorView& q, const TensorView& w, const IndexerArgs& a, int kk,
                          const TensorView& o) {
    return [&, q, w, a, kk, o] { be().indexer_topk(q, w, a, kk, o); };
  };
  auto with = [&](auto edit) {
    IndexerArgs a = good;
    edit(a);
    return a;
  };

  const Tensor q_f32 = be().empty(DType::kF32, {t, h, d});
  const Tensor q_narrow = be().empty(DType::kBF16, {t, h, 64});
  const Tensor w_short = be().empty(DType::kF32, {t, h - 1});
  const Tensor out_wide = poisoned(be(), DType::kI32, {t, k + 1});
  const Tensor start_far = be().to_device(host_i32(std::vector<int32_t>(size_t(t), 10)));
  const Tensor len_neg = be().to_device(host_i32(std::vector<int32_t>(size_t(t), -1)));
  std::vector<int32_t> locs = s.index.kv_locs;
  locs[3] = int32_t(s.pool.desc().num_locations());
  const Tensor locs_high = be().to_device(host_i32(locs));
  locs[3] = -2;
  const Tensor locs_neg = be().to_device(host_i32(locs));

  expect_rejected(indexer_topk(idx_q, idx_w, good, 0, out), "k:");
  expect_rejected(indexer_topk(idx_q, idx_w, good, -3, out), "k:");
  expect_rejected(indexer_topk(q_f32, idx_w, good, k, out), "idx_q");
  expect_rejected(indexer_topk(q_narrow, idx_w, good, k, out), "idx_q");
  expect_rejected(indexer_topk(idx_q, w_short, good, k, out), "idx_w");
  expect_rejected(indexer_topk(idx_q, idx_w, good, k + 1, out), "out");
  expect_rejected(indexer_topk(idx_q, idx_w, good, k, out_wide), "out");
  expect_rejected(
      indexer_topk(idx_q, idx_w, with([&](IndexerArgs& a) { a.kv_start = start_far; }), k, out),
      "kv_start");
  expect_rejected(
      indexer_topk(idx_q, idx_w, with([&](IndexerArgs& a) { a.ctx_len = len_neg; }), k, out),
      "ctx_len");
  expect_rejected(
      indexer_topk(idx_q, idx_w, with([&](IndexerArgs& a) { a.kv_locs = locs_high; }), k, out),
      "kv_locs");
  expect_rejected(
      indexer_topk(idx_q, idx_w, with([&](IndexerArgs& a) { a.kv_locs = locs_neg; }), k, out),
      "kv_locs");
  expect_rejected(
      indexer_topk(idx_q, idx_w, with([&](IndexerArgs& a) { a.keys = nullptr; }), k, out), "keys");
  EXPECT_TRUE(all_bytes(be(), out, kSentinelByte)) << "a rejected indexer_topk wrote its output";

  // indexer_quantize_q
  const Tensor q8 = poisoned(be(), DType::kU8, {t, h, d});
  const Tensor gate = poisoned(be(), DType::kF32, {t, h});
  const Tensor q8_short = poisoned(be(), DType::kU8, {t - 1, h, d});
  const Tensor gate_bf16 = be().empty(DType::kBF16, {t, h});
  expect_rejected([&] { be().indexer_quantize_q(idx_q, idx_w, q8_short, gate); }, "q8");
  expect_rejected([&] { be().indexer_quantize_q(idx_q, idx_w, q8, gate_bf16); }, "gate");
  expect_rejected([&] { be().indexer_quantize_q(idx_q, w_short, q8, gate); }, "idx_w");
  EXPECT_TRUE(all_bytes(be(), q8, 0xFF) && all_nan(be(), gate));

  // indexer_logits
  be().indexer_quantize_q(idx_q, idx_w, q8, gate);
  IndexerArgs a = good;
  a.q8 = q8.view();
  a.gate = gate.view();
  const Tensor narrow = poisoned(be(), DType::kF32, {t, s.max_ctx() - 1});
  const Tensor logits = poisoned(be(), DType::kF32, {t, s.max_ctx()});
  expect_rejected([&] { be().indexer_logits(a, 0, t, narrow); }, "logits");
  expect_rejected([&] { be().indexer_logits(a, 2, t + 1, logits); }, "rows");
  expect_rejected([&] { be().indexer_logits(a, 3, 2, logits); }, "rows");
  IndexerArgs bad_q8 = a;
  bad_q8.q8 = q_narrow.view();
  expect_rejected([&] { be().indexer_logits(bad_q8, 0, t, logits); }, "q8");
  IndexerArgs bad_locs = a;
  bad_locs.kv_locs = locs_high.view();
  expect_rejected([&] { be().indexer_logits(bad_locs, 0, t, logits); }, "kv_locs");
  EXPECT_TRUE(all_nan(be(), logits) && all_nan(be(), narrow));

  // topk
  const Tensor lens = be().to_device(host_i32(s.index.token_ctx_len));
  const Tensor too_long =
      be().to_device(host_i32(std::vector<int32_t>(size_t(t), s.max_ctx() + 1)));
  expect_rejected([&] { be().topk(logits, lens, 0, out); }, "k:");
  expect_rejected([&] { be().topk(logits, too_long, k, out); }, "ctx_len");
  expect_rejected([&] { be().topk(logits, lens, k, out_wide); }, "out");
  EXPECT_TRUE(all_bytes(be(), out, kSentinelByte));

  EXPECT_EQ(testing::checksum(be().to_host(s.pool.storage())), pool_sum);
}

// indexer_topk from queries already quantized (the caller's q8 and gate, as DeepGEMM's e4m3 q and
// weights come): the same positions as from the bf16 queries, whole and one row per block; a
// bad q8 or out is named and nothing is written.
TEST_P(IndexerTest, IndexerTopkFromQuantizedQueries) {
  SCOPED_TRACE(trace());
  const int k = 32;
  const Scene s = make_scene(be(), rng(), 64, 128, 64, {{0, 45}, {100, 5}, {10, 3}, {31, 2}});
  const int64_t t = s.num_tokens();
  const Tensor q8 = be().empty(DType::kU8, {t, s.h_i, s.d_i});
  const Tensor gate = be().empty(DType::kF32, {t, s.h_i});
  be().indexer_quantize_q(be().to_device(s.idx_q), be().to_device(s.idx_w), q8, gate);
  IndexerArgs args = s.layout();
  args.q8 = q8.view();
  args.gate = gate.view();
  const Tensor want = poisoned(be(), DType::kI32, {t, k});
  be().indexer_topk(be().to_device(s.idx_q), be().to_device(s.idx_w), s.layout(), k, want);
  for (const char* limit : {"", "1"}) {
    SCOPED_TRACE(std::string(kWorkspaceEnv) + "=" + limit);
    if (*limit) ::setenv(kWorkspaceEnv, limit, 1);
    const Tensor out = poisoned(be(), DType::kI32, {t, k});
    be().indexer_topk(args, k, out);
    ::unsetenv(kWorkspaceEnv);
    EXPECT_EQ(i32_values(be(), out), i32_values(be(), want));
  }
  expect_indexer_topk_valid(be(), s, k, i32_values(be(), want));

  const Tensor out = poisoned(be(), DType::kI32, {t, k});
  IndexerArgs narrow = args;
  narrow.q8.shape[2] -= 1;
  try {
    be().indexer_topk(narrow, k, out);
    ADD_FAILURE() << "a q8 narrower than the pool's d_i was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q8"), std::string::npos) << e.what();
  }
  try {
    be().indexer_topk(args, k + 1, out);
    ADD_FAILURE() << "an out of k columns was taken for k + 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(all_bytes(be(), out, kSentinelByte));
}

// The indexer's scratch bound (docs/cuda.md, indexer_topk): a block of `rows` query rows holds
// q8 [rows, H_i, d_i], gate [rows, H_i] and logits [rows, num_kv], so its bytes are
// rows · (H_i·d_i + 4·H_i + 4·num_kv) <= max(block_bytes, one row), with as many rows as fit;
// never the T x num_kv logits of a long prompt (128K tokens: 256 MiB, not 64 GiB).
TEST(IndexerBlocksPlan, ScratchStaysWithinTheBound) {
  const int k = 2048;
  for (int64_t tokens : {1, 7, 4096, 131072})
    for (int64_t num_kv : {int64_t(k), int64_t(k) + 1, int64_t(4096), int64_t(131072)})
      for (int64_t h_i : {64, 32})
        for (int64_t block_bytes : {int64_t(1), int64_t(1) << 20, kIndexerBlockBytes}) {
          SCOPED_TRACE("T " + std::to_string(tokens) + " N_kv " + std::to_string(num_kv) + " H_i " +
                       std::to_string(h_i) + " bound " + std::to_string(block_bytes));
          const IndexerBlocks b = IndexerBlocks::plan(tokens, h_i, 128, num_kv, k, block_bytes);
          if (num_kv <= k) {
            EXPECT_EQ(b.rows, 0);
            EXPECT_EQ(b.bytes, 0);
            continue;
          }
          const int64_t row_bytes = h_i * 128 + 4 * h_i + 4 * num_kv;
          EXPECT_EQ(b.width, num_kv);
          ASSERT_GE(b.rows, 1);
          EXPECT_LE(b.rows, tokens);
          EXPECT_EQ(b.bytes, b.rows * row_bytes);
          EXPECT_LE(b.bytes, std::max(block_bytes, row_bytes));
          if (b.rows < tokens) {
            EXPECT_GT((b.rows + 1) * row_bytes, block_bytes) << "not maximal";
          }
        }
  const IndexerBlocks longest = IndexerBlocks::plan(131072, 64, 128, 131072, k, kIndexerBlockBytes);
  EXPECT_LE(longest.bytes, kIndexerBlockBytes);
  EXPECT_EQ(longest.rows, kIndexerBlockBytes / (64 * 128 + 4 * 64 + 4 * 131072));
}

TEST(IndexerCpu, WorkspaceOverrideIsValidated) {
  const std::unique_ptr<Backend> be = make_cpu_backend();
  Rng rng(testing::fresh_seed());
  const Scene s = make_scene(*be, rng, 32, 128, 64, {{40, 2}});
  const Tensor out = be->empty(DType::kI32, {2, 8});
  for (const char* value : {"-5", "12kb", "0"}) {
    ::setenv(kWorkspaceEnv, value, 1);
    expect_rejected([&] { be->indexer_topk(s.idx_q, s.idx_w, s.layout(), 8, out); }, kWorkspaceEnv);
  }
  ::unsetenv(kWorkspaceEnv);
}

INSTANTIATE_TEST_SUITE_P(Backends, IndexerTest, ::testing::ValuesIn(testing::test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dsakit
