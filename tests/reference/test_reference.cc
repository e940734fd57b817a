// The float64 reference checked on cases small enough to work out by hand, on properties of the
// number formats, against formats.h (two independent implementations), and on the equivalence
// of sparse MLA and dense MHA when the indices list every visible position
// (docs/design.md#equivalence).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "dsakit/error.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

namespace ref = reference;
using ref::Vec;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Vec random_vec(testing::Rng& rng, size_t n, float stddev = 1.0f) {
  Vec v(n);
  for (double& x : v) x = rng.normal(stddev);
  return v;
}

// ---- number formats ------------------------------------------------------------------------

TEST(ReferenceE4m3, ValuesFromFields) {
  EXPECT_EQ(ref::e4m3_value(0x00), 0.0);
  EXPECT_TRUE(std::signbit(ref::e4m3_value(0x80)));
  EXPECT_EQ(ref::e4m3_value(0x01), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(ref::e4m3_value(0x07), 7 * std::ldexp(1.0, -9));
  EXPECT_EQ(ref::e4m3_value(0x08), std::ldexp(1.0, -6));  // smallest normal
  EXPECT_EQ(ref::e4m3_value(0x38), 1.0);
  EXPECT_EQ(ref::e4m3_value(0x3C), 1.5);
  EXPECT_EQ(ref::e4m3_value(0xB8), -1.0);
  EXPECT_EQ(ref::e4m3_value(0x7E), 448.0);
  EXPECT_EQ(ref::e4m3_value(0xFE), -448.0);
  EXPECT_TRUE(std::isnan(ref::e4m3_value(0x7F)));
  EXPECT_TRUE(std::isnan(ref::e4m3_value(0xFF)));
}

TEST(ReferenceE4m3, EncodeInvertsValueForEveryCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(ref::e4m3_encode(ref::e4m3_value(uint8_t(c))), c) << "code " << c;
  }
}

TEST(ReferenceE4m3, MidpointsRoundToTheEvenCode) {
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = ref::e4m3_value(uint8_t(c)), hi = ref::e4m3_value(uint8_t(c + 1));
    const double mid = 0.5 * (lo + hi), eps = (hi - lo) * 1e-3;
    const int even = c % 2 == 0 ? c : c + 1;
    EXPECT_EQ(ref::e4m3_encode(mid), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(ref::e4m3_encode(-mid), 0x80 | even);
    EXPECT_EQ(ref::e4m3_encode(mid - eps), c);
    EXPECT_EQ(ref::e4m3_encode(mid + eps), c + 1);
  }
}

TEST(ReferenceE4m3, SaturatesAndMapsNaN) {
  EXPECT_EQ(ref::e4m3_encode(448.0), 0x7E);
  EXPECT_EQ(ref::e4m3_encode(470.0), 0x7E);
  EXPECT_EQ(ref::e4m3_encode(1e30), 0x7E);
  EXPECT_EQ(ref::e4m3_encode(kInf), 0x7E);
  EXPECT_EQ(ref::e4m3_encode(-kInf), 0xFE);
  EXPECT_EQ(ref::e4m3_encode(kNaN), 0x7F);
  EXPECT_EQ(ref::e4m3_encode(-kNaN), 0xFF);
  EXPECT_EQ(ref::e4m3_encode(-1e-30), 0x80);  // rounds to zero, keeps the sign
}

TEST(ReferenceE4m3, AgreesWithFormatsHeader) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  for (int c = 0; c < 256; ++c) {
    const double a = ref::e4m3_value(uint8_t(c)), b = e4m3_to_f32(uint8_t(c));
    EXPECT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << "code " << c;
  }
  for (int i = 0; i < 200000; ++i) {
    // Magnitudes from deep subnormal to past saturation.
    const float x = rng.normal() * std::ldexp(1.0f, int(rng.randint(-14, 10)));
    ASSERT_EQ(ref::e4m3_encode(x), f32_to_e4m3(x)) << "x = " << x;
  }
}

