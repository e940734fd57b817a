// Paged KV pool kernels (store_kv, gather_kv, store_index_keys) through the Backend interface,
// against the float64 reference's row codecs; typed layouts; bad input; and the host-side
// batch bookkeeping (Batch::validate, BatchIndex::build). Contracts: docs/formats.md,
// docs/reliability.md, docs/numerics.md.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/error.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::Rng;

constexpr int kDc = 512, kDrope = 64, kDi = 128;
constexpr int kPageSizes[] = {1, 16, 64};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Every latent layout and scale policy a pool can be created with (k_scale for fp8-raw).
struct LayoutCase {
  KvLayout layout;
  ScalePolicy policy;
  float k_scale;
};
constexpr LayoutCase kLayoutCases[] = {
    {KvLayout::kBf16, ScalePolicy::kAmax, 1.0f},
    {KvLayout::kFp8Scaled, ScalePolicy::kAmax, 1.0f},
    {KvLayout::kFp8Scaled, ScalePolicy::kPow2, 1.0f},
    {KvLayout::kFp8Raw, ScalePolicy::kAmax, 1.0f},
    {KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.0371f},
};

KvPoolDesc pool_desc(const LayoutCase& c, int page_size, int64_t min_locations) {
  KvPoolDesc d;
  d.layout = c.layout;
  d.scale_policy = c.policy;
  d.k_scale = c.k_scale;
  d.page_size = page_size;
  d.num_pages = (min_locations + page_size - 1) / page_size + 1;
  d.d_c = kDc;
  d.d_rope = kDrope;
  return d;
}

std::string describe(const KvPoolDesc& d) {
  return d.summary();
}

// ---- host data ----------------------------------------------------------------------------

