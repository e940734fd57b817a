// gather_kv: dequantize n pool rows into c_kv [n, d_c] and k_pe [n, d_rope] (each bf16 or f32,
// rows strided).
// One 128-thread block per location; consecutive threads read consecutive values of the row.
// value = e4m3(code) * scale rounded to fp32, then to the output dtype (the CPU formula); bf16
// values stored in the row are copied bit for bit to a bf16 output.
// gather_kv_codes: the same rows' latent codes and tile scales as stored, for an FP8 GEMM.
#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/dispatch.h"
#include "src/cuda/pool/kv_pool_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ void write_value(void* out, bool f32, int64_t i, float v) {
  if (f32) {
    static_cast<float*>(out)[i] = v;
  } else {
    static_cast<bf16_t*>(out)[i] = f32_to_bf16(v);
  }
}

__device__ __forceinline__ void write_bf16_bits(void* out, bool f32, int64_t i, bf16_t v) {
  if (f32) {
    static_cast<float*>(out)[i] = bf16_to_f32(v);
  } else {
    static_cast<bf16_t*>(out)[i] = v;
  }
}

// k_pe of one gathered row (its location valid or not) into row `token` of k_pe (rows `stride`
// elements apart).
template <KvLayout kLayout>
__device__ __forceinline__ void gather_rope(const uint8_t* rope, bool valid, int64_t token,
                                            int d_rope, void* k_pe, int64_t stride, bool k_pe_f32,
                                            float k_scale) {
  for (int e = threadIdx.x; e < d_rope; e += kThreads) {
    const int64_t out = token * stride + e;
    if (!valid) {
      write_value(k_pe, k_pe_f32, out, 0.0f);
    } else if constexpr (kLayout == KvLayout::kFp8Raw) {
      write_value(k_pe, k_pe_f32, out, dequantize_e4m3_like_host(rope[e], k_scale));
    } else {
      write_bf16_bits(k_pe, k_pe_f32, out, reinterpret_cast<const bf16_t*>(rope)[e]);
    }
  }
}

template <KvLayout kLayout>
__global__ void __launch_bounds__(kThreads) gather_kv_kernel(const GatherKvParams p) {
  const int64_t token = blockIdx.x;
  const int32_t loc = p.locs[token];
  const bool valid = loc >= 0 && loc < p.num_locations;  // invalid: zeros, row never read
  const int d_c = p.row.d_c, d_rope = p.row.d_rope;
  const uint8_t* row = p.rows + (valid ? int64_t(loc) * p.row.bytes_per_token() : 0);

  for (int e = threadIdx.x; e < d_c; e += kThreads) {
    const int64_t out = token * p.c_kv_stride + e;
    if (!valid) {
      write_value(p.c_kv, p.c_kv_f32, out, 0.0f);
    } else if constexpr (kLayout == KvLayout::kBf16) {
      write_bf16_bits(p.c_kv, p.c_kv_f32, out, reinterpret_cast<const bf16_t*>(row)[e]);
    } else {
      const float scale = kLayout == KvLayout::kFp8Scaled
                              ? load_f32(row + p.row.scales_offset() + 4 * (e / kFp8TileSize))
                              : p.k_scale;
      write_value(p.c_kv, p.c_kv_f32, out, dequantize_e4m3_like_host(row[e], scale));
    }
  }
  gather_rope<kLayout>(row + p.row.rope_offset(), valid, token, d_rope, p.k_pe, p.k_pe_stride,
                       p.k_pe_f32, p.k_scale);
}

// One block per row r of [0, n_padded): its codes by 16-byte chunks, its tile scales, its k_pe.
template <KvLayout kLayout>
__global__ void __launch_bounds__(kThreads) gather_kv_codes_kernel(const GatherKvCodesParams p) {
  static_assert(kLayout != KvLayout::kBf16, "the bf16 layout has no codes");
  const int64_t r = blockIdx.x, n_main = p.n_main;
  const int32_t loc = r < p.n ? p.locs[r] : -1;
  const bool valid = loc >= 0 && loc < p.num_locations;
  const int d_c = p.row.d_c, tiles = d_c / kFp8TileSize;
  const uint8_t* row = p.rows + (valid ? int64_t(loc) * p.row.bytes_per_token() : 0);
  for (int c = threadIdx.x; c < d_c / 16; c += kThreads) {
    const uint4 v = valid ? reinterpret_cast<const uint4*>(row)[c] : make_uint4(0, 0, 0, 0);
    reinterpret_cast<uint4*>(p.codes + r * d_c)[c] = v;
  }
  for (int b = threadIdx.x; b < tiles; b += kThreads) {
    float s = 0.0f;
    if (valid)
      s = kLayout == KvLayout::kFp8Scaled ? load_f32(row + p.row.scales_offset() + 4 * b)
                                          : p.k_scale;
    if (r < n_main)
      p.scales[b * n_main + r] = s;
    else
      p.tail_scales[int64_t(b) * p.tail_rows + (r - n_main)] = s;
  }
  if (r < p.n)
    gather_rope<kLayout>(row + p.row.rope_offset(), valid, r, p.row.d_rope, p.k_pe, p.row.d_rope,
                         p.k_pe_f32, p.k_scale);
}

}  // namespace

cudaError_t launch_gather_kv_codes(const GatherKvCodesParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.n_main < 0 || p.n_main > p.n || p.n - p.n_main > p.tail_rows ||
      p.n > INT32_MAX - p.tail_rows || p.row.d_c % kFp8TileSize != 0)
    return cudaErrorInvalidValue;
  const auto padded = unsigned(p.n_main + (p.n > p.n_main ? p.tail_rows : 0));
  if (p.row.layout == KvLayout::kFp8Scaled)
    gather_kv_codes_kernel<KvLayout::kFp8Scaled><<<padded, kThreads, 0, stream>>>(p);
  else if (p.row.layout == KvLayout::kFp8Raw)
    gather_kv_codes_kernel<KvLayout::kFp8Raw><<<padded, kThreads, 0, stream>>>(p);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t launch_gather_kv(const GatherKvParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.n > INT32_MAX) return cudaErrorInvalidValue;
  const bool known = dispatch_kv_layout(p.row.layout, [&](auto layout) {
    gather_kv_kernel<decltype(layout)::value><<<unsigned(p.n), kThreads, 0, stream>>>(p);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace dsakit::cuda
