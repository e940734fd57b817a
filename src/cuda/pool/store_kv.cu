// store_kv: quantize n latent tokens (c_kv bf16 [n, d_c], k_pe bf16 [n, d_rope]) into their pool
// rows. One 128-thread block per token. fp8 (656 B): each warp owns 128-value tiles, a lane owns
// 4 consecutive values, the tile amax is a warp max, then every lane quantizes its 4 values with
// the tile scale (fp32 division, formats.h) and stores 4 code bytes at once. Same formulas as
// the CPU backend, so the bytes are identical.
#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/dispatch.h"
#include "src/cuda/pool/kv_pool_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarpSize;

template <KvLayout kLayout>
__global__ void __launch_bounds__(kThreads) store_kv_kernel(const StoreKvParams p) {
  const int64_t token = blockIdx.x;
  const int32_t loc = p.locs[token];
  if (loc < 0 || loc >= p.num_locations) return;
  const int d_c = p.row.d_c, d_rope = p.row.d_rope;
  const bf16_t* c_kv = p.c_kv + token * d_c;
  const bf16_t* k_pe = p.k_pe + token * d_rope;
  uint8_t* row = p.rows + int64_t(loc) * p.row.bytes_per_token();

  if constexpr (kLayout == KvLayout::kBf16) {
    copy_bytes(row, c_kv, 2 * d_c, threadIdx.x, kThreads);
    copy_bytes(row + p.row.rope_offset(), k_pe, 2 * d_rope, threadIdx.x, kThreads);
  } else if constexpr (kLayout == KvLayout::kFp8Scaled) {
    const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
    static_assert(kFp8TileSize == 4 * kWarpSize, "a lane owns 4 values of a tile");
    for (int tile = warp; tile < d_c / kFp8TileSize; tile += kWarps) {
      const int first = tile * kFp8TileSize + 4 * lane;
      float v[4];
      load_bf16x4(c_kv + first, v);
      float amax = 0.0f;  // fmaxf skips NaN, as the CPU backend's amax does
#pragma unroll
      for (int j = 0; j < 4; ++j) amax = fmaxf(amax, fabsf(v[j]));
      const float scale = fp8_tile_scale(warp_max(amax), p.scale_policy);
      uint8_t codes[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) codes[j] = quantize_e4m3_like_host(v[j], scale);
      store_u8x4(row + first, codes);
      if (lane == 0) store_f32(row + p.row.scales_offset() + 4 * tile, scale);
    }
    copy_bytes(row + p.row.rope_offset(), k_pe, 2 * d_rope, threadIdx.x, kThreads);
  } else {
    // fp8-raw: [c_kv | k_pe] as e4m3(x / k_scale); d_c and d_rope are multiples of 4, so a
    // group of 4 never straddles the two parts. rope_offset() == d_c for this layout.
    for (int group = threadIdx.x; group < (d_c + d_rope) / 4; group += kThreads) {
      const int e = 4 * group;
      float v[4];
      load_bf16x4(e < d_c ? c_kv + e : k_pe + (e - d_c), v);
      uint8_t codes[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) codes[j] = quantize_e4m3_like_host(v[j], p.k_scale);
      store_u8x4(row + e, codes);
    }
  }
}

}  // namespace

cudaError_t launch_store_kv(const StoreKvParams& p, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  if (p.n > INT32_MAX || p.row.d_c % kFp8TileSize != 0 || p.row.d_rope % 8 != 0)
    return cudaErrorInvalidValue;
  const bool known = dispatch_kv_layout(p.row.layout, [&](auto layout) {
    store_kv_kernel<decltype(layout)::value><<<unsigned(p.n), kThreads, 0, stream>>>(p);
  });
  return known ? cudaGetLastError() : cudaErrorInvalidValue;
}

}  // namespace dsakit::cuda
