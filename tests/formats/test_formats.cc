// Number formats (include/dsakit/formats.h) against the independent float64 reference
// (src/reference): exhaustive over every e4m3 and bf16 code, and millions of random fp32
// inputs drawn to hit rounding ties, subnormals, the saturation boundary and non-finite values.
#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include "dsakit/formats.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::Rng;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

bool is_e4m3_nan(uint8_t code) {
  return (code & 0x7F) == 0x7F;
}
bool is_bf16_nan(uint16_t bits) {
  return (bits & 0x7F80) == 0x7F80 && (bits & 0x007F) != 0;
}

// Exact smallest power of two >= v (v > 0, finite), in double arithmetic.
double exact_pow2_ceil(double v) {
  int e = 0;
  const double m = std::frexp(v, &e);  // v = m * 2^e, m in [0.5, 1)
  return m == 0.5 ? v : std::ldexp(1.0, e);
}

// ---- the fp32 inputs of the random tests -------------------------------------------------

// Any fp32 bit pattern: covers NaN payloads, ±inf, subnormals and every exponent.
float random_bits(Rng& rng) {
  return f32_from_bits(uint32_t(rng.randint(0, 0xFFFFFFFFll)));
}

float random_sign(Rng& rng, float x) {
  return rng.randint(0, 1) ? -x : x;
}

// Magnitude log-uniform over [2^lo, 2^hi), random sign.
float log_uniform(Rng& rng, int lo, int hi) {
  return random_sign(rng, std::exp2(rng.uniform(float(lo), float(hi))));
}

// Exactly halfway between two adjacent finite e4m3 values, or one fp32 ulp either side of it.
float e4m3_tie(Rng& rng) {
  const uint8_t c = uint8_t(rng.randint(0, 0x7D));
  const float mid = 0.5f * (e4m3_to_f32(c) + e4m3_to_f32(uint8_t(c + 1)));  // exact in fp32
  const int64_t nudge = rng.randint(-1, 1);
  const float x = nudge == 0 ? mid : std::nextafter(mid, nudge > 0 ? kInf : 0.0f);
  return random_sign(rng, x);
}

// Halfway between two adjacent finite bf16 values (or one fp32 ulp either side of it).
float bf16_tie(Rng& rng) {
  const uint16_t b = uint16_t(rng.randint(0, 0x7F7E));
  const float lo = bf16_to_f32(bf16_t{b}), hi = bf16_to_f32(bf16_t{uint16_t(b + 1)});
  const float mid = f32_from_bits((f32_bits(lo) + f32_bits(hi)) / 2);  // exact midpoint
  const int64_t nudge = rng.randint(-1, 1);
  const float x = nudge == 0 ? mid : std::nextafter(mid, nudge > 0 ? kInf : 0.0f);
  return random_sign(rng, x);
}

// Inputs for the e4m3 encoder: a mix of every hard case.
std::vector<float> e4m3_inputs(Rng& rng, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) {
    switch (rng.randint(0, 7)) {
      case 0:
        v = random_bits(rng);
        break;
      case 1:
        v = e4m3_tie(rng);
        break;
      case 2:
        v = random_sign(rng, rng.uniform(0.0f, 0x1p-6f));
        break;  // e4m3 subnormals
      case 3:
        v = random_sign(rng, rng.uniform(416.0f, 500.0f));
        break;  // near 448 / 464
      case 4:
        v = log_uniform(rng, 60, 128);
        break;  // huge
      case 5:
        v = log_uniform(rng, -149, -10);
        break;  // far below 2^-9
      default:
        v = log_uniform(rng, -10, 9);
        break;  // the e4m3 range
    }
  }
  return x;
}

std::vector<float> bf16_inputs(Rng& rng, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) {
    switch (rng.randint(0, 4)) {
      case 0:
        v = random_bits(rng);
        break;
      case 1:
        v = bf16_tie(rng);
        break;
      case 2:
        v = log_uniform(rng, -149, -126);
        break;  // fp32 subnormals
      case 3:
        v = random_sign(rng, rng.uniform(0x1.fcp127f, FLT_MAX));
        break;  // near overflow
      default:
        v = log_uniform(rng, -30, 30);
        break;
    }
  }
  return x;
}

// ---- e4m3 ---------------------------------------------------------------------------------