TEST(ReferenceBf16, NeighbourRoundingTiesToEven) {
  const double u = std::ldexp(1.0, -7);  // bf16 ulp at 1
  EXPECT_EQ(ref::bf16_round(1.0 + u / 2), 1.0);
  EXPECT_EQ(ref::bf16_round(1.0 + 1.5 * u), 1.0 + 2 * u);
  EXPECT_EQ(ref::bf16_round(1.0 + 0.51 * u), 1.0 + u);
  EXPECT_EQ(ref::bf16_round(-(1.0 + 0.49 * u)), -1.0);
  EXPECT_EQ(ref::bf16_round(std::ldexp(1.0, -133)), std::ldexp(1.0, -133));  // min subnormal
  EXPECT_EQ(ref::bf16_round(std::ldexp(1.0, -134)), 0.0);
  EXPECT_EQ(ref::bf16_round(std::ldexp(3.0, -134)), std::ldexp(1.0, -132));
  const double max_bf16 = std::ldexp(2.0 - u, 127);
  EXPECT_EQ(ref::bf16_round(max_bf16), max_bf16);
  EXPECT_EQ(ref::bf16_round(std::ldexp(1.0, 128)), kInf);
  EXPECT_TRUE(std::isnan(ref::bf16_round(kNaN)));
}

TEST(ReferenceBf16, AgreesWithFormatsHeader) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  for (int i = 0; i < 200000; ++i) {
    const float x = rng.normal() * std::ldexp(1.0f, int(rng.randint(-140, 120)));
    ASSERT_EQ(ref::bf16_round(x), double(round_bf16(x))) << "x = " << x;
  }
}

// ---- pool rows -----------------------------------------------------------------------------

constexpr KvRowLayout kRowBf16{KvLayout::kBf16, 512, 64};
constexpr KvRowLayout kRowFp8{KvLayout::kFp8Scaled, 512, 64};
constexpr KvRowLayout kRowFp8Raw{KvLayout::kFp8Raw, 512, 64};

// One token: c_kv [512] with per-tile magnitudes 1, 50, 1e-2, 0, and k_pe [64], bf16 values.
void random_token(testing::Rng& rng, Vec& c_kv, Vec& k_pe) {
  const double tile_stddev[4] = {1.0, 50.0, 1e-2, 0.0};
  c_kv.resize(512);
  k_pe.resize(64);
  for (int i = 0; i < 512; ++i)
    c_kv[size_t(i)] = ref::bf16_round(rng.normal() * tile_stddev[i / 128]);
  for (double& x : k_pe) x = ref::bf16_round(rng.normal());
}

float stored_scale(const std::vector<uint8_t>& row, int tile) {
  float s;
  std::memcpy(&s, row.data() + kRowFp8.scales_offset() + 4 * tile, 4);
  return s;
}

TEST(ReferenceKvRow, Bf16RowIsExact) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  Vec c_kv, k_pe, c_out(512), pe_out(64);
  random_token(rng, c_kv, k_pe);
  const auto row = ref::encode_kv_row(kRowBf16, c_kv.data(), k_pe.data(), ScalePolicy::kAmax, 1.0);
  ASSERT_EQ(row.size(), 1152u);
  uint16_t first;
  std::memcpy(&first, row.data(), 2);
  EXPECT_EQ(first, f32_to_bf16(float(c_kv[0])).bits);  // little-endian bf16 bits
  ref::decode_kv_row(kRowBf16, row.data(), 1.0, c_out.data(), pe_out.data());
  EXPECT_EQ(c_out, c_kv);
  EXPECT_EQ(pe_out, k_pe);
}

TEST(ReferenceKvRow, Fp8ScalesFollowThePolicy) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  Vec c_kv, k_pe;
  random_token(rng, c_kv, k_pe);
  for (ScalePolicy policy : {ScalePolicy::kAmax, ScalePolicy::kPow2}) {
    SCOPED_TRACE(to_string(policy));
    const auto row = ref::encode_kv_row(kRowFp8, c_kv.data(), k_pe.data(), policy, 1.0);
    ASSERT_EQ(row.size(), 656u);
    for (int tile = 0; tile < 4; ++tile) {
      float amax = 0;
      for (int i = 0; i < 128; ++i)
        amax = std::max(amax, float(std::fabs(c_kv[size_t(tile * 128 + i)])));
      const float s = stored_scale(row, tile);
      EXPECT_EQ(s, fp8_tile_scale(amax, policy)) << "tile " << tile;
      if (policy == ScalePolicy::kPow2) {
        int e;
        EXPECT_EQ(std::frexp(s, &e), 0.5) << "scale " << s << " is not a power of two";
        EXPECT_GE(double(s), std::max(double(amax / 448.0f), 1e-4));
        EXPECT_LT(double(s) / 2, std::max(double(amax / 448.0f), 1e-4));
      }
    }
  }
  // The boundary: amax/448 exactly a power of two keeps that power.
  Vec edge(512, 0.0);
  edge[5] = 56.0;  // 56 / 448 = 2^-3
  edge[130] = 56.0001;
  const auto row = ref::encode_kv_row(kRowFp8, edge.data(), k_pe.data(), ScalePolicy::kPow2, 1.0);
  EXPECT_EQ(stored_scale(row, 0), 0.125f);
  EXPECT_EQ(stored_scale(row, 1), 0.25f);
  EXPECT_EQ(stored_scale(row, 2), std::ldexp(1.0f, -13));  // zero tile: the 1e-4 clamp
  EXPECT_EQ(row[5], 0x7E);
  EXPECT_EQ(row[6], 0x00);
}

