// Launchers of the pool kernels (docs/formats.md): latent-pool store / gather in all three layouts
// and the indexer-key store. Plain parameter structs; no dsakit API types beyond the format
// descriptions of dsakit/pool.h. Every location is bound-checked in the kernel: an out-of-range
// location is skipped by a store and gathers as zeros, never dereferenced.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsakit/formats.h"

namespace dsakit::cuda {

struct StoreKvParams {
  const int32_t* locs;  // [n] pool locations
  const bf16_t* c_kv;   // [n, d_c]    rows c_kv_stride apart
  const bf16_t* k_pe;   // [n, d_rope] rows k_pe_stride apart
  int64_t c_kv_stride;  // elements, >= d_c
  int64_t k_pe_stride;  // elements, >= d_rope
  uint8_t* rows;        // [num_locations, row.bytes_per_token()]
  int64_t n;
  int64_t num_locations;
  KvRowLayout row;
  ScalePolicy scale_policy;  // fp8 (656 B) only
  float k_scale;             // fp8-raw only
};

struct GatherKvParams {
  const int32_t* locs;  // [n] pool locations
  const uint8_t* rows;  // [num_locations, row.bytes_per_token()]
  void* c_kv;           // [n, d_c]    f32 if c_kv_f32 else bf16; rows c_kv_stride apart
  void* k_pe;           // [n, d_rope] f32 if k_pe_f32 else bf16; rows k_pe_stride apart
  bool c_kv_f32;
  bool k_pe_f32;
  int64_t c_kv_stride;  // elements, >= d_c
  int64_t k_pe_stride;  // elements, >= d_rope
  int64_t n;
  int64_t num_locations;
  KvRowLayout row;
  float k_scale;  // fp8-raw only
};

// FP8 pool rows as a block-scaled FP8 GEMM reads them (up_proj_kv_fp8), split as its caller runs
// the GEMM: rows [0, n_main) and, when n > n_main, a tail of tail_rows rows [n_main, n_padded),
// n_padded = n_main + tail_rows. codes u8 [n_padded, d_c]: row r < n the row's d_c latent codes
// as stored, zeros past n or for an invalid location. Scales f32 per 128-column tile,
// tile-major in two parts: row r < n_main at scales[b * n_main + r], row n_main <= r < n_padded
// at tail_scales[b * tail_rows + r - n_main] (tile scale, k_scale for fp8-raw; 0 past n or for
// an invalid location). k_pe as GatherKvParams::k_pe.
struct GatherKvCodesParams {
  const int32_t* locs;  // [n] pool locations
  const uint8_t* rows;  // [num_locations, row.bytes_per_token()], an fp8 or fp8-raw layout
  uint8_t* codes;
  float* scales;
  float* tail_scales;
  void* k_pe;  // [n, d_rope] f32 if k_pe_f32 else bf16
  bool k_pe_f32;
  int64_t n;
  int64_t n_main;  // <= n; n - n_main <= tail_rows
  int tail_rows;
  int64_t num_locations;
  KvRowLayout row;  // d_c a multiple of 128
  float k_scale;    // fp8-raw only
};

struct StoreIndexKeysParams {
  const int32_t* locs;  // [n] index-pool locations
  const bf16_t* keys;   // [n, d_i]
  uint8_t* pages;       // [num_pages, page_size * (d_i + 4)]: codes [page_size, d_i], scales
  int64_t n;
  int64_t num_locations;  // num_pages * page_size
  int page_size;
  int d_i;  // multiple of 16
};

cudaError_t launch_store_kv(const StoreKvParams& p, cudaStream_t stream);
cudaError_t launch_gather_kv(const GatherKvParams& p, cudaStream_t stream);
cudaError_t launch_gather_kv_codes(const GatherKvCodesParams& p, cudaStream_t stream);
cudaError_t launch_store_index_keys(const StoreIndexKeysParams& p, cudaStream_t stream);
// Both stores in one launch: kv's n latent rows and keys' n indexer keys.
cudaError_t launch_store_tokens(const StoreKvParams& kv, const StoreIndexKeysParams& keys,
                                cudaStream_t stream);

}  // namespace dsakit::cuda
