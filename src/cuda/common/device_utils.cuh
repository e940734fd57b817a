// Small device helpers shared by the CUDA kernels. Number formats come from dsakit/formats.h
// (host + device); nothing here redefines a format rule.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "dsakit/formats.h"

namespace dsakit::cuda {

inline constexpr int kWarpSize = 32;
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- cp.async ------------------------------------------------------------------------------
// Copies 16 bytes global -> shared; when !valid the destination is zero-filled and src is not
// read (it must still be a mapped address: callers pass a base pointer).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most kPending committed groups of this thread are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Two fp32 values as one register of two bf16 (lo = first), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Eight e4m3 codes (codes.x: codes 0-3, low byte first) as bf16(code · scale), one 16-byte chunk
// of 8 bf16. Exact when scale is 1 or a power of two (e4m3's 3 mantissa bits fit bf16's 7).
__device__ __forceinline__ uint4 e4m3x8_to_bf16(uint2 codes, float scale = 1.f) {
  const uint32_t words[2] = {codes.x, codes.y};
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[i >> 1] >> (16 * (i & 1)));
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    out[i] = pack_bf16x2(f.x * scale, f.y * scale);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Two fp32 values as one register of two f16 (lo = first), round to nearest even.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Four e4m3 codes (x: the first in the low byte) as two f16 pairs, exactly: lo = codes 0 and 1,
// hi = codes 2 and 3 (the first of each pair in the low half). The register's halves feed the
// conversions directly (no shifts to extract them).
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\n"
      "cvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
}

// Eight e4m3 codes (codes.x: codes 0-3, low byte first) as f16, one 16-byte chunk of 8 f16:
// exact (every e4m3 value, subnormals included, is an f16 value), one conversion per pair.
__device__ __forceinline__ uint4 e4m3x8_to_f16(uint2 codes) {
  uint4 out;
  e4m3x4_to_f16x2x2(codes.x, out.x, out.y);
  e4m3x4_to_f16x2x2(codes.y, out.z, out.w);
  return out;
}

// Both bf16 halves of v times (lo, hi) in fp32, rounded back to bf16.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t v, float lo, float hi) {
  const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  return pack_bf16x2(f.x * lo, f.y * hi);
}

// ---- quad reductions (the 4 lanes sharing an accumulator row) -------------------------------
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// 2^x by the SFU alone (ex2.approx.ftz: ~2 ulp, subnormal results flushed to 0), for softmax
// weights, which only ever scale values of their own row.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  return v;
}

// The sum of v over the warp, in every lane (every lane of the warp calls it).
__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// Inclusive scan of v over the warp's lanes (every lane of the warp calls it).
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = int(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int u = __shfl_up_sync(0xFFFFFFFFu, v, offset);
    if (lane >= offset) v += u;
  }
  return v;
}

// A float written as OutT: f32 as is, bf16 rounded to nearest even (formats.h).
template <typename OutT>
__device__ __forceinline__ OutT to_out(float v) {
  if constexpr (std::is_same_v<OutT, float>) {
    return v;
  } else {
    return f32_to_bf16(v);
  }
}

// A float / bf16 element read as float.
template <typename InT>
__device__ __forceinline__ float to_float(InT v) {
  if constexpr (std::is_same_v<InT, float>) {
    return v;
  } else {
    return bf16_to_f32(v);
  }
}

// x * y and x / y whose NaN results carry the bits an x86-64 host produces (SSE: the first NaN
// operand, quieted; an invalid operation such as inf/inf or 0*inf gives the negative default
// NaN 0xFFC00000). CUDA arithmetic returns one canonical NaN instead; with these the pool bytes
// and gathers equal the CPU backend's for NaN and infinite inputs too.
__device__ __forceinline__ float host_nan(float x, float y) {
  if (isnan(x)) return f32_from_bits(f32_bits(x) | 0x00400000u);
  if (isnan(y)) return f32_from_bits(f32_bits(y) | 0x00400000u);
  return f32_from_bits(0xFFC00000u);
}
__device__ __forceinline__ float host_mul(float x, float y) {
  const float r = x * y;
  return isnan(r) ? host_nan(x, y) : r;
}
__device__ __forceinline__ float host_div(float x, float y) {
  const float r = x / y;
  return isnan(r) ? host_nan(x, y) : r;
}

// quantize_e4m3 of formats.h (e4m3 of x / s, fp32 division) with the host's NaN bits.
__device__ __forceinline__ uint8_t quantize_e4m3_like_host(float x, float s) {
  return f32_to_e4m3(host_div(x, s));
}
// value = e4m3(code) * s rounded to fp32, with the host's NaN bits.
__device__ __forceinline__ float dequantize_e4m3_like_host(uint8_t code, float s) {
  return host_mul(e4m3_to_f32(code), s);
}

// Four consecutive bf16 values p[0..3] as floats by one 8-byte load: p must be 8-byte aligned.
__device__ __forceinline__ void load_bf16x4_aligned(const bf16_t* p, float (&v)[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);  // little-endian: element 0 is low
  v[0] = f32_from_bits(raw.x << 16);
  v[1] = f32_from_bits(raw.x & 0xFFFF0000u);
  v[2] = f32_from_bits(raw.y << 16);
  v[3] = f32_from_bits(raw.y & 0xFFFF0000u);
}

// The same for any p; one 8-byte load when p is 8-byte aligned (the usual case: tensors come
// from 256-byte aligned blocks and rows are multiples of 8 bytes).
__device__ __forceinline__ void load_bf16x4(const bf16_t* p, float (&v)[4]) {
  if ((reinterpret_cast<uintptr_t>(p) & 7u) == 0) {
    load_bf16x4_aligned(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = bf16_to_f32(p[j]);
  }
}

// Stores b[0..3] at p[0..3]; one 4-byte store when p is 4-byte aligned.
__device__ __forceinline__ void store_u8x4(uint8_t* p, const uint8_t (&b)[4]) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) {
    *reinterpret_cast<uint32_t*>(p) =
        uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = b[j];
  }
}

// fp32 stored / loaded little-endian at a byte address of any alignment.
__device__ __forceinline__ void store_f32(uint8_t* p, float v) {
  const uint32_t u = f32_bits(v);
  const uint8_t b[4] = {uint8_t(u), uint8_t(u >> 8), uint8_t(u >> 16), uint8_t(u >> 24)};
  store_u8x4(p, b);
}
__device__ __forceinline__ float load_f32(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) return *reinterpret_cast<const float*>(p);
  return f32_from_bits(uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) |
                       (uint32_t(p[3]) << 24));
}

// Copies nbytes (a multiple of 2) from src to dst, spread over threads tid = 0 … nthreads-1:
// 16-byte moves when both ends are 16-byte aligned and nbytes % 16 == 0, else 2-byte moves.
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const void* src, int nbytes, int tid,
                                           int nthreads) {
  const bool wide =
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | uintptr_t(nbytes)) &
       15u) == 0;
  if (wide) {
    const uint4* s = static_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int i = tid; i < nbytes / 16; i += nthreads) d[i] = s[i];
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int i = tid; i < nbytes / 2; i += nthreads) d[i] = s[i];
  }
}

// Number of blocks of `per_block` items covering n items.
inline int64_t ceil_div(int64_t n, int64_t per_block) {
  return (n + per_block - 1) / per_block;
}

}  // namespace dsakit::cuda
