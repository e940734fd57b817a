// Division by a divisor fixed at launch time as a multiply-high, an add and a shift (the
// round-up method of Granlund and Montgomery): for d >= 1 and 0 <= n < 2^31,
//   div(n) = (mulhi(n, magic) + n) >> shift = floor(n / d),
// shift = ceil(log2 d), magic = floor(2^32 (2^shift - d) / d) + 1 (the sum stays below 2^32
// because n < 2^31). Host and device; the kernels take it in their POD parameters.
#pragma once

#include <bit>
#include <cstdint>

#ifdef __CUDACC__
#define DSAKIT_HOST_DEVICE __host__ __device__
#else
#define DSAKIT_HOST_DEVICE
#endif

namespace dsakit::cuda {

struct FastDivmod {
  uint32_t divisor = 1;
  uint32_t magic = 1;
  uint32_t shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d), shift(uint32_t(std::bit_width(d - 1))) {
    magic = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }

  // floor(n / divisor) for 0 <= n < 2^31.
  DSAKIT_HOST_DEVICE uint32_t div(uint32_t n) const {
#ifdef __CUDA_ARCH__
    const uint32_t hi = __umulhi(n, magic);
#else
    const uint32_t hi = uint32_t((uint64_t(n) * magic) >> 32);
#endif
    return (hi + n) >> shift;
  }
};

}  // namespace dsakit::cuda
