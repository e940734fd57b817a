// The pool stores' per-block work, shared by their kernels (store_kv.cu, store_index_keys.cu)
// and the fused store of both (store_tokens): every block is kStoreThreads threads.
//   store_kv_row: one token's latent row (c_kv bf16 [d_c], k_pe bf16 [d_rope]) quantized into
//     its pool row. fp8 (656 B): each warp owns 128-value tiles, a lane owns 4 consecutive
//     values, the tile amax is a warp max, then every lane quantizes its 4 values with the tile
//     scale (fp32 division, formats.h) and stores 4 code bytes at once. Same formulas as the CPU
//     backend, so the bytes are identical.
//   store_index_keys_block: kKeysPerStoreBlock indexer keys, one warp per key, quantized with the
//     power-of-two scale of docs/formats.md#scale-rules (common/quantize.cuh). Location l:
//       page = l / page_size, slot = l % page_size, page_bytes = page_size * (d_i + 4);
//       codes at page * page_bytes + slot * d_i, scale at page * page_bytes + page_size * d_i + 4
//       slot.
// A location outside [0, num_locations) is skipped.
#pragma once

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/quantize.cuh"
#include "src/cuda/pool/kv_pool_kernels.h"

namespace dsakit::cuda {

constexpr int kStoreThreads = 128;
constexpr int kKeysPerStoreBlock = kStoreThreads / kWarpSize;

template <KvLayout kLayout>
__device__ __forceinline__ void store_kv_row(const StoreKvParams& p, int64_t token) {
  constexpr int kWarps = kStoreThreads / kWarpSize;
  const int32_t loc = p.locs[token];
  if (loc < 0 || loc >= p.num_locations) return;
  const int d_c = p.row.d_c, d_rope = p.row.d_rope;
  const bf16_t* c_kv = p.c_kv + token * p.c_kv_stride;
  const bf16_t* k_pe = p.k_pe + token * p.k_pe_stride;
  uint8_t* row = p.rows + int64_t(loc) * p.row.bytes_per_token();

  if constexpr (kLayout == KvLayout::kBf16) {
    copy_bytes(row, c_kv, 2 * d_c, threadIdx.x, kStoreThreads);
    copy_bytes(row + p.row.rope_offset(), k_pe, 2 * d_rope, threadIdx.x, kStoreThreads);
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
    copy_bytes(row + p.row.rope_offset(), k_pe, 2 * d_rope, threadIdx.x, kStoreThreads);
  } else {
    // fp8-raw: [c_kv | k_pe] as e4m3(x / k_scale); d_c and d_rope are multiples of 4, so a
    // group of 4 never straddles the two parts. rope_offset() == d_c for this layout.
    for (int group = threadIdx.x; group < (d_c + d_rope) / 4; group += kStoreThreads) {
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

__device__ __forceinline__ void store_index_keys_block(const StoreIndexKeysParams& p,
                                                       int64_t block) {
  const int64_t key = block * kKeysPerStoreBlock + threadIdx.x / kWarpSize;
  if (key >= p.n) return;  // warp-uniform
  const int32_t loc = p.locs[key];
  if (loc < 0 || loc >= p.num_locations) return;
  const int64_t page_bytes = int64_t(p.page_size) * (p.d_i + 4);
  uint8_t* page = p.pages + (loc / p.page_size) * page_bytes;
  const int slot = loc % p.page_size;
  const int lane = threadIdx.x % kWarpSize;
  const float scale =
      warp_quantize_pow2(p.keys + key * p.d_i, p.d_i, page + int64_t(slot) * p.d_i, lane);
  if (lane == 0) store_f32(page + int64_t(p.page_size) * p.d_i + 4 * slot, scale);
}

}  // namespace dsakit::cuda