Tensor i32_tensor(const std::vector<int32_t>& v) {
  Tensor t = Tensor::host(DType::kI32, {int64_t(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<int32_t>());
  return t;
}

// n distinct locations in [0, num_locations), in random order.
std::vector<int32_t> distinct_locations(Rng& rng, int64_t n, int64_t num_locations) {
  std::vector<int32_t> all(static_cast<size_t>(num_locations));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng.gen());
  all.resize(static_cast<size_t>(n));
  return all;
}

// bf16 [n, width] whose 64-value blocks have very different magnitudes: zero, tiny (under the
// pow2 clamp), near the clamp, randn, randn·50, randn with one ~3e3 outlier.
Tensor mixed_magnitudes(Rng& rng, int64_t n, int width) {
  static constexpr float kFactor[] = {0.0f, 1e-6f, 0.015f, 1.0f, 50.0f, 1.0f};
  Tensor t = Tensor::host(DType::kBF16, {n, width});
  bf16_t* x = t.ptr<bf16_t>();
  for (int64_t block = 0; block < n * width / 64; ++block) {
    const int64_t kind = rng.randint(0, 5);
    for (int i = 0; i < 64; ++i) x[block * 64 + i] = f32_to_bf16(rng.normal() * kFactor[kind]);
    if (kind == 5) x[block * 64 + rng.randint(0, 63)] = f32_to_bf16(rng.uniform(-3.1e3f, 3.1e3f));
  }
  return t;
}

struct Tokens {
  Tensor c_kv;  // bf16 [n, d_c]
  Tensor k_pe;  // bf16 [n, d_rope]
  int64_t size() const { return c_kv.size(0); }
  float c(int64_t i, int j) const { return bf16_to_f32(c_kv.ptr<bf16_t>()[i * kDc + j]); }
  float r(int64_t i, int j) const { return bf16_to_f32(k_pe.ptr<bf16_t>()[i * kDrope + j]); }
  void set_c(int64_t i, int j, float v) { c_kv.ptr<bf16_t>()[i * kDc + j] = f32_to_bf16(v); }
};

// fp8-raw stores x / k_scale unscaled per tile, so its tokens stay inside e4m3's range.
Tokens random_tokens(Rng& rng, int64_t n, KvLayout layout) {
  if (layout == KvLayout::kFp8Raw)
    return {testing::random_tensor(rng, DType::kBF16, {n, kDc}),
            testing::random_tensor(rng, DType::kBF16, {n, kDrope})};
  return {mixed_magnitudes(rng, n, kDc), mixed_magnitudes(rng, n, kDrope)};
}

Tokens constant_tokens(int64_t n, float value) {
  Tokens t{Tensor::host(DType::kBF16, {n, kDc}), Tensor::host(DType::kBF16, {n, kDrope})};
  std::fill_n(t.c_kv.ptr<bf16_t>(), n * kDc, f32_to_bf16(value));
  std::fill_n(t.k_pe.ptr<bf16_t>(), n * kDrope, f32_to_bf16(value));
  return t;
}

std::vector<uint8_t> reference_row(const KvPoolDesc& d, const Tokens& tok, int64_t i) {
  std::vector<double> c(kDc), r(kDrope);
  for (int j = 0; j < kDc; ++j) c[size_t(j)] = tok.c(i, j);
  for (int j = 0; j < kDrope; ++j) r[size_t(j)] = tok.r(i, j);
  return reference::encode_kv_row(d.row(), c.data(), r.data(), d.scale_policy, d.k_scale);
}

float load_le_f32(const uint8_t* p) {
  const uint32_t u =
      uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
  return f32_from_bits(u);
}

uint16_t load_le_u16(const uint8_t* p) {
  return uint16_t(p[0] | p[1] << 8);
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

// ---- a pool on one backend ------------------------------------------------------------------

class PoolFixture {
 public:
  PoolFixture(Backend& be, const KvPoolDesc& desc) : be_(be), pool_(be.make_kv_pool(desc)) {}

  PagedKvPool& pool() { return pool_; }
  const KvPoolDesc& desc() const { return pool_.desc(); }

  void store(const std::vector<int32_t>& locs, const Tokens& tok) {
    be_.store_kv(pool_, be_.to_device(i32_tensor(locs)), be_.to_device(tok.c_kv),
                 be_.to_device(tok.k_pe));
  }

  // Gathers into poisoned outputs of the given dtypes; returns host c_kv, k_pe.
  std::pair<Tensor, Tensor> gather(const std::vector<int32_t>& locs, DType c_dtype = DType::kF32,
                                   DType r_dtype = DType::kF32) {
    const int64_t n = int64_t(locs.size());
    Tensor c = be_.empty(c_dtype, {n, kDc}), r = be_.empty(r_dtype, {n, kDrope});
    be_.poison(c);
    be_.poison(r);
    be_.gather_kv(pool_, be_.to_device(i32_tensor(locs)), c, r);
    return {be_.to_host(c), be_.to_host(r)};
  }

  Tensor bytes() { return be_.to_host(pool_.storage()); }
  const uint8_t* row(const Tensor& bytes, int64_t loc) const {
    return bytes.ptr<const uint8_t>() + loc * desc().bytes_per_token();
  }

 private:
  Backend& be_;
  PagedKvPool pool_;
};

// For each backend under test.
void for_each_backend(const std::function<void(Backend&)>& body) {
  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE("backend " + name);
    auto be = make_backend(name);
    body(*be);
  }
}

// The values gather must return for one stored row: the reference decoder's exact product,
// rounded once to fp32 (as the kernel multiplies in fp32) and, for bf16 outputs, to bf16.
void expect_gathered_row(const KvPoolDesc& d, const uint8_t* row, const Tensor& c, const Tensor& r,
                         int64_t i) {
  std::vector<double> ref_c(kDc), ref_r(kDrope);
  reference::decode_kv_row(d.row(), row, d.k_scale, ref_c.data(), ref_r.data());
  auto check = [&](const Tensor& out, const std::vector<double>& ref, int width, const char* what) {
    for (int j = 0; j < width; ++j) {
      const float want = float(ref[size_t(j)]);
      const float got = load_as_float(out, i * width + j);
      const float want_out = out.dtype() == DType::kBF16 ? round_bf16(want) : want;
      ASSERT_TRUE(same_float(got, want_out))
          << what << "[" << i << ", " << j << "]: got " << got << ", reference " << want_out;
    }
  };
  check(c, ref_c, kDc, "c_kv");
  check(r, ref_r, kDrope, "k_pe");
}

// Largest error of one e4m3 value stored with scale s: half a step, i.e. 2^-4 relative in the
// normal range and s·2^-10 absolute in the subnormal range (|x / s| < 2^-6).
double e4m3_error_bound(double x, double s) {
  return std::max(0x1p-4 * std::fabs(x), s * 0x1p-10);
}

// Quantization error of one stored token against its bf16 input, bounded by the format:
// bf16 exact; fp8 per value by e4m3_error_bound with the tile's scale, and per 128-tile
// rel. L2 <= 2^-4 unless the pow2 clamp (1e-4) set the scale; fp8-raw per value with k_scale.
void expect_format_error(const KvPoolDesc& d, const Tokens& tok, int64_t i, const Tensor& c,
                         const Tensor& r, int64_t out_row) {
  auto got_c = [&](int j) { return double(load_as_float(c, out_row * kDc + j)); };
  auto got_r = [&](int j) { return double(load_as_float(r, out_row * kDrope + j)); };
  if (d.layout != KvLayout::kFp8Raw) {
    for (int j = 0; j < kDrope; ++j) ASSERT_EQ(got_r(j), tok.r(i, j)) << "k_pe " << j;
  }
  switch (d.layout) {
    case KvLayout::kBf16:
      for (int j = 0; j < kDc; ++j) ASSERT_EQ(got_c(j), tok.c(i, j)) << "c_kv " << j;
      return;
    case KvLayout::kFp8Scaled:
      for (int tile = 0; tile < kDc / kFp8TileSize; ++tile) {
        double err = 0, norm = 0, amax = 0;
        for (int j = tile * kFp8TileSize; j < (tile + 1) * kFp8TileSize; ++j)
          amax = std::max(amax, std::fabs(double(tok.c(i, j))));
        const double floor = d.scale_policy == ScalePolicy::kPow2 ? 1e-4 : 0.0;
        const double s = std::max(amax / 448, floor) * 2;  // >= the scale under either policy
        SCOPED_TRACE("tile " + std::to_string(tile) + ", amax " + std::to_string(amax));
        for (int j = tile * kFp8TileSize; j < (tile + 1) * kFp8TileSize; ++j) {
          const double x = tok.c(i, j), e = got_c(j) - x;
          ASSERT_LE(std::fabs(e), e4m3_error_bound(x, s)) << "value " << j << " = " << x;
          err += e * e;
          norm += x * x;
        }
        if (norm == 0) {
          ASSERT_EQ(err, 0.0);
        } else if (amax / 448 >= floor) {
          ASSERT_LE(std::sqrt(err / norm), 0x1p-4);
        }
      }
      return;
    case KvLayout::kFp8Raw:
      for (int j = 0; j < kDc + kDrope; ++j) {
        const double x = j < kDc ? tok.c(i, j) : tok.r(i, j - kDc);
        const double got = j < kDc ? got_c(j) : got_r(j - kDc);
        ASSERT_LE(std::fabs(got - x), e4m3_error_bound(x, d.k_scale)) << j;
      }
      return;
  }
}

// ---- store / gather ---------------------------------------------------------------------

TEST(KvPool, StoreMatchesReferenceBytesAndGatherDequantizesExactly) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      for (int page_size : kPageSizes) {
        const int64_t n = 48;
        PoolFixture f(be, pool_desc(lc, page_size, 3 * n));
        SCOPED_TRACE(describe(f.desc()));
        const Tokens tok = random_tokens(rng, n, lc.layout);
        const std::vector<int32_t> locs = distinct_locations(rng, n, f.desc().num_locations());
        f.store(locs, tok);

        const Tensor bytes = f.bytes();
        const int row_bytes = f.desc().bytes_per_token();
        std::vector<bool> written(size_t(f.desc().num_locations()), false);
        for (int64_t i = 0; i < n; ++i) {
          written[size_t(locs[size_t(i)])] = true;
          const std::vector<uint8_t> want = reference_row(f.desc(), tok, i);
          ASSERT_EQ(0, std::memcmp(f.row(bytes, locs[size_t(i)]), want.data(), want.size()))
              << "row of token " << i << " at location " << locs[size_t(i)];
        }
        for (int64_t loc = 0; loc < f.desc().num_locations(); ++loc) {
          if (written[size_t(loc)]) continue;
          const uint8_t* p = f.row(bytes, loc);
          ASSERT_TRUE(std::all_of(p, p + row_bytes, [](uint8_t b) { return b == 0; }))
              << "location " << loc << " was not stored to but changed";
        }

        // Read back in another order, with one location twice, in every output dtype.
        std::vector<int32_t> order(locs.rbegin(), locs.rend());
        order.push_back(locs[0]);
        std::vector<int64_t> token_of(order.size());
        for (size_t k = 0; k < order.size(); ++k)
          token_of[k] = std::find(locs.begin(), locs.end(), order[k]) - locs.begin();
        for (DType dt : {DType::kF32, DType::kBF16}) {
          auto [c, r] = f.gather(order, dt, dt);
          for (size_t k = 0; k < order.size(); ++k) {
            expect_gathered_row(f.desc(), f.row(bytes, order[k]), c, r, int64_t(k));
            if (dt == DType::kF32)
              expect_format_error(f.desc(), tok, token_of[k], c, r, int64_t(k));
          }
        }
        if (page_size == 64) {
          // Whole-tensor store -> gather error, for the record.
          auto [c, r] = f.gather(locs);
          std::cout << "[ measure ] " << be.capabilities().device_name << " " << describe(f.desc())
                    << ": c_kv rel-L2 "
                    << testing::rel_l2(testing::to_double(c), testing::to_double(tok.c_kv))
                    << ", k_pe rel-L2 "
                    << testing::rel_l2(testing::to_double(r), testing::to_double(tok.k_pe)) << "\n";
        }
      }
    }
  });
}