TEST(ReferenceKvRow, Fp8RoundTripWithinE4m3Precision) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  Vec c_kv, k_pe, c_out(512), pe_out(64);
  random_token(rng, c_kv, k_pe);
  for (ScalePolicy policy : {ScalePolicy::kAmax, ScalePolicy::kPow2}) {
    SCOPED_TRACE(to_string(policy));
    const auto row = ref::encode_kv_row(kRowFp8, c_kv.data(), k_pe.data(), policy, 1.0);
    ref::decode_kv_row(kRowFp8, row.data(), 1.0, c_out.data(), pe_out.data());
    EXPECT_EQ(pe_out, k_pe);  // rope stays bf16
    for (int i = 0; i < 512; ++i) {
      // Half an e4m3 ulp: 2^-4 relative for normals, 2^-10 · s in the subnormal range.
      const double s = stored_scale(row, i / 128);
      const double bound =
          (std::ldexp(std::fabs(c_kv[size_t(i)]), -4) + std::ldexp(s, -10)) * 1.0001;
      ASSERT_LE(std::fabs(c_out[size_t(i)] - c_kv[size_t(i)]), bound) << "value " << i;
      ASSERT_EQ(row[size_t(i)], quantize_e4m3(float(c_kv[size_t(i)]), float(s))) << "value " << i;
    }
  }
}

TEST(ReferenceKvRow, Fp8RawUsesThePoolScale) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  Vec c_kv, k_pe, c_out(512), pe_out(64);
  random_token(rng, c_kv, k_pe);
  const double k_scale = 0.5;
  const auto row =
      ref::encode_kv_row(kRowFp8Raw, c_kv.data(), k_pe.data(), ScalePolicy::kAmax, k_scale);
  ASSERT_EQ(row.size(), 576u);
  ref::decode_kv_row(kRowFp8Raw, row.data(), k_scale, c_out.data(), pe_out.data());
  for (int i = 0; i < 512; ++i) {
    EXPECT_EQ(row[size_t(i)], ref::e4m3_encode(c_kv[size_t(i)] / k_scale));
    EXPECT_EQ(c_out[size_t(i)], ref::e4m3_value(row[size_t(i)]) * k_scale);
  }
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(pe_out[size_t(i)], ref::e4m3_value(row[size_t(512 + i)]) * k_scale);
  // 300 / 0.5 = 600 saturates to 448.
  c_kv[0] = -300;
  const auto big =
      ref::encode_kv_row(kRowFp8Raw, c_kv.data(), k_pe.data(), ScalePolicy::kAmax, k_scale);
  EXPECT_EQ(big[0], 0xFE);
}

TEST(ReferenceIndexer, QuantizeUsesPow2ScaleOfTheVector) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  for (float stddev : {1.0f, 1e-7f, 30.0f}) {
    Vec x(128);
    for (double& v : x) v = ref::bf16_round(rng.normal(stddev));
    std::vector<uint8_t> codes(128);
    double s = 0;
    ref::indexer_quantize(x.data(), 128, codes.data(), &s);
    float amax = 0;
    for (double v : x) amax = std::max(amax, float(std::fabs(v)));
    EXPECT_EQ(s, indexer_fp8_scale(amax)) << "stddev " << stddev;
    EXPECT_GE(s, std::max(double(amax), 1e-4) / 448 * (1 - 1e-7));
    for (int i = 0; i < 128; ++i) EXPECT_EQ(codes[size_t(i)], ref::e4m3_encode(x[size_t(i)] / s));
  }
}

