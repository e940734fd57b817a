// The backend ops of context parallelism (docs/layer.md): select_rows, merge_topk and
// merge_partials with bf16 parts, on every test backend, against direct host computations.
// Inputs are random and fresh per run; outputs are poisoned before each op writes them, and a
// rejected call must leave them byte-identical.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::expect_error_naming;
using testing::poisoned;
using testing::Rng;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Runs fn(backend) once per test backend (cpu, and cuda where a GPU is present).
void for_each_backend(const std::function<void(Backend&)>& fn) {
  for (const std::string& name : testing::test_backends()) {
    SCOPED_TRACE("backend " + name);
    std::unique_ptr<Backend> backend = make_backend(name);
    fn(*backend);
  }
}

std::vector<uint8_t> bytes_of(const TensorView& host) {
  const auto* p = static_cast<const uint8_t*>(host.data);
  return std::vector<uint8_t>(p, p + host.nbytes());
}

std::vector<int32_t> i32_of(const TensorView& host) {
  const int32_t* p = host.ptr<const int32_t>();
  return std::vector<int32_t>(p, p + host.numel());
}

Tensor host_i32(const std::vector<int32_t>& values, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::host(DType::kI32, shape);
  std::copy(values.begin(), values.end(), t.ptr<int32_t>());
  return t;
}

Tensor random_bytes(Rng& rng, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::host(dtype, shape);
  auto* p = t.ptr<uint8_t>();
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(rng.randint(0, 255));
  return t;
}

// ---- select_rows ---------------------------------------------------------------------------

struct RowsCase {
  DType dtype;
  std::vector<int64_t> trailing;  // the shape of one row
};

// Rows of odd byte sizes (6, 7, 1, 20), of 16-byte multiples (16, 256), and long rows whose
// copies take a whole block (8192 bytes; 8193 bytes moved one at a time).
const RowsCase kRowsCases[] = {
    {DType::kBF16, {3}}, {DType::kU8, {7}},       {DType::kU8, {1}},        {DType::kF32, {5}},
    {DType::kI32, {4}},  {DType::kBF16, {2, 64}}, {DType::kF32, {2, 1024}}, {DType::kU8, {8193}},
};

std::vector<int64_t> with_rows(int64_t rows, const std::vector<int64_t>& trailing) {
  std::vector<int64_t> shape{rows};
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  return shape;
}

std::string rows_tag(const RowsCase& c) {
  std::string s = to_string(c.dtype);
  for (int64_t e : c.trailing) {
    s += ' ';
    s += std::to_string(e);
  }
  return s;
}

TEST(DcpSelectRows, CopiesTheChosenRowsByteForByte) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t n = 29;
  for_each_backend([&](Backend& b) {
    for (const RowsCase& c : kRowsCases) {
      for (const int64_t m : {0, 1, 37}) {
        for (const bool offset_src : {false, true}) {
          const std::string tag =
              rows_tag(c) + " M " + std::to_string(m) + (offset_src ? " src from row 1" : "");
          SCOPED_TRACE(tag);
          // offset_src: src is rows [1, n + 1) of a larger tensor, so its base address is only
          // as aligned as the row size makes it.
          const Tensor whole = random_bytes(rng, c.dtype, with_rows(n + 1, c.trailing));
          const TensorView src_host =
              slice_rows(whole, offset_src ? 1 : 0, n + (offset_src ? 1 : 0));
          std::vector<int32_t> rows(static_cast<size_t>(m));
          for (auto& r : rows) r = int32_t(rng.randint(0, n - 1));
          if (m > 2) rows[2] = rows[1];  // a repeated row
          if (m > 3) rows[3] = int32_t(n - 1);

          const Tensor src_dev_whole = b.to_device(whole);
          const TensorView src =
              slice_rows(src_dev_whole, offset_src ? 1 : 0, n + (offset_src ? 1 : 0));
          const Tensor dst = poisoned(b, c.dtype, with_rows(m, c.trailing));
          b.select_rows(src, b.to_device(host_i32(rows, {m})), dst);

          const std::vector<uint8_t> out = bytes_of(b.to_host(dst));
          const size_t row_bytes = m == 0 ? 0 : out.size() / size_t(m);
          std::vector<uint8_t> expected;
          const auto* from = static_cast<const uint8_t*>(src_host.data);
          for (const int32_t r : rows)
            expected.insert(expected.end(), from + size_t(r) * row_bytes,
                            from + size_t(r + 1) * row_bytes);
          EXPECT_EQ(out, expected);
        }
      }
    }
  });
}