TEST(KvPool, GatherMixedOutputDtypes) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    PoolFixture f(be, pool_desc(kLayoutCases[1], 16, 64));
    const Tokens tok = random_tokens(rng, 8, KvLayout::kFp8Scaled);
    const std::vector<int32_t> locs = distinct_locations(rng, 8, 64);
    f.store(locs, tok);
    const Tensor bytes = f.bytes();
    auto [c, r] = f.gather(locs, DType::kBF16, DType::kF32);
    auto [c2, r2] = f.gather(locs, DType::kF32, DType::kBF16);
    for (int64_t i = 0; i < 8; ++i) {
      expect_gathered_row(f.desc(), f.row(bytes, locs[size_t(i)]), c, r, i);
      expect_gathered_row(f.desc(), f.row(bytes, locs[size_t(i)]), c2, r2, i);
    }
  });
}

// bf16_holds_pool_values: which pools a bf16 copy holds exactly (the layer's staged rows).
TEST(KvPool, Bf16HoldsPoolValues) {
  const auto holds = [](KvLayout layout, ScalePolicy policy, float k_scale) {
    KvPoolDesc d;
    d.layout = layout;
    d.scale_policy = policy;
    d.k_scale = k_scale;
    return bf16_holds_pool_values(d);
  };
  EXPECT_TRUE(holds(KvLayout::kBf16, ScalePolicy::kAmax, 1.0f));
  EXPECT_FALSE(holds(KvLayout::kFp8Scaled, ScalePolicy::kAmax, 1.0f));
  EXPECT_TRUE(holds(KvLayout::kFp8Scaled, ScalePolicy::kPow2, 1.0f));
  EXPECT_TRUE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 1.0f));
  EXPECT_TRUE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.25f));
  EXPECT_TRUE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 0x1p40f));
  EXPECT_FALSE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.0371f));
  EXPECT_FALSE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.75f));
  // The smallest code (2^-9) times k_scale must stay a normal bf16 (>= 2^-126).
  EXPECT_TRUE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 0x1p-117f));
  EXPECT_FALSE(holds(KvLayout::kFp8Raw, ScalePolicy::kAmax, 0x1p-118f));
}

// gather_kv into the two column ranges of a bf16 pool's storage (rows strided by the bf16 row):
// the copy is a bf16 pool whose row r reads back, through gather_kv, exactly what location
// locs[r] of the source reads — for every pool bf16 holds (the layer's staged rows).
TEST(KvPool, GatherIntoTheColumnsOfABf16Pool) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      const KvPoolDesc sd = pool_desc(lc, 16, 96);
      if (!bf16_holds_pool_values(sd)) continue;
      SCOPED_TRACE(describe(sd));
      PoolFixture src(be, sd);
      const int64_t n = 40;
      const std::vector<int32_t> locs = distinct_locations(rng, n, 96);
      src.store(locs, random_tokens(rng, n, lc.layout));

      KvPoolDesc cd;
      cd.layout = KvLayout::kBf16;
      cd.page_size = 1;
      cd.num_pages = n;
      PagedKvPool copy(cd, be.empty(DType::kU8, {n, cd.bytes_per_token()}));
      be.poison(copy.storage());
      TensorView c_kv =
          make_view(copy.storage().data, DType::kBF16, be.device(), {n, kDc + kDrope});
      TensorView k_pe = c_kv;
      c_kv.shape[1] = kDc;
      k_pe.shape[1] = kDrope;
      k_pe.data = static_cast<bf16_t*>(c_kv.data) + kDc;
      be.gather_kv(src.pool(), be.to_device(i32_tensor(locs)), c_kv, k_pe);

      std::vector<int32_t> rows(static_cast<size_t>(n));
      std::iota(rows.begin(), rows.end(), 0);
      const auto [want_c, want_r] = src.gather(locs);
      Tensor got_c = be.empty(DType::kF32, {n, kDc}), got_r = be.empty(DType::kF32, {n, kDrope});
      be.poison(got_c);
      be.poison(got_r);
      be.gather_kv(copy, be.to_device(i32_tensor(rows)), got_c, got_r);
      const Tensor gc = be.to_host(got_c), gr = be.to_host(got_r);
      for (int64_t i = 0; i < n * kDc; ++i)
        ASSERT_TRUE(same_float(gc.ptr<float>()[i], want_c.ptr<float>()[i])) << "c_kv " << i;
      for (int64_t i = 0; i < n * kDrope; ++i)
        ASSERT_TRUE(same_float(gr.ptr<float>()[i], want_r.ptr<float>()[i])) << "k_pe " << i;
    }
  });
}

// store_kv from row-strided inputs (the two column ranges of one [n, d_c + d_rope + 8] array)
// writes the same bytes as from contiguous copies, for every layout.
TEST(KvPool, StoreFromTheColumnsOfOneArray) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      const KvPoolDesc d = pool_desc(lc, 16, 96);
      SCOPED_TRACE(describe(d));
      const int64_t n = 40, width = kDc + kDrope + 8;
      const std::vector<int32_t> locs = distinct_locations(rng, n, 96);
      const Tokens tok = random_tokens(rng, n, lc.layout);
      PoolFixture want(be, d), got(be, d);
      want.store(locs, tok);

      Tensor wide = Tensor::host(DType::kBF16, {n, width});
      for (int64_t i = 0; i < n; ++i) {
        std::copy_n(tok.c_kv.ptr<bf16_t>() + i * kDc, kDc, wide.ptr<bf16_t>() + i * width + 4);
        std::copy_n(tok.k_pe.ptr<bf16_t>() + i * kDrope, kDrope,
                    wide.ptr<bf16_t>() + i * width + 4 + kDc);
      }
      const Tensor dev_wide = be.to_device(wide);
      TensorView c_kv = dev_wide.view();
      c_kv.data = static_cast<bf16_t*>(c_kv.data) + 4;
      c_kv.shape[1] = kDc;
      TensorView k_pe = c_kv;
      k_pe.data = static_cast<bf16_t*>(c_kv.data) + kDc;
      k_pe.shape[1] = kDrope;
      be.store_kv(got.pool(), be.to_device(i32_tensor(locs)), c_kv, k_pe);
      const Tensor got_bytes = got.bytes(), want_bytes = want.bytes();
      for (int32_t loc : locs)
        ASSERT_EQ(0, std::memcmp(got.row(got_bytes, loc), want.row(want_bytes, loc),
                                 size_t(d.bytes_per_token())))
            << "location " << loc;
    }
  });
}