TEST(ReferenceIndexer, LogitsByHand) {
  // T = 1, H_i = 2, d_i = 2, three key locations; the token sees locations 2, 0 (ctx_len 2).
  const Vec q = {1, 2, /*head 1*/ -1, 0};
  const Vec gate = {0.5, 3};
  const Vec k = {1, 1, /*loc 1*/ 9, 9, /*loc 2*/ -2, 4};
  const Vec k_scale = {2, 100, 0.25};
  const Vec logits = ref::indexer_logits(q, gate, k, k_scale, 1, 2, 2, {7, 2, 0}, {1}, {2}, 4);
  // loc 2: head 0 dot 6, head 1 dot 2 -> 0.25 · (0.5·6 + 3·2) = 2.25
  // loc 0: head 0 dot 3, head 1 dot -1 (ReLU 0) -> 2 · 1.5 = 3
  ASSERT_EQ(logits.size(), 4u);
  EXPECT_DOUBLE_EQ(logits[0], 2.25);
  EXPECT_DOUBLE_EQ(logits[1], 3.0);
  EXPECT_EQ(logits[2], -kInf);
  EXPECT_EQ(logits[3], -kInf);
}

TEST(ReferenceTopk, TiesNaNAndPadding) {
  const Vec row = {3, 1, 3, kNaN, 2, 99};  // the 99 lies past ctx_len
  const auto sel = [&](int k) { return ref::topk(row, 1, 6, {5}, k); };
  EXPECT_EQ(sel(1), (std::vector<int32_t>{0}));  // tie between 0 and 2 -> lower position
  EXPECT_EQ(sel(2), (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(sel(3), (std::vector<int32_t>{0, 2, 4}));
  EXPECT_EQ(sel(5), (std::vector<int32_t>{0, 1, 2, 3, 4}));  // NaN taken last
  EXPECT_EQ(sel(7), (std::vector<int32_t>{0, 1, 2, 3, 4, -1, -1}));
  EXPECT_EQ(ref::topk({-kInf, kNaN}, 1, 2, {2}, 1), (std::vector<int32_t>{0}));
  EXPECT_EQ(ref::topk({5, 5}, 1, 2, {0}, 2), (std::vector<int32_t>{-1, -1}));
}

TEST(ReferenceTopk, SelectedDominateUnselected) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  const int64_t rows = 6, width = 300;
  const int k = 40;
  Vec logits(rows * width);
  for (double& x : logits) x = double(rng.randint(-20, 20));  // many ties
  const std::vector<int32_t> ctx = {0, 1, 39, 40, 41, 300};
  const auto out = ref::topk(logits, rows, width, ctx, k);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<bool> chosen(width, false);
    const int n = std::min(k, ctx[size_t(r)]);
    for (int j = 0; j < k; ++j) {
      const int32_t p = out[size_t(r * k + j)];
      if (j >= n) {
        EXPECT_EQ(p, -1);
        continue;
      }
      ASSERT_TRUE(p >= 0 && p < ctx[size_t(r)]);
      if (j > 0) {
        EXPECT_LT(out[size_t(r * k + j - 1)], p);  // ascending, distinct
      }
      chosen[size_t(p)] = true;
    }
    for (int a = 0; a < ctx[size_t(r)]; ++a)
      for (int b = 0; b < ctx[size_t(r)]; ++b)
        if (chosen[size_t(a)] && !chosen[size_t(b)]) {
          const double va = logits[size_t(r * width + a)], vb = logits[size_t(r * width + b)];
          ASSERT_TRUE(va > vb || (va == vb && a < b)) << "row " << r << ": " << a << " vs " << b;
        }
  }
}

// ---- projections ---------------------------------------------------------------------------

TEST(ReferenceProjections, ByHandAndAbsorptionIdentity) {
  // H = 2, d_nope = 1, d_v = 2, d_c = 2: per head one W_UK row, then two W_UV rows.
  const Vec w = {1, 2, /*uv*/ 1, 0, 0, 1, /*head 1*/ 3, -1, /*uv*/ 2, 2, -1, 1};
  const Vec q_nope = {10, 100};  // T = 1
  EXPECT_EQ(ref::absorb_q(q_nope, w, 1, 2, 1, 2, 2), (Vec{10, 20, 300, -100}));
  const Vec o_lat = {1, 2, 3, 4};
  EXPECT_EQ(ref::up_proj_v(o_lat, w, 1, 2, 1, 2, 2), (Vec{1, 2, 14, 1}));
  Vec k_nope, v;
  ref::up_proj_kv({5, 7}, w, 1, 2, 1, 2, 2, k_nope, v);
  EXPECT_EQ(k_nope, (Vec{19, 8}));
  EXPECT_EQ(v, (Vec{5, 7, 24, 2}));

  // q_abs · c == q_nope · k_nope for the real dims.
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  const int H = 3, d_nope = 192, d_v = 256, d_c = 512, N = 4;
  const Vec wr = random_vec(rng, size_t(H * (d_nope + d_v) * d_c), 0.05f);
  const Vec qn = random_vec(rng, size_t(H * d_nope));
  const Vec c = random_vec(rng, size_t(N * d_c));
  const Vec q_abs = ref::absorb_q(qn, wr, 1, H, d_nope, d_v, d_c);
  ref::up_proj_kv(c, wr, N, H, d_nope, d_v, d_c, k_nope, v);
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) {
      double lhs = 0, rhs = 0;
      for (int i = 0; i < d_c; ++i) lhs += q_abs[size_t(h * d_c + i)] * c[size_t(n * d_c + i)];
      for (int i = 0; i < d_nope; ++i)
        rhs += qn[size_t(h * d_nope + i)] * k_nope[size_t((n * H + h) * d_nope + i)];
      EXPECT_NEAR(lhs, rhs, 1e-9 * (1 + std::fabs(rhs)));
    }
}