TEST(E4m3, EveryCodeDecodesAsTheReference) {
  for (int c = 0; c < 256; ++c) {
    SCOPED_TRACE(c);
    const float v = e4m3_to_f32(uint8_t(c));
    const double ref = reference::e4m3_value(uint8_t(c));
    if (is_e4m3_nan(uint8_t(c))) {
      EXPECT_TRUE(std::isnan(v));
      EXPECT_TRUE(std::isnan(ref));
      continue;
    }
    EXPECT_EQ(double(v), ref);
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0);  // including -0 for 0x80
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(e4m3_to_f32(0x08), 0x1p-6f);
}

TEST(E4m3, EncodeOfDecodeIsIdentityAndSignSymmetric) {
  for (int c = 0; c < 256; ++c) {
    SCOPED_TRACE(c);
    const uint8_t code = uint8_t(c);
    const float v = e4m3_to_f32(code);
    if (is_e4m3_nan(code)) {
      EXPECT_EQ(f32_to_e4m3(v), code);  // NaN keeps its sign: 0x7F | sign
      continue;
    }
    EXPECT_EQ(f32_to_e4m3(v), code);
    EXPECT_EQ(f32_to_e4m3(-v), uint8_t(code ^ 0x80));
    EXPECT_EQ(e4m3_to_f32(uint8_t(code ^ 0x80)), -v);
  }
}

TEST(E4m3, ValuesIncreaseWithTheCode) {
  for (int c = 0; c < 0x7E; ++c) EXPECT_LT(e4m3_to_f32(uint8_t(c)), e4m3_to_f32(uint8_t(c + 1)));
}

TEST(E4m3, SaturationAndNonFinite) {
  struct Case {
    float x;
    uint8_t code;
  };
  const Case cases[] = {
      {448.0f, 0x7E},    {447.0f, 0x7E},    {463.99f, 0x7E},    {464.0f, 0x7E},
      {465.0f, 0x7E},    {1e10f, 0x7E},     {FLT_MAX, 0x7E},    {kInf, 0x7E},
      {-kInf, 0xFE},     {-FLT_MAX, 0xFE},  {-500.0f, 0xFE},    {416.0f, 0x7D},
      {0.0f, 0x00},      {-0.0f, 0x80},     {0x1p-10f, 0x00},   {0x1.01p-10f, 0x01},
      {0x1.8p-9f, 0x02}, {0x1p-149f, 0x00}, {-0x1p-149f, 0x80}, {kNaN, 0x7F},
      {-kNaN, 0xFF},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.x);
    EXPECT_EQ(f32_to_e4m3(c.x), c.code);
  }
}

TEST(E4m3, RandomFp32MatchesTheReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  const std::vector<float> x = e4m3_inputs(rng, int64_t(1) << 21);
  int64_t mismatches = 0;
  for (float v : x) {
    const uint8_t got = f32_to_e4m3(v), want = reference::e4m3_encode(double(v));
    if (got != want && mismatches++ < 10)
      ADD_FAILURE() << "x = " << v << " (bits 0x" << std::hex << f32_bits(v) << "): got 0x"
                    << int(got) << ", reference 0x" << int(want) << std::dec;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(E4m3, QuantizeDividesInFp32) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const float x = log_uniform(rng, -20, 20), s = std::exp2(rng.uniform(-20.0f, 20.0f));
    ASSERT_EQ(quantize_e4m3(x, s), reference::e4m3_encode(double(x / s))) << x << " / " << s;
  }
}

// ---- bf16 ---------------------------------------------------------------------------------

TEST(Bf16, EveryCodeRoundTrips) {
  for (int b = 0; b < 65536; ++b) {
    SCOPED_TRACE(b);
    const float v = bf16_to_f32(bf16_t{uint16_t(b)});
    const uint16_t back = f32_to_bf16(v).bits;
    if (is_bf16_nan(uint16_t(b))) {
      EXPECT_TRUE(std::isnan(v));
      EXPECT_TRUE(is_bf16_nan(back));
      EXPECT_EQ(back & 0x8000, b & 0x8000);
      continue;
    }
    EXPECT_EQ(back, b);
    EXPECT_EQ(reference::bf16_round(double(v)), double(v));
  }
}