TEST(DcpSelectRows, RowOutOfRangeIsRejectedAndWritesNothing) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t n = 9, m = 6;
  for_each_backend([&](Backend& b) {
    for (const int32_t bad : {int32_t(n), -1, std::numeric_limits<int32_t>::max(),
                              std::numeric_limits<int32_t>::min()}) {
      SCOPED_TRACE("bad row " + std::to_string(bad));
      const Tensor src_host = random_bytes(rng, DType::kBF16, {n, 3});
      std::vector<int32_t> rows = {0, 1, 2, 3, 4, 5};
      rows[4] = bad;
      const Tensor rows_dev = b.to_device(host_i32(rows, {m}));
      const Tensor src = b.to_device(src_host);
      const Tensor dst = poisoned(b, DType::kBF16, {m, 3});
      const std::vector<uint8_t> before = bytes_of(b.to_host(dst));
      expect_error_naming([&] { b.select_rows(src, rows_dev, dst); }, "rows[4]");
      EXPECT_EQ(bytes_of(b.to_host(dst)), before);

      // Without host value checks (CUDA; the CPU backend always checks) the kernel copies the
      // valid rows and leaves the bad row's bytes as they were.
      const bool previous = b.set_index_value_checks(false);
      bool rejected = false;
      try {
        b.select_rows(src, rows_dev, dst);
      } catch (const Error&) {
        rejected = true;
      }
      b.set_index_value_checks(previous);
      const std::vector<uint8_t> after = bytes_of(b.to_host(dst));
      if (rejected) {
        EXPECT_EQ(after, before);
      } else {
        const auto* from = src_host.ptr<const uint8_t>();
        for (int64_t i = 0; i < m; ++i) {
          const std::vector<uint8_t> got(after.begin() + i * 6, after.begin() + (i + 1) * 6);
          const std::vector<uint8_t> want =
              i == 4 ? std::vector<uint8_t>(before.begin() + i * 6, before.begin() + (i + 1) * 6)
                     : std::vector<uint8_t>(from + rows[size_t(i)] * 6,
                                            from + (rows[size_t(i)] + 1) * 6);
          EXPECT_EQ(got, want) << "row " << i;
        }
      }
    }
  });
}

// ---- merge_topk ----------------------------------------------------------------------------

// Host reference of merge_topk for row t of scores/positions [W, T, C]: the valid candidates
// (position >= 0), sorted by score descending with NaN below every number and ties to the lower
// position; the first k of them in ascending position order, -1 padded.
std::vector<int32_t> merge_topk_reference(const std::vector<float>& scores,
                                          const std::vector<int32_t>& positions, int64_t w_count,
                                          int64_t t_count, int64_t c, int64_t t, int k) {
  struct Candidate {
    float score;
    int32_t position;
  };
  std::vector<Candidate> cand;
  for (int64_t w = 0; w < w_count; ++w)
    for (int64_t j = 0; j < c; ++j) {
      const size_t i = size_t((w * t_count + t) * c + j);
      if (positions[i] >= 0) cand.push_back({scores[i], positions[i]});
    }
  std::sort(cand.begin(), cand.end(), [](const Candidate& a, const Candidate& b) {
    const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
    if (a_nan != b_nan) return b_nan;
    if (!a_nan && a.score != b.score) return a.score > b.score;
    return a.position < b.position;
  });
  std::vector<int32_t> out;
  for (size_t j = 0; j < cand.size() && j < size_t(k); ++j) out.push_back(cand[j].position);
  std::sort(out.begin(), out.end());
  out.resize(size_t(k), -1);
  return out;
}