// ---- attention -----------------------------------------------------------------------------

// A 1-head, d_qk = 2, d_v = 1 toy: key j = [score_j, value_j] with q = [1, 0] and sm_scale 1,
// so the logit of key j is its first value and the output is the mean of value_j by weight.
ref::Attention toy_sparse(const Vec& kv, const std::vector<int32_t>& indices,
                          const std::vector<int32_t>* topk_length = nullptr) {
  const int64_t T = topk_length ? int64_t(topk_length->size()) : 1;
  Vec q;
  for (int64_t t = 0; t < T; ++t) q.insert(q.end(), {1.0, 0.0});
  return ref::sparse_attention(q, kv, T, 1, 2, 1, int64_t(kv.size() / 2), indices,
                               int(indices.size() / T), topk_length, 1.0);
}

TEST(ReferenceAttention, OneKeyAndEqualKeys) {
  // d_v = 1 reads the first kv value: the logit itself.
  const auto one = toy_sparse({0.7, 5}, {0});
  EXPECT_EQ(one.o[0], 0.7);
  EXPECT_EQ(one.lse[0], 0.7);
  EXPECT_EQ(one.max_logit[0], 0.7);

  // Two keys with the same logit and different values: the average.
  const Vec q = {1, 0};
  const Vec kv = {0.3, 2, 0.3, 6};
  const auto two = ref::sparse_attention(q, kv, 1, 1, 2, 2, 2, {0, 1}, 2, nullptr, 1.0);
  EXPECT_DOUBLE_EQ(two.o[0], 0.3);
  EXPECT_DOUBLE_EQ(two.o[1], 4.0);
  EXPECT_DOUBLE_EQ(two.lse[0], 0.3 + std::log(2.0));
}

TEST(ReferenceAttention, KnownLogits) {
  // Logits ln 1, ln 2, ln 3: weights 1/6, 2/6, 3/6 and lse = ln 6.
  const Vec q = {1, 0};
  const Vec kv = {std::log(1.0), 6, std::log(2.0), 12, std::log(3.0), -6};
  const auto a = ref::sparse_attention(q, kv, 1, 1, 2, 2, 3, {2, 0, 1}, 3, nullptr, 1.0);
  EXPECT_NEAR(a.lse[0], std::log(6.0), 1e-15);
  EXPECT_NEAR(a.max_logit[0], std::log(3.0), 1e-15);
  EXPECT_NEAR(a.o[1], (6.0 + 2 * 12.0 - 3 * 6.0) / 6, 1e-14);
  // sm_scale multiplies the logits.
  const auto s = ref::sparse_attention(q, kv, 1, 1, 2, 2, 3, {2, 0, 1}, 3, nullptr, 2.0);
  EXPECT_NEAR(s.lse[0], std::log(1.0 + 4.0 + 9.0), 1e-14);
}

TEST(ReferenceAttention, InvalidSkippedDuplicatesCountPerSlot) {
  const Vec kv = {0.5, 0, -1.0, 0, 2.0, 0};
  const auto plain = toy_sparse(kv, {1});
  const auto noisy = toy_sparse(kv, {-1, 3, 1, 2147483647, -7});
  EXPECT_EQ(noisy.o, plain.o);
  EXPECT_EQ(noisy.lse, plain.lse);
  // Key 0 listed twice weighs twice: logits (0.5, 0.5, -1).
  const auto dup = toy_sparse(kv, {0, 0, 1});
  const double e0 = std::exp(0.5), e1 = std::exp(-1.0);
  EXPECT_NEAR(dup.lse[0], std::log(2 * e0 + e1), 1e-15);
  EXPECT_NEAR(dup.o[0], (2 * e0 * 0.5 + e1 * -1.0) / (2 * e0 + e1), 1e-15);
}