// positions_to_locations with kv_locs undefined: the identity, kv_start[t] + pos for a position
// in [0, ctx_len[t]), else -1.
TEST(BatchIndex, PositionsToRowsByTheIdentity) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    const int64_t t = 7, k = 9;
    std::vector<int32_t> pos(static_cast<size_t>(t * k)), start(static_cast<size_t>(t)),
        ctx(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) {
      start[size_t(i)] = int32_t(rng.randint(0, 300));
      ctx[size_t(i)] = int32_t(rng.randint(0, 12));
    }
    for (auto& p : pos) p = int32_t(rng.randint(-2, 14));
    Tensor pos_host = Tensor::host(DType::kI32, {t, k});
    std::copy(pos.begin(), pos.end(), pos_host.ptr<int32_t>());
    Tensor out = be.empty(DType::kI32, {t, k});
    be.poison(out);
    be.positions_to_locations(be.to_device(pos_host), TensorView{}, be.to_device(i32_tensor(start)),
                              be.to_device(i32_tensor(ctx)), out);
    const Tensor got = be.to_host(out);
    for (int64_t i = 0; i < t * k; ++i) {
      const int64_t row = i / k;
      const int32_t p = pos[size_t(i)];
      const int32_t want = p >= 0 && p < ctx[size_t(row)] ? start[size_t(row)] + p : -1;
      ASSERT_EQ(got.ptr<int32_t>()[i], want) << "entry " << i;
    }
  });
}

// The 656-byte layout read directly from the bytes: e4m3 codes, four little-endian fp32
// scales at [512, 528), bf16 rope at [528, 656).
TEST(KvPool, Fp8ScaledRowBytes) {
  const KvRowLayout fp8{KvLayout::kFp8Scaled, kDc, kDrope};
  EXPECT_EQ(fp8.bytes_per_token(), 656);
  EXPECT_EQ(fp8.scales_offset(), 512);
  EXPECT_EQ(fp8.rope_offset(), 528);
  EXPECT_EQ((KvRowLayout{KvLayout::kBf16, kDc, kDrope}.bytes_per_token()), 1152);
  EXPECT_EQ((KvRowLayout{KvLayout::kBf16, kDc, kDrope}.rope_offset()), 1024);
  EXPECT_EQ((KvRowLayout{KvLayout::kFp8Raw, kDc, kDrope}.bytes_per_token()), 576);
  EXPECT_EQ((KvRowLayout{KvLayout::kFp8Raw, kDc, kDrope}.rope_offset()), 512);

  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (ScalePolicy policy : {ScalePolicy::kPow2, ScalePolicy::kAmax}) {
      SCOPED_TRACE(to_string(policy));
      PoolFixture f(be, pool_desc({KvLayout::kFp8Scaled, policy, 1.0f}, 64, 64));
      // Tile j: values ±v_j·{1, 1/2, 1/4, …}, amax v_j = 448·2^(3j-5) · (1 + 2^-5 when odd).
      Tokens tok = random_tokens(rng, 1, KvLayout::kFp8Scaled);
      float amax[4];
      for (int tile = 0; tile < 4; ++tile) {
        amax[tile] = std::ldexp(448.0f, 3 * tile - 5) * (tile % 2 ? 1.03125f : 1.0f);
        for (int k = 0; k < kFp8TileSize; ++k)
          tok.set_c(0, tile * kFp8TileSize + k,
                    (k % 2 ? -1.0f : 1.0f) * std::ldexp(amax[tile], -(k % 8)));
      }
      const int32_t loc = int32_t(rng.randint(0, 63));
      f.store({loc}, tok);
      const Tensor bytes = f.bytes();
      const uint8_t* row = f.row(bytes, loc);
      for (int tile = 0; tile < 4; ++tile) {
        const float want_scale = policy == ScalePolicy::kAmax
                                     ? amax[tile] / 448.0f
                                     : std::ldexp(1.0f, 3 * tile - 5 + (tile % 2));
        EXPECT_EQ(load_le_f32(row + 512 + 4 * tile), want_scale) << "scale of tile " << tile;
        for (int k = 0; k < kFp8TileSize; ++k) {
          const uint8_t code = row[tile * kFp8TileSize + k];
          const float x = tok.c(0, tile * kFp8TileSize + k);
          EXPECT_EQ(code & 0x80, x < 0 ? 0x80 : 0);
          EXPECT_EQ(code, f32_to_e4m3(x / want_scale)) << "tile " << tile << " value " << k;
        }
      }
      // Tile 0's amax maps to 448 exactly under both policies.
      EXPECT_EQ(row[0], 0x7E);
      for (int j = 0; j < kDrope; ++j)
        EXPECT_EQ(load_le_u16(row + 528 + 2 * j), tok.k_pe.ptr<bf16_t>()[j].bits) << "rope " << j;
    }
  });
}

TEST(KvPool, AllZeroTokensReadBackZero) {
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      PoolFixture f(be, pool_desc(lc, 16, 32));
      SCOPED_TRACE(describe(f.desc()));
      be.fill_bytes(f.pool().storage(), 0xA5);  // so that zero rows must have been written
      const Tokens tok = constant_tokens(4, 0.0f);
      const std::vector<int32_t> locs = {3, 17, 0, 31};
      f.store(locs, tok);
      const Tensor bytes = f.bytes();
      for (int32_t loc : locs) {
        const std::vector<uint8_t> want = reference_row(f.desc(), tok, 0);
        ASSERT_EQ(0, std::memcmp(f.row(bytes, loc), want.data(), want.size()));
        if (lc.layout == KvLayout::kFp8Scaled) {
          const float s = load_le_f32(f.row(bytes, loc) + 512);
          EXPECT_EQ(s, lc.policy == ScalePolicy::kAmax ? FLT_MIN : 0x1p-13f);
        }
      }
      auto [c, r] = f.gather(locs);
      for (int64_t i = 0; i < c.numel(); ++i) ASSERT_EQ(c.ptr<float>()[i], 0.0f) << i;
      for (int64_t i = 0; i < r.numel(); ++i) ASSERT_EQ(r.ptr<float>()[i], 0.0f) << i;
    }
  });
}

// Magnitudes far outside e4m3's range: per-tile scales follow them; fp8-raw saturates.
TEST(KvPool, TinyAndHugeValues) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      PoolFixture f(be, pool_desc(lc, 1, 8));
      SCOPED_TRACE(describe(f.desc()));
      Tokens tok = random_tokens(rng, 4, KvLayout::kFp8Scaled);
      const float magnitude[4] = {1e-30f, 1e30f, 1e37f, 1e-38f};
      for (int64_t i = 0; i < 4; ++i)
        for (int j = 0; j < kDc; ++j) {  // |x| in [magnitude / 2, 2 magnitude]: never 0
          const float sign = rng.randint(0, 1) ? -1.0f : 1.0f;
          tok.set_c(i, j, sign * rng.uniform(0.5f, 2.0f) * magnitude[i]);
        }
      const std::vector<int32_t> locs = {5, 2, 7, 0};
      f.store(locs, tok);
      const Tensor bytes = f.bytes();
      auto [c, r] = f.gather(locs);
      for (int64_t i = 0; i < 4; ++i) {
        SCOPED_TRACE(magnitude[i]);
        const std::vector<uint8_t> want = reference_row(f.desc(), tok, i);
        ASSERT_EQ(0, std::memcmp(f.row(bytes, locs[size_t(i)]), want.data(), want.size()));
        expect_gathered_row(f.desc(), f.row(bytes, locs[size_t(i)]), c, r, i);
        for (int j = 0; j < kDc; ++j) ASSERT_TRUE(std::isfinite(c.ptr<float>()[i * kDc + j]));
        if (lc.layout == KvLayout::kFp8Scaled && lc.policy == ScalePolicy::kAmax)
          expect_format_error(f.desc(), tok, i, c, r, i);
        if (lc.layout == KvLayout::kFp8Raw && magnitude[i] > 1) {
          for (int j = 0; j < kDc; ++j)
            ASSERT_EQ(std::fabs(c.ptr<float>()[i * kDc + j]), 448.0f * lc.k_scale) << j;
        }
      }
    }
  });
}