// Scores and positions [W, T, C] of T rows: row t gets a candidate count from below k to all
// slots (0, k - 1, k, k + 1, n, random), distinct random positions in random slots with negative
// holes elsewhere, and scores either from a few values (ties, ±0, ±inf, NaN) or random.
struct TopkInputs {
  std::vector<float> scores;
  std::vector<int32_t> positions;
};

TopkInputs random_topk_inputs(Rng& rng, int64_t w_count, int64_t t_count, int64_t c, int k) {
  const int64_t n = w_count * c;
  TopkInputs in;
  in.scores.resize(size_t(n * t_count));
  in.positions.resize(size_t(n * t_count));
  const float few[] = {1.0f, 0.5f, 0.0f, -0.0f, -2.0f, kInf, -kInf, kNaN};
  for (int64_t t = 0; t < t_count; ++t) {
    const int64_t choices[] = {0, k - 1, k, k + 1, n, rng.randint(0, n)};
    const int64_t count = std::clamp<int64_t>(choices[t % 6], 0, n);
    // count distinct positions out of [0, range), in `count` random slots of the row.
    const int64_t range = 4 * n + k;
    std::vector<int32_t> pool(static_cast<size_t>(range));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng.gen());
    std::vector<int64_t> slots(static_cast<size_t>(n));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng.gen());
    std::vector<int32_t> row_pos(static_cast<size_t>(n));
    for (int64_t s = 0; s < n; ++s) {
      const int32_t hole = rng.randint(0, 3) == 0 ? std::numeric_limits<int32_t>::min()
                                                  : -int32_t(rng.randint(1, 3));
      row_pos[size_t(slots[size_t(s)])] = s < count ? pool[size_t(s)] : hole;
    }
    const bool ties = rng.randint(0, 1) == 1;
    for (int64_t s = 0; s < n; ++s) {
      const int64_t w = s / c, j = s % c;
      const size_t i = size_t((w * t_count + t) * c + j);
      in.positions[i] = row_pos[size_t(s)];
      in.scores[i] = ties ? few[rng.randint(0, 7)] : rng.normal();
    }
  }
  return in;
}

void check_merge_topk(Backend& b, const TopkInputs& in, int64_t w_count, int64_t t_count, int64_t c,
                      int k) {
  Tensor scores_host = Tensor::host(DType::kF32, {w_count, t_count, c});
  std::copy(in.scores.begin(), in.scores.end(), scores_host.ptr<float>());
  const Tensor scores = b.to_device(scores_host);
  const Tensor positions = b.to_device(host_i32(in.positions, {w_count, t_count, c}));
  const Tensor out = poisoned(b, DType::kI32, {t_count, k});
  b.merge_topk(scores, positions, k, out);
  const std::vector<int32_t> got = i32_of(b.to_host(out));
  for (int64_t t = 0; t < t_count; ++t) {
    const std::vector<int32_t> want =
        merge_topk_reference(in.scores, in.positions, w_count, t_count, c, t, k);
    const std::vector<int32_t> row(got.begin() + t * k, got.begin() + (t + 1) * k);
    EXPECT_EQ(row, want) << "row " << t;
    if (row != want) return;  // one row's diff is enough
  }
}

TEST(DcpMergeTopk, MatchesTheHostReference) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  for_each_backend([&](Backend& b) {
    for (const int64_t w : {1, 2, 3})
      for (const int64_t c : {1, 7, 64, 2048})
        for (const int k : {1, 5, 2048}) {
          SCOPED_TRACE("W " + std::to_string(w) + " C " + std::to_string(c) + " k " +
                       std::to_string(k));
          const int64_t t = w * c > 1000 ? 12 : 24;
          check_merge_topk(b, random_topk_inputs(rng, w, t, c, k), w, t, c, k);
        }
  });
}