TEST(ReferenceAttention, EmptyQueryAndTopkLength) {
  const Vec kv = {0.5, 0, -1.0, 0, 2.0, 0};
  const auto none = toy_sparse(kv, {-1, 3});
  EXPECT_EQ(none.o[0], 0.0);
  EXPECT_EQ(none.lse[0], kInf);
  EXPECT_EQ(none.max_logit[0], -kInf);
  // Three queries, same slots {2, 0, 1}, reading 0, 1 and 3 of them.
  const std::vector<int32_t> lengths = {0, 1, 3};
  const auto tl = toy_sparse(kv, {2, 0, 1, 2, 0, 1, 2, 0, 1}, &lengths);
  EXPECT_EQ(tl.lse[0], kInf);
  EXPECT_EQ(tl.o[0], 0.0);
  EXPECT_EQ(tl.lse[1], 2.0);
  EXPECT_NEAR(tl.lse[2], std::log(std::exp(0.5) + std::exp(-1.0) + std::exp(2.0)), 1e-15);
}

TEST(ReferenceAttention, NaNStaysInItsQuery) {
  const Vec kv = {0.5, 1, kNaN, 0, 2.0, 3};
  const std::vector<int32_t> lengths = {3, 1};
  const auto a = toy_sparse(kv, {0, 1, 2, 0, 1, 2}, &lengths);
  EXPECT_TRUE(std::isnan(a.o[0]));
  EXPECT_TRUE(std::isnan(a.lse[0]));
  EXPECT_EQ(a.o[1], 0.5);
  EXPECT_EQ(a.lse[1], 0.5);
}

TEST(ReferenceAttention, DenseIsCausalWithPrefix) {
  // One head, d_qk = 1, q = 1, sm_scale 1: key p has logit k[p]; v[p] = p.
  // Request 0: no prefix, 2 new tokens; request 1: prefix 2, 1 new token (sees 3 rows).
  const Vec q = {1, 1, 1};
  const Vec k = {0.0, 1.0, /*r1*/ 0.5, 0.5, 0.5};
  const Vec v = {0, 1, 10, 20, 30};
  const auto a = ref::dense_attention(q, k, v, 1, 1, 1, {0, 2, 3}, {0, 2, 5}, 1.0);
  EXPECT_EQ(a.o[0], 0.0);  // sees only row 0
  EXPECT_EQ(a.lse[0], 0.0);
  EXPECT_NEAR(a.o[1], std::exp(1.0) / (1 + std::exp(1.0)), 1e-15);
  EXPECT_NEAR(a.o[2], 20.0, 1e-13);  // three equal logits: the mean
  EXPECT_NEAR(a.lse[2], 0.5 + std::log(3.0), 1e-15);
}

// Equivalence (docs/design.md#equivalence) at the reference level: with every visible position
// selected, absorbed sparse MLA over [c_kv, k_pe] followed by the V up-projection equals dense MHA
// over up-projected K/V.
struct PresetDims {
  const char* name;
  int d_nope, d_v;
  double sm_scale;
};

