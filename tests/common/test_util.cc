#include "tests/common/test_util.h"

#include <cstdlib>
#include <cstring>
#include <limits>

namespace dsakit::testing {

uint64_t fresh_seed() {
  if (const char* s = std::getenv("DSAKIT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (uint64_t(rd()) << 32) ^ rd();
}

Tensor random_tensor(Rng& rng, DType dtype, const std::vector<int64_t>& shape, float stddev) {
  Tensor t = Tensor::host(dtype, shape);
  const int64_t n = t.numel();
  switch (dtype) {
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) t.ptr<bf16_t>()[i] = f32_to_bf16(rng.normal(stddev));
      break;
    case DType::kF32:
      for (int64_t i = 0; i < n; ++i) t.ptr<float>()[i] = rng.normal(stddev);
      break;
    case DType::kF64:
      for (int64_t i = 0; i < n; ++i) t.ptr<double>()[i] = rng.normal(stddev);
      break;
    case DType::kI32:
      for (int64_t i = 0; i < n; ++i) t.ptr<int32_t>()[i] = int32_t(rng.randint(-1000, 1000));
      break;
    case DType::kU8:
      for (int64_t i = 0; i < n; ++i) t.ptr<uint8_t>()[i] = uint8_t(rng.randint(0, 255));
      break;
  }
  return t;
}

std::vector<double> to_double(const TensorView& t) {
  std::vector<double> out(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[size_t(i)] = load_as_float(t, i);
  if (t.dtype == DType::kF64)
    for (int64_t i = 0; i < t.numel(); ++i) out[size_t(i)] = t.ptr<const double>()[i];
  return out;
}

double rel_l2(const std::vector<double>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0, nrm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return std::numeric_limits<double>::infinity();
    if (std::isnan(ref[i])) continue;
    const double d = out[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    nrm += out[i] * out[i];
  }
  if (den == 0) return std::sqrt(nrm);
  return std::sqrt(num / den);
}

double max_abs_diff(const std::vector<double>& out, const std::vector<double>& ref) {
  if (out.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double m = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (std::isnan(out[i]) != std::isnan(ref[i])) return std::numeric_limits<double>::infinity();
    if (std::isinf(out[i]) || std::isinf(ref[i])) {
      if (out[i] != ref[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    if (!std::isnan(ref[i])) m = std::max(m, std::fabs(out[i] - ref[i]));
  }
  return m;
}

uint64_t checksum(const TensorView& host) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const uint8_t*>(host.data);
  for (size_t i = 0; i < host.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

std::string peers_dir() {
  if (const char* s = std::getenv("DSAKIT_PEERS_DIR")) return s;
  return DSAKIT_PEERS_DIR_DEFAULT;
}

}  // namespace dsakit::testing

#include "dsakit/backend.h"

namespace dsakit::testing {
Tensor poisoned(Backend& be, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = be.empty(dtype, shape);
  if (dtype == DType::kI32)
    be.fill_bytes(t.view(), kSentinelByte);
  else
    be.poison(t.view());
  return t;
}

void expect_error_naming(const std::function<void()>& fn, const std::string& arg,
                         std::optional<ErrorKind> kind) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error naming '" << arg << "'";
  } catch (const Error& e) {
    if (kind) EXPECT_EQ(e.kind(), *kind) << e.what();
    EXPECT_NE(std::string(e.what()).find(arg), std::string::npos)
        << "message '" << e.what() << "' does not name '" << arg << "'";
  }
}

std::vector<std::string> test_backends() {
  if (const char* s = std::getenv("DSAKIT_TEST_BACKENDS")) {
    std::vector<std::string> out;
    std::string cur;
    for (const char* p = s;; ++p) {
      if (*p == ',' || *p == 0) {
        if (!cur.empty()) out.push_back(cur);
        cur.clear();
        if (*p == 0) break;
      } else {
        cur += *p;
      }
    }
    return out;
  }
  std::vector<std::string> out{"cpu"};
  if (cuda_device_count() > 0) out.push_back("cuda");
  return out;
}
}  // namespace dsakit::testing