TEST(Bf16, RandomFp32MatchesTheReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  const std::vector<float> x = bf16_inputs(rng, int64_t(1) << 21);
  int64_t mismatches = 0;
  for (float v : x) {
    const uint16_t got = f32_to_bf16(v).bits;
    if (std::isnan(v)) {
      if ((!is_bf16_nan(got) || std::signbit(v) != bool(got & 0x8000)) && mismatches++ < 10)
        ADD_FAILURE() << "NaN 0x" << std::hex << f32_bits(v) << " became 0x" << got << std::dec;
      continue;
    }
    const double want = reference::bf16_round(double(v));
    const double have = double(bf16_to_f32(bf16_t{got}));
    const bool same = have == want && std::signbit(have) == std::signbit(want);
    if (!same && mismatches++ < 10)
      ADD_FAILURE() << "x = " << v << " (bits 0x" << std::hex << f32_bits(v) << std::dec
                    << "): got " << have << ", reference " << want;
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Bf16, NonFiniteAndOverflow) {
  EXPECT_EQ(f32_to_bf16(kInf).bits, 0x7F80);
  EXPECT_EQ(f32_to_bf16(-kInf).bits, 0xFF80);
  EXPECT_EQ(f32_to_bf16(FLT_MAX).bits, 0x7F80);  // above the largest bf16 + half an ulp
  EXPECT_EQ(f32_to_bf16(0x1.fep127f).bits, 0x7F7F);
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16(kNaN).bits));
  EXPECT_TRUE(is_bf16_nan(f32_to_bf16(f32_from_bits(0x7F800001u)).bits));  // sNaN stays NaN
  EXPECT_EQ(f32_to_bf16(-0.0f).bits, 0x8000);
}

// ---- scales -------------------------------------------------------------------------------

TEST(Scales, Pow2CeilIsTheExactSmallestPowerOfTwo) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int e = -126; e <= 127; ++e) EXPECT_EQ(pow2_ceil(std::ldexp(1.0f, e)), std::ldexp(1.0f, e));
  for (int i = 0; i < 200000; ++i) {
    float v = std::exp2(rng.uniform(-125.0f, 126.0f));
    if (i % 4 == 0) v = std::nextafter(pow2_ceil(v), kInf);  // one ulp above a power of two
    ASSERT_EQ(double(pow2_ceil(v)), exact_pow2_ceil(double(v))) << v;
  }
}

TEST(Scales, AmaxPolicy) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::exp2(rng.uniform(-30.0f, 30.0f));
    const float s = fp8_tile_scale(amax, ScalePolicy::kAmax);
    ASSERT_EQ(double(s), double(float(double(amax) / 448.0))) << amax;
    ASSERT_EQ(quantize_e4m3(amax, s), 0x7E) << amax;  // the tile's largest value maps to 448
  }
  // amax = 0 (an all-zero tile): the FLT_MIN floor keeps x / s and code * s finite.
  const float s0 = fp8_tile_scale(0.0f, ScalePolicy::kAmax);
  EXPECT_EQ(s0, FLT_MIN);
  EXPECT_EQ(quantize_e4m3(0.0f, s0), 0x00);
  EXPECT_EQ(e4m3_to_f32(quantize_e4m3(0.0f, s0)) * s0, 0.0f);
  EXPECT_EQ(fp8_tile_scale(1e-40f, ScalePolicy::kAmax), FLT_MIN);
}

TEST(Scales, Pow2Policy) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::exp2(rng.uniform(-30.0f, 30.0f));
    const float s = fp8_tile_scale(amax, ScalePolicy::kPow2);
    const double want = exact_pow2_ceil(std::max(double(amax) / 448.0, double(1e-4f)));
    ASSERT_EQ(double(s), want) << amax;
    ASSERT_LE(std::fabs(e4m3_to_f32(quantize_e4m3(amax, s))), 448.0f);
  }
  // The 1e-4 floor: an all-zero tile gets 2^-13, as FlashMLA's quantizer does.
  EXPECT_EQ(fp8_tile_scale(0.0f, ScalePolicy::kPow2), 0x1p-13f);
  EXPECT_EQ(fp8_tile_scale(448.0f, ScalePolicy::kPow2), 1.0f);
  EXPECT_EQ(fp8_tile_scale(std::nextafter(448.0f, kInf), ScalePolicy::kPow2), 2.0f);
}

TEST(Scales, IndexerScale) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int i = 0; i < 100000; ++i) {
    const float amax = std::exp2(rng.uniform(-30.0f, 30.0f));
    const float s = indexer_fp8_scale(amax);
    const double want = exact_pow2_ceil(double(std::max(amax, 1e-4f)) / 448.0);
    ASSERT_EQ(double(s), want) << amax;
  }
  EXPECT_EQ(indexer_fp8_scale(0.0f), 0x1p-22f);  // 1e-4 / 448 = 2.23e-7 -> 2^-22
  EXPECT_EQ(indexer_fp8_scale(448.0f), 1.0f);
}

}  // namespace
}  // namespace dsakit