TEST(ReferenceAttention, SparseEqualsDenseWhenEveryPositionIsSelected) {
  const double mscale_v32 = 0.1 * std::log(40.0) + 1;
  const PresetDims presets[] = {
      {"deepseek-v3.2", 128, 128, mscale_v32 * mscale_v32 / std::sqrt(192.0)},
      {"glm-5", 192, 256, 1 / std::sqrt(256.0)},
  };
  const int H = 4, d_c = 512, d_rope = 64;
  // Requests (prefix, extend).
  const std::vector<std::pair<int, int>> reqs = {{0, 5}, {7, 3}, {2, 4}};
  std::vector<int32_t> cu_q = {0}, cu_kv = {0};
  for (auto [p, e] : reqs) {
    cu_q.push_back(cu_q.back() + e);
    cu_kv.push_back(cu_kv.back() + p + e);
  }
  const int64_t T = cu_q.back(), N = cu_kv.back();
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);

  for (const PresetDims& cfg : presets) {
    SCOPED_TRACE(cfg.name);
    const int d_nope = cfg.d_nope, d_v = cfg.d_v, d_qk = d_nope + d_rope;
    const Vec w = random_vec(rng, size_t(H * (d_nope + d_v) * d_c), 0.05f);
    const Vec q_nope = random_vec(rng, size_t(T * H * d_nope));
    const Vec q_pe = random_vec(rng, size_t(T * H * d_rope));
    const Vec c_kv = random_vec(rng, size_t(N * d_c));
    const Vec k_pe = random_vec(rng, size_t(N * d_rope));

    // Sparse: q576 = [q_abs, q_pe], kv576 = [c_kv, k_pe]; indices list each visible row in a
    // shuffled order with invalid entries mixed in.
    const Vec q_abs = ref::absorb_q(q_nope, w, T, H, d_nope, d_v, d_c);
    Vec q576(size_t(T * H * (d_c + d_rope))), kv576(size_t(N * (d_c + d_rope)));
    for (int64_t th = 0; th < T * H; ++th) {
      std::copy_n(&q_abs[size_t(th * d_c)], d_c, &q576[size_t(th * (d_c + d_rope))]);
      std::copy_n(&q_pe[size_t(th * d_rope)], d_rope, &q576[size_t(th * (d_c + d_rope) + d_c)]);
    }
    for (int64_t n = 0; n < N; ++n) {
      std::copy_n(&c_kv[size_t(n * d_c)], d_c, &kv576[size_t(n * (d_c + d_rope))]);
      std::copy_n(&k_pe[size_t(n * d_rope)], d_rope, &kv576[size_t(n * (d_c + d_rope) + d_c)]);
    }
    const int k = 16;
    std::vector<int32_t> indices(size_t(T * k), -1);
    for (size_t r = 0; r < reqs.size(); ++r)
      for (int i = 0; i < reqs[r].second; ++i) {
        const int64_t t = cu_q[r] + i;
        std::vector<int32_t> slots;
        for (int p = 0; p <= reqs[r].first + i; ++p) slots.push_back(cu_kv[r] + p);
        slots.push_back(int32_t(N));  // out of range
        slots.push_back(-1);
        std::shuffle(slots.begin(), slots.end(), rng.gen());
        ASSERT_LE(slots.size(), size_t(k));
        std::copy(slots.begin(), slots.end(), indices.begin() + t * k);
      }
    const auto sparse = ref::sparse_attention(q576, kv576, T, H, d_c + d_rope, d_c, N, indices, k,
                                              nullptr, cfg.sm_scale);
    const Vec o_sparse = ref::up_proj_v(sparse.o, w, T, H, d_nope, d_v, d_c);

    // Dense: q = [q_nope, q_pe], k = [k_nope, k_pe] per head, v up-projected.
    Vec k_nope, v;
    ref::up_proj_kv(c_kv, w, N, H, d_nope, d_v, d_c, k_nope, v);
    Vec q(size_t(T * H * d_qk)), kk(size_t(N * H * d_qk));
    for (int64_t th = 0; th < T * H; ++th) {
      std::copy_n(&q_nope[size_t(th * d_nope)], d_nope, &q[size_t(th * d_qk)]);
      std::copy_n(&q_pe[size_t(th * d_rope)], d_rope, &q[size_t(th * d_qk + d_nope)]);
    }
    for (int64_t nh = 0; nh < N * H; ++nh) {
      std::copy_n(&k_nope[size_t(nh * d_nope)], d_nope, &kk[size_t(nh * d_qk)]);
      std::copy_n(&k_pe[size_t(nh / H * d_rope)], d_rope, &kk[size_t(nh * d_qk + d_nope)]);
    }
    const auto dense = ref::dense_attention(q, kk, v, H, d_qk, d_v, cu_q, cu_kv, cfg.sm_scale);

    EXPECT_LE(testing::rel_l2(o_sparse, dense.o), 1e-12);
    EXPECT_LE(testing::max_abs_diff(sparse.lse, dense.lse), 1e-10);
    EXPECT_LE(testing::max_abs_diff(sparse.max_logit, dense.max_logit), 1e-10);
    // Non-trivial softmax: logits spread over more than a unit.
    const double spread = *std::max_element(dense.max_logit.begin(), dense.max_logit.end()) -
                          *std::min_element(dense.max_logit.begin(), dense.max_logit.end());
    EXPECT_GT(spread, 1.0);

    // A selection as kv_mask: each query keeps a random half of its positions (query 0 none:
    // lse +inf, o 0 on both sides), sparse over the kept rows alone.
    std::vector<uint32_t> mask(size_t(T), 0u);  // one word: every request is < 32 rows
    std::vector<int32_t> half(size_t(T * k), -1);
    for (size_t r = 0; r < reqs.size(); ++r)
      for (int i = 0; i < reqs[r].second; ++i) {
        const int64_t t = cu_q[r] + i;
        for (int p = 0, slot = 0; p <= reqs[r].first + i; ++p)
          if (t > 0 && rng.randint(0, 1) == 1) {
            mask[size_t(t)] |= 1u << p;
            half[size_t(t * k + slot++)] = cu_kv[r] + p;
          }
      }
    const auto sparse_half = ref::sparse_attention(q576, kv576, T, H, d_c + d_rope, d_c, N, half, k,
                                                   nullptr, cfg.sm_scale);
    const auto masked =
        ref::dense_attention(q, kk, v, H, d_qk, d_v, cu_q, cu_kv, cfg.sm_scale, &mask, 1);
    EXPECT_LE(testing::rel_l2(ref::up_proj_v(sparse_half.o, w, T, H, d_nope, d_v, d_c), masked.o),
              1e-12);
    for (int h = 0; h < H; ++h) EXPECT_EQ(masked.lse[size_t(h)], kInf) << "query 0 keeps none";
    for (size_t i = size_t(H); i < masked.lse.size(); ++i)
      if (std::isfinite(sparse_half.lse[i]))
        EXPECT_NEAR(sparse_half.lse[i], masked.lse[i], 1e-10) << i;
      else
        EXPECT_EQ(sparse_half.lse[i], masked.lse[i]) << i;
    EXPECT_NE(testing::rel_l2(masked.o, dense.o), 0.0) << "the mask changed nothing";
  }
}

