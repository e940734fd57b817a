// Parameters and launchers of the dense MHA prefill kernels (docs/design.md#dense-mha): varlen
// causal attention with a cached prefix, K = [k_nope per head, k_pe shared by all heads], V per
// head. Two kernels take these parameters: the mma.sync one (src/cuda/sm80/prefill/dense_mha/)
// and the wgmma + TMA one (src/cuda/sm90/prefill/dense_mha/), each over a schedule of its own
// tile shape (DenseTileShape).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsakit/formats.h"

namespace dsakit::cuda::dense_mha {

// A kernel's tile shape: query rows per tile, kv rows per block (its pipeline stage), and the
// CTAs one SM holds at once (the schedule's split-KV sizing).
struct DenseTileShape {
  int block_m, block_n, ctas_per_sm;
};
inline constexpr int kDenseBlockM = 64;  // the mma.sync kernel's query rows per tile
inline constexpr int kDenseBlockN = 64;  // its kv rows per block
inline constexpr DenseTileShape kDenseSm80Shape{kDenseBlockM, kDenseBlockN, 2};

// One unit of work, built on the host from cu_q / cu_kv: query rows of one request against the
// kv blocks [block_begin, block_end) of that request. Query row q_begin + i (0 <= i < q_len <=
// block_m) sees kv rows kv_begin + [0, first_query_pos + i]; blocks past its last visible row
// are not read. Without split-KV a tile covers every block its rows see (part 0); with it, the
// long tiles' blocks are spread over several tiles, each writing partial slot `part`, and a tile
// left whole (kDenseWholeTile) writes o and lse as without a split.
inline constexpr int32_t kDenseWholeTile = -1;

struct DenseTile {
  int32_t q_begin;          // first query row (global, into q / o)
  int32_t q_len;            // query rows in the tile, 1..block_m
  int32_t kv_begin;         // cu_kv[r]
  int32_t first_query_pos;  // position of row q_begin in its request: L_r - E_r + i0
  int32_t block_begin;      // first kv block (block_n rows each) of this tile
  int32_t block_end;        // one past the last; may exceed the blocks the rows see
  int32_t part;             // partial slot of a split tile, else 0 (kDenseWholeTile in a split)
  int32_t unused = 0;
};

// Schedules of up to this many tiles travel in the launch's parameters (3 KiB: prompts up to
// 6K tokens in one request without split-KV); longer ones are copied to the device first.
inline constexpr int kDenseInlineTiles = 96;

struct DenseMhaParams {
  const bf16_t* q_nope;  // [T, H, d_nope]
  const bf16_t* q_pe;    // [T, H, d_rope]
  const bf16_t* k_nope;  // [N, H, d_nope], rows k_row_stride apart, heads k_head_stride
  const bf16_t* k_pe;    // [N, d_rope]   shared by all heads
  const bf16_t* v;       // [N, H, d_v],    rows v_row_stride apart, heads v_head_stride
  int64_t k_row_stride, k_head_stride;  // elements: H * d_nope, d_nope when contiguous
  int64_t v_row_stride, v_head_stride;  // elements: H * d_v, d_v when contiguous
  bf16_t* o;                            // [T, H, d_v]   (whole tiles)
  float* lse;                           // [T, H] natural log (whole tiles)
  // Split-KV: each split tile writes its rows' attention over its blocks, normalized, to slot
  // `part` (merge_partials combines the slots by lse); a row that sees no key there writes only
  // lse = +inf (its o slot is left unwritten: the merge does not read it). Whole tiles
  // (part kDenseWholeTile) write o and lse.
  float* o_parts;          // [num_parts, T, H, d_v] or null
  float* lse_parts;        // [num_parts, T, H]
  int64_t rows;            // T * H: the slot stride of lse_parts (and of o_parts, x d_v)
  int64_t num_kv;          // N: rows of k_nope, k_pe and v
  const DenseTile* tiles;  // [num_tiles] device copy of the schedule, or null: inline_tiles
  int num_tiles;
  int num_heads;  // H
  // The wgmma kernel's grid order (dense_sm90_cta_work): heads in groups of head_group (1..H).
  int head_group;
  // V columns per CTA (mma.sync; the wgmma kernel takes v_slices == 1): the kernel instance's
  // d_v; a CTA per (tile, head, slice) computes
  // columns [slice * d_v, (slice + 1) * d_v) of d_v_total = d_v * v_slices. More than one slice
  // re-computes S per slice: worth it only on grids that leave SMs idle.
  int v_slices;
  int d_v_total;
  // The wgmma kernel: a tile of <= 64 rows over >= 2 blocks splits its blocks between the two
  // consumer groups (1), or leaves them to the first (0); the same output either way, within
  // the summation order.
  int split_short_tiles;
  // Optional per-(query, key) bits (DenseMhaArgs::kv_mask; the wgmma kernel only, else null):
  // query row t sees position p of its request (p within its causal range) only where bit
  // p % 32 of kv_mask[t * kv_mask_words + p / 32] is set; kv_mask_words * 32 >= every request's
  // kv length. A masked key's V row still meets P = 0 in P·V: it must be finite.
  const uint32_t* kv_mask;
  int64_t kv_mask_words;
  float sm_scale;
  DenseTile inline_tiles[kDenseInlineTiles];  // the schedule when tiles == null
};

// mma.sync kernel: one CTA per (tile, head, V column slice), tiles of kDenseSm80Shape; kv_mask
// must be null. Returns the launch status.
template <int kDimNope, int kDimRope, int kDimV>
cudaError_t run_dense_mha(const DenseMhaParams& params, cudaStream_t stream);

// wgmma kernel: one CTA per (tile, head) in the order of dense_sm90_cta_work, tiles of
// dense_sm90_shape(d_v), v_slices == 1, 1 <= head_group <= num_heads; kv_mask (optional) selects
// its masked instance.
// Returns cudaErrorInvalidValue, launching nothing, when TMA cannot address the tensors
// (make_tensor_map_bf16_sw128: 16-byte aligned bases and strides).
template <int kDimNope, int kDimRope, int kDimV>
cudaError_t run_dense_mha_sm90(const DenseMhaParams& params, cudaStream_t stream);

// The wgmma kernel's tiles: 128 query rows (two consumer warpgroups of 64), kv blocks of 128
// rows for d_v <= 128 and 80 for d_v = 256 (the O accumulator's registers and the 2-stage ring's
// shared memory bound it), one CTA per SM.
inline constexpr DenseTileShape dense_sm90_shape(int d_v) {
  return {128, d_v <= 128 ? 128 : 80, 1};
}

// What CTA `cta` of the wgmma kernel's grid (num_tiles x num_heads CTAs) computes. Heads go in
// groups of head_group (the last group may be smaller); a group's CTAs are tile-major: the
// schedule's tile 0 (the heaviest) for each of the group's heads, then tile 1, ... So the CTAs
// in flight together read the K / V rows of head_group heads (chosen to fit in L2,
// dense_head_group), and the lightest tiles of the whole grid run last, filling its last wave.
// Invariant: a bijection from [0, num_tiles x num_heads) to (head, tile) pairs.
struct DenseCtaWork {
  int head, tile;
};
__host__ __device__ inline DenseCtaWork dense_sm90_cta_work(unsigned cta, int num_tiles,
                                                            int num_heads, int head_group) {
  const unsigned per_group = unsigned(head_group) * unsigned(num_tiles);
  const unsigned first_head = cta / per_group * unsigned(head_group);
  const unsigned in_group = cta % per_group;
  const unsigned heads = unsigned(num_heads) - first_head < unsigned(head_group)
                             ? unsigned(num_heads) - first_head
                             : unsigned(head_group);
  return {int(first_head + in_group % heads), int(in_group / heads)};
}

}  // namespace dsakit::cuda::dense_mha

// One row of DSAKIT_DENSE_MHA_SM80_INSTANCES / _SM90_INSTANCES (src/cuda/attention/instances.h).
#define DSAKIT_INSTANTIATE_DENSE_MHA_SM80(kDimNope, kDimRope, kDimV)                      \
  template cudaError_t dsakit::cuda::dense_mha::run_dense_mha<kDimNope, kDimRope, kDimV>( \
      const dsakit::cuda::dense_mha::DenseMhaParams&, cudaStream_t);
#define DSAKIT_INSTANTIATE_DENSE_MHA_SM90(kDimNope, kDimRope, kDimV)                           \
  template cudaError_t dsakit::cuda::dense_mha::run_dense_mha_sm90<kDimNope, kDimRope, kDimV>( \
      const dsakit::cuda::dense_mha::DenseMhaParams&, cudaStream_t);