// The largest rows (W * C at the limit), k up to W * C, and zero rows.
TEST(DcpMergeTopk, LimitAndEmpty) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  for_each_backend([&](Backend& b) {
    const int64_t c = Backend::kMergeTopkMaxCandidates / 2;
    check_merge_topk(b, random_topk_inputs(rng, 2, 6, c, 2048), 2, 6, c, 2048);
    check_merge_topk(b, random_topk_inputs(rng, 1, 6, 3 * 1024, 777), 1, 6, 3 * 1024, 777);
    // k >= W * C at the limit: every row keeps all its candidates (the most shared memory).
    check_merge_topk(b, random_topk_inputs(rng, 4, 3, c / 2, 2 * int(c)), 4, 3, c / 2, 2 * int(c));
    const Tensor scores = b.empty(DType::kF32, {2, 0, 4});
    const Tensor positions = b.empty(DType::kI32, {2, 0, 4});
    const Tensor out = b.empty(DType::kI32, {0, 3});
    b.merge_topk(scores, positions, 3, out);
  });
}

// Hand-made rows whose answer is known exactly: the order NaN < -inf < -2 < -0 == +0 < 1 < +inf,
// ties cut by position, a row of at most k read without its scores (NaN everywhere).
TEST(DcpMergeTopk, OrderAndTiesExactly) {
  for_each_backend([&](Backend& b) {
    // W = 2, T = 3, C = 4: shard 0's rows 0, 1, 2, then shard 1's.
    // clang-format off
    const std::vector<float> scores = {
        kNaN,  -kInf, 1.0f,  -0.0f,
        0.0f,  0.0f,  0.0f,  0.0f,
        kNaN,  kNaN,  kNaN,  kNaN,
        kInf,  0.0f,  -2.0f, 1.0f,
        -0.0f, 0.0f,  5.0f,  0.0f,
        kNaN,  kNaN,  kNaN,  kNaN};
    const std::vector<int32_t> positions = {
        10, 11, 12,  13,
        7,  3,  9,   -1,
        4,  -1, 2,   -5,
        20, 21, 22,  5,
        8,  1,  100, -1,
        -1, 0,  -1,  6};
    // clang-format on
    TopkInputs in{scores, positions};
    const int k = 4;
    // Row 0: +inf@20, 1@5, 1@12, then the zeros 13 (-0) and 21 (+0) tie: 13. -> 5 12 13 20.
    // Row 1: 5@100, then five zeros at 8 7 3 9 1 -> 1 3 7. -> 1 3 7 100.
    // Row 2: 4 candidates (<= k): 0 2 4 6, scores unread.
    for (int64_t t = 0; t < 3; ++t) {
      const std::vector<int32_t> want = merge_topk_reference(scores, positions, 2, 3, 4, t, k);
      const std::vector<std::vector<int32_t>> expected = {
          {5, 12, 13, 20}, {1, 3, 7, 100}, {0, 2, 4, 6}};
      ASSERT_EQ(want, expected[size_t(t)]) << "the reference itself, row " << t;
    }
    check_merge_topk(b, in, 2, 3, 4, k);
    // k = 7: row 0 adds +0@21, -2@22 and -inf@11; NaN@10 only at k = 8 (then all 8, <= k).
    check_merge_topk(b, in, 2, 3, 4, 7);
    check_merge_topk(b, in, 2, 3, 4, 8);
  });
}

// ---- merge_partials with bf16 parts ---------------------------------------------------------