TEST(ReferenceToVec, EveryDType) {
  Tensor b = Tensor::host(DType::kBF16, {2});
  b.ptr<bf16_t>()[0] = f32_to_bf16(1.5f);
  b.ptr<bf16_t>()[1] = f32_to_bf16(-3.0f);
  EXPECT_EQ(ref::to_vec(b), (Vec{1.5, -3.0}));
  Tensor f = Tensor::host(DType::kF32, {1});
  f.ptr<float>()[0] = 0.1f;
  EXPECT_EQ(ref::to_vec(f), (Vec{double(0.1f)}));
  Tensor i = Tensor::host(DType::kI32, {1});
  i.ptr<int32_t>()[0] = -7;
  EXPECT_EQ(ref::to_vec(i), (Vec{-7}));
  Tensor u = Tensor::host(DType::kU8, {1});
  u.ptr<uint8_t>()[0] = 200;
  EXPECT_EQ(ref::to_vec(u), (Vec{200}));
  Tensor d = Tensor::host(DType::kF64, {1});
  d.ptr<double>()[0] = 0.1;
  EXPECT_EQ(ref::to_vec(d), (Vec{0.1}));
}

// A misused reference call fails with an Error naming the argument, never reads out of bounds.
void expect_invalid_naming(const std::function<void()>& fn, const std::string& name) {
  testing::expect_error_naming(fn, name, ErrorKind::kInvalidArgument);
}

TEST(ReferenceErrors, WrongSizesNameTheArgument) {
  const Vec kv = {0.5, 0, -1.0, 0};
  expect_invalid_naming(
      [&] {
        ref::sparse_attention({1, 0, 0}, kv, 1, 1, 2, 1, 2, {0}, 1, nullptr, 1);
      },
      "q");
  expect_invalid_naming(
      [&] {
        ref::sparse_attention({1, 0}, kv, 1, 1, 2, 1, 2, {0, 1}, 1, nullptr, 1);
      },
      "indices");
  const std::vector<int32_t> lengths = {1, 1};
  expect_invalid_naming(
      [&] {
        ref::sparse_attention({1, 0}, kv, 1, 1, 2, 1, 2, {0}, 1, &lengths, 1);
      },
      "topk_length");
  expect_invalid_naming(
      [&] {
        ref::dense_attention({1}, {1}, {1}, 1, 1, 1, {0, 2}, {0, 1}, 1);
      },
      "extend");
  expect_invalid_naming([&] { ref::topk({1, 2}, 1, 2, {3}, 1); }, "ctx_len[0]");
  expect_invalid_naming([&] { ref::indexer_logits({1}, {1}, {1}, {1}, 1, 1, 1, {5}, {0}, {1}, 1); },
                        "kv_locs[0]");
  expect_invalid_naming([&] { ref::absorb_q({1, 2}, {1}, 1, 1, 1, 1, 1); }, "q_nope");
  Tensor strided = Tensor::host(DType::kF32, {2, 2});
  TensorView column = strided.view();
  column.shape[1] = 1;  // a column view of a [2, 2] tensor: not contiguous
  expect_invalid_naming([&] { ref::to_vec(column); }, "to_vec");
}

}  // namespace
}  // namespace dsakit
