// Device helpers of src/cuda/common/device_utils.cuh on the device, against formats.h's host
// decoding (tests/cuda/device_utils_probe.cu launches them). Skipped without a CUDA device.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/formats.h"
#include "tests/common/test_util.h"
#include "tests/cuda/device_utils_probe.h"

namespace dsakit {
namespace {

float f16_bits_to_f32(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

// A device copy of a host vector, freed at scope exit.
template <typename T>
struct DeviceVector {
  T* ptr = nullptr;
  explicit DeviceVector(const std::vector<T>& host) {
    EXPECT_EQ(cudaMalloc(&ptr, host.size() * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  ~DeviceVector() { cudaFree(ptr); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
};

// Every pair of e4m3 codes at every byte position, the other bytes of both words random: the
// f16 pair is (code_a, code_b) · 2^-8 exactly, signs (and zeros' signs) kept; NaN codes read as
// ±1.875 with their sign.
TEST(CudaDeviceUtils, E4m3PairToF16x2BitsIsEveryCodeTimesTwoToTheMinus8) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  testing::Rng rng(seed);
  constexpr int kN = 4 * 256 * 256;
  std::vector<uint32_t> a(kN), b(kN), out(kN);
  std::vector<int32_t> j(kN);
  for (int i = 0; i < kN; ++i) {
    j[i] = i / (256 * 256);
    const uint32_t ca = i % 256, cb = i / 256 % 256, other = 0xffu << (8 * j[i]);
    a[i] = (uint32_t(rng.gen()()) & ~other) | ca << (8 * j[i]);
    b[i] = (uint32_t(rng.gen()()) & ~other) | cb << (8 * j[i]);
  }
  DeviceVector<uint32_t> a_d(a), b_d(b), out_d(std::vector<uint32_t>(kN, 0xffffffffu));  // NaN
  DeviceVector<int32_t> j_d(j);
  ASSERT_EQ(cuda::testing::e4m3_pairs_by_bits(a_d.ptr, b_d.ptr, j_d.ptr, out_d.ptr, kN, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), out_d.ptr, kN * sizeof(uint32_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int wrong = 0;
  for (int i = 0; i < kN && wrong < 10; ++i) {
    const uint8_t codes[2] = {uint8_t(i % 256), uint8_t(i / 256 % 256)};
    for (int h = 0; h < 2; ++h) {
      const float got = f16_bits_to_f32(uint16_t(out[i] >> (16 * h)));
      const float value = e4m3_to_f32(codes[h]);
      const float want = std::isnan(value) ? std::copysign(1.875f, (codes[h] & 0x80) ? -1.f : 1.f)
                                           : std::ldexp(value, -8);
      if (got != want || std::signbit(got) != std::signbit(want)) {
        ADD_FAILURE() << "byte " << j[i] << " code 0x" << std::hex << int(codes[h]) << std::dec
                      << " (" << (h == 0 ? "a" : "b") << "): got " << got << ", want " << want;
        ++wrong;
      }
    }
  }
}

}  // namespace
}  // namespace dsakit