// A NaN or an infinity in one token changes only that token's row.
TEST(KvPool, NonFiniteValuesStayInTheirRow) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      PoolFixture f(be, pool_desc(lc, 16, 16));
      SCOPED_TRACE(describe(f.desc()));
      Tokens tok = random_tokens(rng, 6, lc.layout);
      const int nan_at = int(rng.randint(0, kDc - 1)), inf_at = int(rng.randint(0, kDc - 1));
      tok.set_c(1, nan_at, kNaN);
      tok.set_c(4, inf_at, -kInf);
      const std::vector<int32_t> locs = distinct_locations(rng, 6, 16);
      f.store(locs, tok);
      const Tensor bytes = f.bytes();
      auto [c, r] = f.gather(locs);
      for (int64_t i = 0; i < 6; ++i) {
        SCOPED_TRACE("token " + std::to_string(i));
        const std::vector<uint8_t> want = reference_row(f.desc(), tok, i);
        ASSERT_EQ(0, std::memcmp(f.row(bytes, locs[size_t(i)]), want.data(), want.size()));
        expect_gathered_row(f.desc(), f.row(bytes, locs[size_t(i)]), c, r, i);
        int nans = 0;
        for (int j = 0; j < kDc; ++j) nans += std::isnan(c.ptr<float>()[i * kDc + j]);
        for (int j = 0; j < kDrope; ++j) ASSERT_FALSE(std::isnan(r.ptr<float>()[i * kDrope + j]));
        if (i == 1) {
          // NaN is skipped by the tile amax: only the NaN value itself reads back NaN.
          EXPECT_TRUE(std::isnan(c.ptr<float>()[i * kDc + nan_at]));
          EXPECT_EQ(nans, 1);
        } else if (i != 4) {
          EXPECT_EQ(nans, 0);
          expect_format_error(f.desc(), tok, i, c, r, i);
        }
      }
      // -inf: saturates to -448·k_scale (fp8-raw) or is kept (bf16); in the fp8 layout it makes
      // its tile's scale infinite, so that whole tile reads back NaN.
      const float got_inf = c.ptr<float>()[4 * kDc + inf_at];
      const float want_inf = lc.layout == KvLayout::kBf16     ? -kInf
                             : lc.layout == KvLayout::kFp8Raw ? -448.0f * lc.k_scale
                                                              : kNaN;
      EXPECT_TRUE(same_float(got_inf, want_inf)) << got_inf;
    }
  });
}

TEST(KvPool, EmptyLocationListIsANoOp) {
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      PoolFixture f(be, pool_desc(lc, 16, 16));
      be.fill_bytes(f.pool().storage(), 0x3C);
      const uint64_t before = testing::checksum(f.bytes());
      f.store({}, constant_tokens(0, 1.0f));
      EXPECT_EQ(testing::checksum(f.bytes()), before);
      auto [c, r] = f.gather({});
      EXPECT_EQ(c.numel(), 0);
    }
  });
}

// ---- index-key pool -------------------------------------------------------------------------

TEST(IndexKeyPool, StoreMatchesReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (int page_size : kPageSizes) {
      SCOPED_TRACE("page_size " + std::to_string(page_size));
      const int64_t n = 40;
      IndexKeyPoolDesc d;
      d.page_size = page_size;
      d.num_pages = (3 * n + page_size - 1) / page_size;
      d.d_i = kDi;
      IndexKeyPool pool = be.make_index_pool(d);
      Tensor keys = mixed_magnitudes(rng, n, kDi);
      for (int j = 0; j < kDi; ++j) keys.ptr<bf16_t>()[j] = f32_to_bf16(0.0f);  // one zero key
      const std::vector<int32_t> locs = distinct_locations(rng, n, d.num_locations());
      be.store_index_keys(pool, be.to_device(i32_tensor(locs)), be.to_device(keys));

      const Tensor bytes = be.to_host(pool.storage());
      std::vector<bool> written(size_t(d.num_locations()), false);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t loc = locs[size_t(i)], page = loc / page_size, slot = loc % page_size;
        written[size_t(loc)] = true;
        const uint8_t* page_base = bytes.ptr<const uint8_t>() + page * d.page_bytes();
        std::vector<double> x(kDi);
        for (int j = 0; j < kDi; ++j) x[size_t(j)] = bf16_to_f32(keys.ptr<bf16_t>()[i * kDi + j]);
        std::vector<uint8_t> codes(kDi);
        double scale = 0;
        reference::indexer_quantize(x.data(), kDi, codes.data(), &scale);
        ASSERT_EQ(0, std::memcmp(page_base + slot * kDi, codes.data(), kDi)) << "key " << i;
        ASSERT_EQ(load_le_f32(page_base + int64_t(page_size) * kDi + slot * 4), scale)
            << "key " << i;
      }
      // Slots not stored to keep their zero codes and zero scales.
      for (int64_t loc = 0; loc < d.num_locations(); ++loc) {
        if (written[size_t(loc)]) continue;
        const int64_t page = loc / page_size, slot = loc % page_size;
        const uint8_t* page_base = bytes.ptr<const uint8_t>() + page * d.page_bytes();
        for (int j = 0; j < kDi; ++j) ASSERT_EQ(page_base[slot * kDi + j], 0);
        ASSERT_EQ(load_le_f32(page_base + int64_t(page_size) * kDi + slot * 4), 0.0f);
      }
    }
  });
}

// ---- typed layouts --------------------------------------------------------------------------

template <typename F>
void expect_error(F&& call, ErrorKind kind, std::initializer_list<const char*> needles) {
  try {
    call();
    ADD_FAILURE() << "expected dsakit::Error(" << to_string(kind) << ")";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const char* needle : needles)
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
          << "message \"" << e.what() << "\" does not name \"" << needle << "\"";
  }
}

