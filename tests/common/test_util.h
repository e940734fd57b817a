// Test helpers: fresh random data (seed printed on failure), errors vs. a reference, poison.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "dsakit/error.h"
#include "dsakit/formats.h"
#include "dsakit/tensor.h"

namespace dsakit {
class Backend;
}

namespace dsakit::testing {

// A fresh seed per call (std::random_device) unless DSAKIT_TEST_SEED is set; record it with
// SCOPED_TRACE so a failure can be replayed.
uint64_t fresh_seed();

class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  float normal(float stddev = 1.0f) { return std::normal_distribution<float>(0.f, stddev)(gen_); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(gen_); }
  int64_t randint(int64_t lo, int64_t hi_inclusive) {
    return std::uniform_int_distribution<int64_t>(lo, hi_inclusive)(gen_);
  }
  std::mt19937_64& gen() { return gen_; }

 private:
  std::mt19937_64 gen_;
};

// Host tensors filled with normal(0, stddev) values (bf16 rounded for bf16 tensors).
Tensor random_tensor(Rng& rng, DType dtype, const std::vector<int64_t>& shape, float stddev = 1.0f);

// Values of a bf16/f32/f64 host tensor as double.
std::vector<double> to_double(const TensorView& t);

// ‖out − ref‖₂ / ‖ref‖₂ (‖out‖₂ when ref is all zero). NaN anywhere in out gives +inf.
double rel_l2(const std::vector<double>& out, const std::vector<double>& ref);
double max_abs_diff(const std::vector<double>& out, const std::vector<double>& ref);

// FNV-1a 64 of a host tensor's bytes: pool checksums before/after rejected calls.
uint64_t checksum(const TensorView& host);

// The byte of a poisoned i32 tensor: 0x5A5A5A5A is no position, and not the -1 that top-k and
// the DCP ops write on purpose.
inline constexpr uint8_t kSentinelByte = 0x5A;

// A tensor on `be` that shows whatever an op leaves unwritten: NaN in the float dtypes and 0xFF
// bytes in u8 (Backend::poison), kSentinelByte bytes in i32.
Tensor poisoned(Backend& be, DType dtype, const std::vector<int64_t>& shape);

// fn throws a dsakit::Error whose message names `arg` (and of kind `kind`, when given).
void expect_error_naming(const std::function<void()>& fn, const std::string& arg,
                         std::optional<ErrorKind> kind = std::nullopt);

// Tolerances of docs/numerics.md#tolerances.
inline constexpr double kTolBf16 = 1e-2;
inline constexpr double kTolF32 = 1e-5;
inline constexpr double kTolFp8Pool = 3e-2;
inline constexpr double kTolLse = 1e-3;

// Directory of the peer kernels' golden files: tests/data/peers (the CMake cache variable
// DSAKIT_PEERS_DIR sets the build default; the environment variable of that name overrides it).
std::string peers_dir();

}  // namespace dsakit::testing

namespace dsakit::testing {
// Backends the kernel tests run against: "cpu", plus "cuda" when a GPU is present.
// DSAKIT_TEST_BACKENDS=cpu,cuda overrides (a listed backend that cannot start fails the test).
std::vector<std::string> test_backends();
}  // namespace dsakit::testing