TEST(DcpMergePartials, Bf16PartsMergeAsTheF32PartsOfTheirValues) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  const int64_t t = 5, h = 16, d = 512;
  for_each_backend([&](Backend& b) {
    for (const int64_t parts : {1, 2, 3}) {
      SCOPED_TRACE(std::to_string(parts) + " parts");
      const Tensor bf16_parts = testing::random_tensor(rng, DType::kBF16, {parts, t, h, d});
      Tensor f32_parts = Tensor::host(DType::kF32, {parts, t, h, d});
      for (int64_t i = 0; i < f32_parts.numel(); ++i)
        f32_parts.ptr<float>()[i] = bf16_to_f32(bf16_parts.ptr<const bf16_t>()[i]);
      Tensor lse_parts = testing::random_tensor(rng, DType::kF32, {parts, t, h}, 3.0f);
      float* l = lse_parts.ptr<float>();
      for (int64_t w = 0; w < parts; ++w) l[w * t * h + 1 * h] = kInf;  // token 1: no part
      l[2 * h + 3] = -kInf;                                             // a zero-mass part
      if (parts > 1) l[(parts - 1) * t * h + 4 * h] = kInf;             // token 4: one part less
      const Tensor lse_dev = b.to_device(lse_parts);
      for (const DType dt : {DType::kF32, DType::kBF16}) {
        SCOPED_TRACE(std::string("o ") + to_string(dt));
        const Tensor o_bf16 = poisoned(b, dt, {t, h, d}),
                     lse_bf16 = poisoned(b, DType::kF32, {t, h});
        const Tensor o_f32 = poisoned(b, dt, {t, h, d}), lse_f32 = poisoned(b, DType::kF32, {t, h});
        b.merge_partials(b.to_device(bf16_parts), lse_dev, o_bf16, lse_bf16);
        b.merge_partials(b.to_device(f32_parts), lse_dev, o_f32, lse_f32);
        EXPECT_EQ(bytes_of(b.to_host(o_bf16)), bytes_of(b.to_host(o_f32)));
        EXPECT_EQ(bytes_of(b.to_host(lse_bf16)), bytes_of(b.to_host(lse_f32)));
        // The merge itself is right: token 0 against a host merge of the f32 values.
        const Tensor o_host = b.to_host(o_f32), lse_host = b.to_host(lse_f32);
        for (int64_t hh = 0; hh < h; ++hh) {
          double m = -INFINITY, sum = 0;
          for (int64_t w = 0; w < parts; ++w) m = std::max<double>(m, l[w * t * h + hh]);
          for (int64_t w = 0; w < parts; ++w) sum += std::exp(double(l[w * t * h + hh]) - m);
          const double lse = m + std::log(sum);
          EXPECT_NEAR(lse_host.ptr<const float>()[hh], lse, 1e-4) << "head " << hh;
          for (int64_t e = 0; e < d; e += 37) {
            double o = 0;
            for (int64_t w = 0; w < parts; ++w)
              o += std::exp(double(l[w * t * h + hh]) - lse) *
                   f32_parts.ptr<const float>()[(w * t * h + hh) * d + e];
            EXPECT_NEAR(load_as_float(o_host, hh * d + e), o, dt == DType::kF32 ? 1e-4 : 2e-2)
                << "head " << hh << " value " << e;
          }
        }
      }
    }
  });
}

// ---- bad input -------------------------------------------------------------------------------

