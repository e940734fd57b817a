// Parameters and launcher of the dense MHA prefill kernel (DESIGN.md §3.5): varlen causal
// attention with a cached prefix, K = [k_nope per head, k_pe shared by all heads], V per head.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsakit/formats.h"

namespace dsakit::cuda::dense_mha {

// One query tile of one request, built on the host from cu_q / cu_kv. Query row
// q_begin + i (0 <= i < q_len <= 64) sees kv rows kv_begin + [0, first_query_pos + i].
struct DenseTile {
  int32_t q_begin;          // first query row (global, into q / o)
  int32_t q_len;            // query rows in the tile, 1..64
  int32_t kv_begin;         // cu_kv[r]
  int32_t first_query_pos;  // position of row q_begin in its request: L_r - E_r + i0
};

// Schedules of up to this many tiles travel in the launch's parameters (2 KiB; prompts up to
// 8K tokens in one request); longer ones are copied to the device first.
inline constexpr int kDenseInlineTiles = 128;

struct DenseMhaParams {
  const bf16_t* q_nope;    // [T, H, d_nope]
  const bf16_t* q_pe;      // [T, H, d_rope]
  const bf16_t* k_nope;    // [N, H, d_nope]
  const bf16_t* k_pe;      // [N, d_rope]   shared by all heads
  const bf16_t* v;         // [N, H, d_v]
  bf16_t* o;               // [T, H, d_v]
  float* lse;              // [T, H] natural log
  const DenseTile* tiles;  // [num_tiles] device copy of the schedule, or null: inline_tiles
  int num_tiles;
  int num_heads;  // H
  float sm_scale;
  DenseTile inline_tiles[kDenseInlineTiles];  // the schedule when tiles == null
};

inline constexpr int kDenseBlockM = 64;  // query rows per tile

// Launches one CTA per (tile, head). Returns the launch status.
template <int kDimNope, int kDimRope, int kDimV>
cudaError_t run_dense_mha(const DenseMhaParams& params, cudaStream_t stream);

}  // namespace dsakit::cuda::dense_mha