TEST(KvPool, LayoutsAreTyped) {
  for_each_backend([&](Backend& be) {
    PoolFixture raw(be, pool_desc(kLayoutCases[3], 64, 64));
    expect_error([&] { raw.pool().expect_layout(KvLayout::kFp8Scaled, "gather_kv"); },
                 ErrorKind::kLayoutMismatch, {"gather_kv", "fp8-raw", "576", "fp8 (656"});
    PoolFixture scaled(be, pool_desc(kLayoutCases[1], 64, 64));
    expect_error([&] { scaled.pool().expect_layout(KvLayout::kFp8Raw, "sparse_mla"); },
                 ErrorKind::kLayoutMismatch, {"sparse_mla", "fp8-raw", "576", "656"});
    expect_error([&] { scaled.pool().expect_layout(KvLayout::kBf16, "dense path"); },
                 ErrorKind::kLayoutMismatch, {"bf16", "1152", "656"});
    raw.pool().expect_layout(KvLayout::kFp8Raw, "gather_kv");  // matching layout: no error

    // 576-byte rows handed to a pool typed as the 656-byte layout: rejected at construction.
    KvPoolDesc fp8 = pool_desc(kLayoutCases[1], 64, 64);
    Tensor rows576 = be.empty(DType::kU8, {fp8.num_locations(), 576});
    expect_error([&] { PagedKvPool typed(fp8, rows576); }, ErrorKind::kLayoutMismatch,
                 {"kv pool storage", "fp8-raw", "656", "576", "declared fp8"});
  });
}

// store_tokens (both pools, one launch on CUDA) writes the bytes of store_kv + store_index_keys;
// a rejected call leaves both pools byte-identical, whichever argument is wrong.
TEST(KvPool, StoreTokensWritesBothStoresBytes) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      for (int page_size : {16, 64}) {
        const int64_t n = 37;
        const KvPoolDesc kd = pool_desc(lc, page_size, 3 * n);
        SCOPED_TRACE(describe(kd));
        IndexKeyPoolDesc id;
        id.page_size = page_size;
        id.num_pages = kd.num_pages;
        id.d_i = kDi;
        PagedKvPool fused_kv = be.make_kv_pool(kd), kv = be.make_kv_pool(kd);
        IndexKeyPool fused_ix = be.make_index_pool(id), ix = be.make_index_pool(id);
        const Tokens tok = random_tokens(rng, n, lc.layout);
        const Tensor c_kv = be.to_device(tok.c_kv), k_pe = be.to_device(tok.k_pe);
        const Tensor keys = be.to_device(mixed_magnitudes(rng, n, kDi));
        const Tensor locs =
            be.to_device(i32_tensor(distinct_locations(rng, n, kd.num_locations())));
        be.store_tokens(fused_kv, fused_ix, locs, c_kv, k_pe, keys);
        be.store_kv(kv, locs, c_kv, k_pe);
        be.store_index_keys(ix, locs, keys);
        EXPECT_EQ(testing::checksum(be.to_host(fused_kv.storage())),
                  testing::checksum(be.to_host(kv.storage())));
        EXPECT_EQ(testing::checksum(be.to_host(fused_ix.storage())),
                  testing::checksum(be.to_host(ix.storage())));
        EXPECT_NE(testing::checksum(be.to_host(fused_ix.storage())),
                  testing::checksum(be.to_host(be.make_index_pool(id).storage())));

        // Rejected: neither pool changes, whether the latent or the key argument is wrong.
        const auto expect_both_unchanged = [&](const char* arg, const TensorView& bad_c_kv,
                                               const TensorView& bad_keys, const Tensor& l) {
          SCOPED_TRACE(arg);
          const uint64_t kv_before = testing::checksum(be.to_host(fused_kv.storage()));
          const uint64_t ix_before = testing::checksum(be.to_host(fused_ix.storage()));
          expect_error([&] { be.store_tokens(fused_kv, fused_ix, l, bad_c_kv, k_pe, bad_keys); },
                       ErrorKind::kInvalidArgument, {arg});
          EXPECT_EQ(testing::checksum(be.to_host(fused_kv.storage())), kv_before);
          EXPECT_EQ(testing::checksum(be.to_host(fused_ix.storage())), ix_before);
        };
        const Tensor short_keys =
            be.to_device(testing::random_tensor(rng, DType::kBF16, {n, kDi / 2}));
        const Tensor short_c_kv =
            be.to_device(testing::random_tensor(rng, DType::kBF16, {n, kDc - 128}));
        expect_both_unchanged("idx_k", c_kv, short_keys, locs);
        expect_both_unchanged("c_kv", short_c_kv, keys, locs);
        std::vector<int32_t> repeated = distinct_locations(rng, n, kd.num_locations());
        repeated.back() = repeated.front();
        expect_both_unchanged("locs", c_kv, keys, be.to_device(i32_tensor(repeated)));
      }
    }
  });
}

// ---- bad input ------------------------------------------------------------------------------

// Runs a call that must be rejected: Error(kInvalidArgument) naming `arg`, pool bytes unchanged.
void expect_rejected(Backend& be, const TensorView& pool_storage, const char* arg,
                     const std::function<void()>& call) {
  SCOPED_TRACE(arg);
  const uint64_t before = testing::checksum(be.to_host(pool_storage));
  expect_error(call, ErrorKind::kInvalidArgument, {arg});
  EXPECT_EQ(testing::checksum(be.to_host(pool_storage)), before) << "a rejected call wrote";
}