TEST(DcpOpsBadInput, ErrorsNameTheArgumentAndWriteNothing) {
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Rng rng(seed);
  for_each_backend([&](Backend& b) {
    const auto dev = [&](DType dt, const std::vector<int64_t>& shape) {
      return b.to_device(random_bytes(rng, dt, shape));
    };
    // select_rows
    const Tensor src = dev(DType::kBF16, {8, 3});
    const Tensor rows = b.to_device(host_i32({1, 2, 3, 7}, {4}));
    const Tensor dst = poisoned(b, DType::kBF16, {4, 3});
    const std::vector<uint8_t> dst_before = bytes_of(b.to_host(dst));
    const Tensor dst_f32 = poisoned(b, DType::kF32, {4, 3});
    const Tensor dst_wide = poisoned(b, DType::kBF16, {4, 4});
    const Tensor dst_short = poisoned(b, DType::kBF16, {3, 3});
    const Tensor dst_3d = poisoned(b, DType::kBF16, {4, 3, 1});
    const Tensor rows_f32 = dev(DType::kF32, {4});
    const Tensor rows_2d = b.to_device(host_i32({1, 2, 3, 7}, {4, 1}));
    expect_error_naming([&] { b.select_rows(src, rows, dst_f32); }, "dst");
    expect_error_naming([&] { b.select_rows(src, rows, dst_wide); }, "dst");
    expect_error_naming([&] { b.select_rows(src, rows, dst_short); }, "dst");
    expect_error_naming([&] { b.select_rows(src, rows, dst_3d); }, "dst");
    expect_error_naming([&] { b.select_rows(src, rows_f32, dst); }, "rows");
    expect_error_naming([&] { b.select_rows(src, rows_2d, dst); }, "rows");
    if (b.device() != Device::kCpu)
      expect_error_naming(
          [&] {
            b.select_rows(Tensor::host(DType::kBF16, {8, 3}), rows, dst);
          },
          "src");
    EXPECT_EQ(bytes_of(b.to_host(dst)), dst_before);
    expect_error_naming(
        [&] {
          b.select_rows(b.empty(DType::kBF16, {0, 3}), rows, dst);
        },
        "rows[0]");
    EXPECT_EQ(bytes_of(b.to_host(dst)), dst_before);

    // merge_topk
    const int64_t w = 2, t = 3, c = 5;
    const int k = 4;
    const Tensor scores = dev(DType::kF32, {w, t, c});
    const Tensor positions = b.to_device(host_i32(std::vector<int32_t>(w * t * c, 1), {w, t, c}));
    const Tensor out = poisoned(b, DType::kI32, {t, k});
    const std::vector<uint8_t> out_before = bytes_of(b.to_host(out));
    const Tensor scores_bf16 = dev(DType::kBF16, {w, t, c});
    const Tensor positions_short =
        b.to_device(host_i32(std::vector<int32_t>(w * t * 4, 1), {w, t, 4}));
    const Tensor positions_f32 = dev(DType::kF32, {w, t, c});
    const Tensor out_wide = poisoned(b, DType::kI32, {t, k + 1});
    const Tensor out_f32 = poisoned(b, DType::kF32, {t, k});
    const int64_t c_big = Backend::kMergeTopkMaxCandidates / 2 + 1;
    const Tensor scores_big = dev(DType::kF32, {2, 1, c_big});
    const Tensor positions_big = dev(DType::kI32, {2, 1, c_big});
    const Tensor out_one = poisoned(b, DType::kI32, {1, k});
    const Tensor scores_no_c = b.empty(DType::kF32, {w, t, 0});
    const Tensor positions_no_c = b.empty(DType::kI32, {w, t, 0});
    expect_error_naming([&] { b.merge_topk(scores_bf16, positions, k, out); }, "scores");
    expect_error_naming([&] { b.merge_topk(scores, positions_short, k, out); }, "positions");
    expect_error_naming([&] { b.merge_topk(scores, positions_f32, k, out); }, "positions");
    expect_error_naming([&] { b.merge_topk(scores, positions, k, out_wide); }, "out");
    expect_error_naming([&] { b.merge_topk(scores, positions, k, out_f32); }, "out");
    expect_error_naming([&] { b.merge_topk(scores, positions, 0, out); }, "k");
    expect_error_naming([&] { b.merge_topk(scores, positions, -3, out); }, "k");
    expect_error_naming([&] { b.merge_topk(scores_big, positions_big, k, out_one); }, "W * C");
    expect_error_naming([&] { b.merge_topk(scores_no_c, positions_no_c, k, out); }, "scores");
    EXPECT_EQ(bytes_of(b.to_host(out)), out_before);

    // merge_partials: parts of any dtype but bf16 and f32
    const Tensor o = poisoned(b, DType::kF32, {t, 2, 8});
    const Tensor lse = poisoned(b, DType::kF32, {t, 2});
    const std::vector<uint8_t> o_before = bytes_of(b.to_host(o));
    const Tensor lse_parts = dev(DType::kF32, {w, t, 2});
    expect_error_naming(
        [&] {
          b.merge_partials(dev(DType::kF64, {w, t, 2, 8}), lse_parts, o, lse);
        },
        "o_parts");
    expect_error_naming(
        [&] {
          b.merge_partials(dev(DType::kI32, {w, t, 2, 8}), lse_parts, o, lse);
        },
        "o_parts");
    expect_error_naming(
        [&] {
          b.merge_partials(dev(DType::kBF16, {w, t, 2, 9}), lse_parts, o, lse);
        },
        "o:");
    EXPECT_EQ(bytes_of(b.to_host(o)), o_before);
  });
}

}  // namespace
}  // namespace dsakit
