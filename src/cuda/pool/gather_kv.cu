// gather_kv: dequantize n pool rows into c_kv [n, d_c] and k_pe [n, d_rope] (each bf16 or f32).
// One 128-thread block per location; consecutive threads read consecutive values of the row.
// value = e4m3(code) * scale rounded to fp32, then to the output dtype (the CPU formula); bf16
// values stored in the row are copied bit for bit to a bf16 output.
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

template <KvLayout kLayout>
__global__ void __launch_bounds__(kThreads) gather_kv_kernel(const GatherKvParams p) {
  const int64_t token = blockIdx.x;
  const int32_t loc = p.locs[token];
  const bool valid = loc >= 0 && loc < p.num_locations;  // invalid: zeros, row never read
  const int d_c = p.row.d_c, d_rope = p.row.d_rope;
  const uint8_t* row = p.rows + (valid ? int64_t(loc) * p.row.bytes_per_token() : 0);

  for (int e = threadIdx.x; e < d_c; e += kThreads) {
    const int64_t out = token * d_c + e;
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
  const uint8_t* rope = row + p.row.rope_offset();
  for (int e = threadIdx.x; e < d_rope; e += kThreads) {
    const int64_t out = token * d_rope + e;
    if (!valid) {
      write_value(p.k_pe, p.k_pe_f32, out, 0.0f);
    } else if constexpr (kLayout == KvLayout::kFp8Raw) {
      write_value(p.k_pe, p.k_pe_f32, out, dequantize_e4m3_like_host(rope[e], p.k_scale));
    } else {
      write_bf16_bits(p.k_pe, p.k_pe_f32, out, reinterpret_cast<const bf16_t*>(rope)[e]);
    }
  }
}

}  // namespace

cudaError_t launch_gather_kv(const GatherKvParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.n > INT32_MAX) return cudaErrorInvalidValue;
  const bool known = dispatch_kv_layout(p.row.layout, [&](auto layout) {
    gather_kv_kernel<decltype(layout)::value><<<unsigned(p.n), kThreads, 0, stream>>>(p);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace dsakit::cuda