TEST(KvPool, BadInputIsRejectedWithoutWriting) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (const LayoutCase& lc : kLayoutCases) {
      PoolFixture f(be, pool_desc(lc, 16, 32));
      SCOPED_TRACE(describe(f.desc()));
      PagedKvPool& pool = f.pool();
      const int64_t n = 4, num_loc = f.desc().num_locations();
      f.store(distinct_locations(rng, n, num_loc), random_tokens(rng, n, lc.layout));
      const Tokens tok = random_tokens(rng, n, lc.layout);
      const Tensor c_kv = be.to_device(tok.c_kv), k_pe = be.to_device(tok.k_pe);
      const Tensor locs = be.to_device(i32_tensor({1, 5, 9, 30}));
      auto dev = [&](const Tensor& host) { return be.to_device(host); };
      auto rand = [&](DType dt, std::vector<int64_t> shape) {
        return dev(testing::random_tensor(rng, dt, shape));
      };
      const TensorView& storage = pool.storage();

      // store_kv
      auto store = [&](const Tensor& l, const Tensor& c, const Tensor& r) {
        return [&be, &pool, l, c, r] { be.store_kv(pool, l, c, r); };
      };
      expect_rejected(be, storage, "c_kv", store(locs, rand(DType::kBF16, {n, kDc - 128}), k_pe));
      expect_rejected(be, storage, "c_kv", store(locs, rand(DType::kF32, {n, kDc}), k_pe));
      expect_rejected(be, storage, "c_kv", store(locs, rand(DType::kBF16, {n + 1, kDc}), k_pe));
      expect_rejected(be, storage, "k_pe", store(locs, c_kv, rand(DType::kBF16, {n, kDrope + 8})));
      expect_rejected(be, storage, "k_pe", store(locs, c_kv, rand(DType::kF32, {n, kDrope})));
      expect_rejected(be, storage, "locs", store(dev(i32_tensor({1, 5, 9, -1})), c_kv, k_pe));
      expect_rejected(be, storage, "locs",
                      store(dev(i32_tensor({1, 5, int32_t(num_loc), 0})), c_kv, k_pe));
      expect_rejected(be, storage, "locs", store(dev(i32_tensor({1, 5, 1, 0})), c_kv, k_pe));
      expect_rejected(be, storage, "locs", store(rand(DType::kF32, {n}), c_kv, k_pe));
      expect_rejected(be, storage, "locs", store(rand(DType::kU8, {n}), c_kv, k_pe));
      expect_rejected(be, storage, "locs",
                      store(dev(Tensor::host(DType::kI32, {n, 1})), c_kv, k_pe));

      // gather_kv: outputs poisoned before each call and still poisoned after a rejection.
      auto gather = [&](const char* arg, const Tensor& l, DType dt, int dc, int dr) {
        Tensor c = be.empty(dt, {n, dc}), r = be.empty(dt, {n, dr});
        be.poison(c);
        be.poison(r);
        expect_rejected(be, storage, arg, [&] { be.gather_kv(pool, l, c, r); });
        const Tensor hc = be.to_host(c), hr = be.to_host(r);
        for (int64_t i = 0; i < hc.numel(); ++i) ASSERT_TRUE(std::isnan(load_as_float(hc, i)));
        for (int64_t i = 0; i < hr.numel(); ++i) ASSERT_TRUE(std::isnan(load_as_float(hr, i)));
      };
      gather("c_kv", locs, DType::kF32, kDc + 1, kDrope);
      gather("c_kv", locs, DType::kF64, kDc, kDrope);
      gather("k_pe", locs, DType::kBF16, kDc, kDrope * 2);
      gather("locs", rand(DType::kF32, {n}), DType::kF32, kDc, kDrope);
      gather("c_kv", rand(DType::kI32, {n + 1}), DType::kF32, kDc, kDrope);  // n from locs
      gather("locs", dev(i32_tensor({0, 1, int32_t(num_loc) + 7, 2})), DType::kF32, kDc, kDrope);
      gather("locs", dev(i32_tensor({0, -5, 1, 2})), DType::kBF16, kDc, kDrope);
    }

    // store_index_keys
    IndexKeyPoolDesc d;
    d.page_size = 16;
    d.num_pages = 2;
    d.d_i = kDi;
    IndexKeyPool ipool = be.make_index_pool(d);
    be.store_index_keys(ipool, be.to_device(i32_tensor({3, 20})),
                        be.to_device(testing::random_tensor(rng, DType::kBF16, {2, kDi})));
    const Tensor keys = be.to_device(testing::random_tensor(rng, DType::kBF16, {3, kDi}));
    auto store_keys = [&](std::vector<int32_t> l, const Tensor& k) {
      const Tensor dl = be.to_device(i32_tensor(l));
      return [&be, &ipool, dl, k] { be.store_index_keys(ipool, dl, k); };
    };
    const TensorView& istorage = ipool.storage();
    expect_rejected(
        be, istorage, "idx_k",
        store_keys({0, 1, 2}, be.to_device(testing::random_tensor(rng, DType::kBF16, {3, 64}))));
    expect_rejected(
        be, istorage, "idx_k",
        store_keys({0, 1, 2}, be.to_device(testing::random_tensor(rng, DType::kF32, {3, kDi}))));
    expect_rejected(be, istorage, "idx_k", store_keys({0, 1}, keys));
    expect_rejected(be, istorage, "locs", store_keys({0, 1, 32}, keys));
    expect_rejected(be, istorage, "locs", store_keys({0, -1, 2}, keys));
    expect_rejected(be, istorage, "locs", store_keys({4, 9, 4}, keys));
  });
}

// ---- batch bookkeeping ----------------------------------------------------------------------

Batch make_batch(std::vector<int32_t> prefix, std::vector<int32_t> extend,
                 std::vector<std::vector<int32_t>> tables) {
  Batch b;
  b.prefix_lens = std::move(prefix);
  b.extend_lens = std::move(extend);
  b.page_tables = std::move(tables);
  return b;
}

void expect_invalid_batch(const Batch& b, int page_size, int64_t num_pages,
                          std::initializer_list<const char*> needles) {
  expect_error([&] { b.validate(page_size, num_pages); }, ErrorKind::kInvalidArgument, needles);
}

TEST(Batch, ValidateAcceptsAWellFormedBatch) {
  // 3 requests, page size 4: lengths 7, 4, 0 need 2, 1, 0 pages.
  const Batch b = make_batch({3, 0, 0}, {4, 4, 0}, {{5, 2}, {0}, {}});
  b.validate(4, 6);
  EXPECT_EQ(b.num_new_tokens(), 8);
  EXPECT_EQ(b.total_kv_len(), 11);
  EXPECT_EQ(b.max_kv_len(), 7);
}

TEST(Batch, ValidateRejectsLengthsThatDoNotFitThePageTable) {
  expect_invalid_batch(make_batch({3, 60}, {2, 5}, {{0}, {1}}), 64, 4,
                       {"request 1", "length 65", "needs 2 pages", "page table has 1"});
  expect_invalid_batch(make_batch({0}, {2}, {{}}), 1, 4, {"request 0", "needs 2 pages"});
  expect_invalid_batch(make_batch({-1}, {2}, {{0}}), 16, 4, {"request 0 prefix_len", "-1"});
  expect_invalid_batch(make_batch({0}, {-3}, {{0}}), 16, 4, {"request 0 extend_len", "-3"});
  expect_invalid_batch(make_batch({0, 0}, {1}, {{0}, {1}}), 16, 4, {"extend_lens"});
  expect_invalid_batch(make_batch({0, 0}, {1, 1}, {{0}}), 16, 4, {"page_tables"});
  Batch decode = make_batch({5}, {2}, {{0}});
  decode.mode = ForwardMode::kDecode;
  expect_invalid_batch(decode, 16, 4, {"request 0 extend_len", "decode"});
}

TEST(Batch, ValidateRejectsPageIdsOutOfRange) {
  expect_invalid_batch(make_batch({0, 0}, {20, 3}, {{1, 4}, {2}}), 16, 4,
                       {"request 0 page_table[1]", "[0, 4)", "got 4"});
  expect_invalid_batch(make_batch({0}, {3}, {{-1}}), 16, 4, {"request 0 page_table[0]", "-1"});
  // Entries past the pages a request needs are not read.
  make_batch({0}, {3}, {{0, -7, 99}}).validate(16, 4);
}

