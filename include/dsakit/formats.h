// Number formats shared by every backend: bfloat16 and FP8 e4m3fn conversions and the scale
// rules of docs/formats.md. Header-only and usable from host and device code.
//
// Invariants:
//  * float -> bf16 and float -> e4m3 round to nearest, ties to even.
//  * float -> e4m3 saturates: |x| >= 448 (including ±inf) gives ±448; NaN gives 0x7F | sign.
//  * e4m3fn has no infinities; 0x7F and 0xFF are NaN; max finite 448; min subnormal 2^-9.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSAKIT_HD __host__ __device__ __forceinline__
#else
#define DSAKIT_HD inline
#endif

namespace dsakit {

// bfloat16 storage: the upper 16 bits of an IEEE fp32.
struct bf16_t {
  uint16_t bits;
};
static_assert(sizeof(bf16_t) == 2);

DSAKIT_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

DSAKIT_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

DSAKIT_HD float bf16_to_f32(bf16_t v) {
  return f32_from_bits(uint32_t(v.bits) << 16);
}

DSAKIT_HD bf16_t f32_to_bf16(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_t{uint16_t((u >> 16) | 0x0040u)};  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16_t{uint16_t(u >> 16)};
}

// Round to bf16 and back: the value a bf16 tensor would hold.
DSAKIT_HD float round_bf16(float x) {
  return bf16_to_f32(f32_to_bf16(x));
}

inline constexpr float kE4m3Max = 448.0f;

DSAKIT_HD float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xFu;
  const uint32_t man = c & 0x7u;
  if (exp == 0xFu && man == 0x7u) return f32_from_bits(sign | 0x7FC00000u);  // NaN
  if (exp == 0) {
    // subnormal: man * 2^-9 (exact in fp32)
    const float v = float(man) * 0.001953125f;
    return f32_from_bits(f32_bits(v) | sign);
  }
  // normal: rebias 7 -> 127, widen mantissa 3 -> 23 bits
  return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

DSAKIT_HD uint8_t f32_to_e4m3(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint8_t(sign | 0x7Fu);   // NaN
  if (a >= 0x43E00000u) return uint8_t(sign | 0x7Eu);  // |x| >= 448 (incl. inf): saturate
  if (a < 0x3C800000u) {                               // |x| < 2^-6: subnormal range
    const float t = f32_from_bits(a) * 512.0f;         // exact: multiply by a power of two
    uint32_t m = uint32_t(t);
    const float frac = t - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;  // m == 8 becomes the smallest normal
    return uint8_t(sign | m);
  }
  uint32_t r = a + 0x7FFFFu + ((a >> 20) & 1u);  // round mantissa to 3 bits, RNE
  r >>= 20;                                      // (exp8 << 3) | man3, fp32 bias
  r -= (127u - 7u) << 3;                         // rebias to 7
  if (r > 0x7Eu) r = 0x7Eu;                      // 448 <= rounded: saturate
  return uint8_t(sign | r);
}

// The smallest power of two >= v, for finite v > 0 in the normal fp32 range. Exact.
DSAKIT_HD float pow2_ceil(float v) {
  const uint32_t u = f32_bits(v);
  if ((u & 0x007FFFFFu) == 0) return v;
  return f32_from_bits((u & 0x7F800000u) + 0x00800000u);
}

// Latent-pool FP8 scale policies (docs/formats.md#scale-rules), from the amax of one 128-value
// tile.
enum class ScalePolicy : uint8_t {
  kAmax,  // s = max(amax / 448, FLT_MIN)
  kPow2,  // s = smallest power of two >= max(amax / 448, 1e-4)
};

DSAKIT_HD float fp8_tile_scale(float amax, ScalePolicy policy) {
  const float v = amax / kE4m3Max;
  if (policy == ScalePolicy::kAmax) return v > 1.17549435e-38f ? v : 1.17549435e-38f;
  return pow2_ceil(v > 1e-4f ? v : 1e-4f);
}

// Indexer scale (docs/formats.md#scale-rules): smallest power of two >= max(amax, 1e-4) / 448.
DSAKIT_HD float indexer_fp8_scale(float amax) {
  return pow2_ceil((amax > 1e-4f ? amax : 1e-4f) / kE4m3Max);
}

// Stored byte = e4m3(x / s), division in fp32 (inputs clamped by f32_to_e4m3's saturation).
DSAKIT_HD uint8_t quantize_e4m3(float x, float s) {
  return f32_to_e4m3(x / s);
}

// ---- latent pool rows -----------------------------------------------------------------
// The three latent-pool layouts; docs/formats.md gives them byte by byte.
enum class KvLayout : uint8_t { kBf16, kFp8Scaled, kFp8Raw };

inline constexpr int kFp8TileSize = 128;  // values per fp32 scale in the fp8 (656 B) layout

// Byte layout of one latent token row.
struct KvRowLayout {
  KvLayout layout;
  int d_c;
  int d_rope;

  DSAKIT_HD int bytes_per_token() const {
    switch (layout) {
      case KvLayout::kBf16:
        return 2 * (d_c + d_rope);
      case KvLayout::kFp8Scaled:
        return d_c + 4 * (d_c / kFp8TileSize) + 2 * d_rope;
      case KvLayout::kFp8Raw:
        return d_c + d_rope;
    }
    return 0;
  }
  DSAKIT_HD int scales_offset() const { return d_c; }  // fp8 only
  DSAKIT_HD int rope_offset() const {
    return layout == KvLayout::kBf16     ? 2 * d_c
           : layout == KvLayout::kFp8Raw ? d_c
                                         : d_c + 4 * (d_c / kFp8TileSize);
  }
};

}  // namespace dsakit