TEST(Batch, ValidateSharedPages) {
  // Page 3 holds positions 0..15 of both requests, inside both prefixes (read-only).
  Batch shared = make_batch({16, 20}, {4, 1}, {{3, 0}, {3, 1}});
  expect_invalid_batch(shared, 16, 4, {"request 1 page_table[0]", "page 3", "shared_prefix_pages"});
  shared.shared_prefix_pages = true;
  shared.validate(16, 4);

  // A shared page that the second request writes (its extend starts inside the page).
  Batch written = make_batch({16, 10}, {4, 3}, {{3, 0}, {3}});
  written.shared_prefix_pages = true;
  expect_invalid_batch(written, 16, 4, {"request 1 page_table[0]", "page 3", "written"});
  // … or that the first request writes.
  Batch written_first = make_batch({10, 16}, {3, 4}, {{3}, {3, 1}});
  written_first.shared_prefix_pages = true;
  expect_invalid_batch(written_first, 16, 4,
                       {"request 0 page_table[0]", "shared page 3", "written"});
  // A page listed twice in one table is never allowed.
  Batch twice = make_batch({0}, {40}, {{2, 1, 2}});
  twice.shared_prefix_pages = true;
  expect_invalid_batch(twice, 16, 4, {"request 0 page_table[2]", "listed twice"});
}

// BatchIndex against a direct recomputation of loc = table[p / page_size]·page_size + p %
// page_size.
TEST(BatchIndex, LocationMapping) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int page_size : {1, 16, 64}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size));
    const int num_pages = 4096 / page_size;
    std::vector<int32_t> free_pages(static_cast<size_t>(num_pages));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), rng.gen());
    Batch b;
    for (int r = 0; r < 4; ++r) {
      const int32_t p = int32_t(rng.randint(0, 300)), e = int32_t(rng.randint(r == 2 ? 0 : 1, 200));
      const size_t pages = size_t((p + e + page_size - 1) / page_size);
      b.prefix_lens.push_back(p);
      b.extend_lens.push_back(e);
      b.page_tables.emplace_back(free_pages.end() - pages, free_pages.end());
      free_pages.resize(free_pages.size() - pages);
    }
    b.validate(page_size, num_pages);
    const BatchIndex x = BatchIndex::build(b, page_size);

    ASSERT_EQ(x.cu_q.size(), 5u);
    ASSERT_EQ(x.cu_kv.size(), 5u);
    ASSERT_EQ(x.prefix_lens, b.prefix_lens);
    ASSERT_EQ(int64_t(x.token_pos.size()), b.num_new_tokens());
    ASSERT_EQ(int64_t(x.kv_locs.size()), b.total_kv_len());
    std::set<int32_t> seen;
    size_t t = 0, kv = 0;
    for (int r = 0; r < 4; ++r) {
      const auto& table = b.page_tables[size_t(r)];
      const int32_t p0 = b.prefix_lens[size_t(r)], len = p0 + b.extend_lens[size_t(r)];
      ASSERT_EQ(x.cu_q[size_t(r)], int32_t(t));
      ASSERT_EQ(x.cu_kv[size_t(r)], int32_t(kv));
      for (int32_t pos = 0; pos < len; ++pos, ++kv) {
        const int32_t loc = x.kv_locs[kv];
        ASSERT_EQ(loc / page_size, table[size_t(pos / page_size)])
            << "request " << r << " pos " << pos;
        ASSERT_EQ(loc % page_size, pos % page_size);
        ASSERT_TRUE(seen.insert(loc).second) << "location " << loc << " used twice";
        if (pos < p0) continue;
        ASSERT_EQ(x.token_request[t], r);
        ASSERT_EQ(x.token_pos[t], pos);
        ASSERT_EQ(x.token_ctx_len[t], pos + 1);
        ASSERT_EQ(x.token_kv_start[t], x.cu_kv[size_t(r)]);
        ASSERT_EQ(x.new_locs[t], loc);
        ++t;
      }
    }
    ASSERT_EQ(x.cu_q.back(), int32_t(t));
    ASSERT_EQ(x.cu_kv.back(), int32_t(kv));
  }
}

// Tokens written through one batch's new_locs read back by position through a later batch's
// kv_locs (chunked prefill): the pool mapping and the kernels agree.
TEST(BatchIndex, StoreThenGatherByPosition) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for_each_backend([&](Backend& be) {
    for (int page_size : {1, 64}) {
      SCOPED_TRACE("page_size " + std::to_string(page_size));
      PoolFixture f(be, pool_desc(kLayoutCases[0], page_size, 512));
      const int64_t num_pages = f.desc().num_pages;
      std::vector<int32_t> ids(static_cast<size_t>(num_pages));
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng.gen());
      // Two requests of 150 and 90 tokens, first chunk 100 / 50 tokens, then the rest.
      const std::vector<int32_t> lens = {150, 90}, chunk = {100, 50};
      std::vector<std::vector<int32_t>> tables(2);
      size_t next = 0;
      for (int r = 0; r < 2; ++r)
        for (int i = 0; i < (lens[size_t(r)] + page_size - 1) / page_size; ++i)
          tables[size_t(r)].push_back(ids[next++]);
      const Batch first = make_batch({0, 0}, chunk, tables);
      const Batch second = make_batch(chunk, {lens[0] - chunk[0], lens[1] - chunk[1]}, tables);
      const Tokens all = random_tokens(rng, 240, KvLayout::kBf16);  // request 0 then 1, by pos
      auto token_rows = [&](const std::vector<int64_t>& ids) {
        Tokens t{Tensor::host(DType::kBF16, {int64_t(ids.size()), kDc}),
                 Tensor::host(DType::kBF16, {int64_t(ids.size()), kDrope})};
        for (size_t i = 0; i < ids.size(); ++i) {
          std::memcpy(t.c_kv.ptr<bf16_t>() + i * kDc, all.c_kv.ptr<bf16_t>() + ids[i] * kDc,
                      kDc * sizeof(bf16_t));
          std::memcpy(t.k_pe.ptr<bf16_t>() + i * kDrope, all.k_pe.ptr<bf16_t>() + ids[i] * kDrope,
                      kDrope * sizeof(bf16_t));
        }
        return t;
      };
      for (const Batch* b : {&first, &second}) {
        b->validate(page_size, num_pages);
        const BatchIndex x = BatchIndex::build(*b, page_size);
        std::vector<int64_t> rows;
        for (size_t t = 0; t < x.token_pos.size(); ++t)
          rows.push_back((x.token_request[t] == 0 ? 0 : lens[0]) + x.token_pos[t]);
        f.store(x.new_locs, token_rows(rows));
      }
      const BatchIndex x = BatchIndex::build(second, page_size);
      auto [c, r] = f.gather(x.kv_locs, DType::kBF16, DType::kBF16);
      ASSERT_EQ(c.size(0), 240);
      EXPECT_EQ(0, std::memcmp(c.ptr<bf16_t>(), all.c_kv.ptr<bf16_t>(), c.nbytes()));
      EXPECT_EQ(0, std::memcmp(r.ptr<bf16_t>(), all.k_pe.ptr<bf16_t>(), r.nbytes()));
    }
  });
}

}  // namespace
}  // namespace dsakit
