// Parameters and launchers of the sparse MLA kernels (docs/design.md, "Sparse MLA"): absorbed
// attention of each query token over the latent rows its top-k selected, read directly from the
// paged KV pool. Serves prefill and decode alike (decode: T = number of decode tokens). Two
// kernels take these parameters: the mma.sync one (src/cuda/sm80/prefill/sparse_mla/) and the
// wgmma one (src/cuda/sm90/prefill/sparse_mla/).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsakit/formats.h"

namespace dsakit::cuda::sparse_mla {

inline constexpr int kDimLatent = 512;  // d_c: values and the first 512 key dims
inline constexpr int kDimRope = 64;     // d_rope: the last 64 key dims
inline constexpr int kDimQk = kDimLatent + kDimRope;

// Byte layout of one pool row for d_c = 512, d_rope = 64 (KvRowLayout in dsakit/formats.h; the
// launcher checks these against the pool at run time).
template <KvLayout kLayout>
struct PoolRow;
template <>
struct PoolRow<KvLayout::kBf16> {
  static constexpr int kBytes = 2 * kDimQk;  // c_kv bf16 | k_pe bf16
  static constexpr int kRopeOffset = 2 * kDimLatent;
};
template <>
struct PoolRow<KvLayout::kFp8Scaled> {
  static constexpr int kScalesOffset = kDimLatent;  // 4 fp32 scales, one per 128 values
  static constexpr int kRopeOffset = kScalesOffset + 4 * (kDimLatent / kFp8TileSize);
  static constexpr int kBytes = kRopeOffset + 2 * kDimRope;  // 656
};
template <>
struct PoolRow<KvLayout::kFp8Raw> {
  static constexpr int kRopeOffset = kDimLatent;  // e4m3 k_pe right after e4m3 c_kv
  static constexpr int kBytes = kDimQk;
};

struct SparseMlaParams {
  const bf16_t* q_abs;         // [T, H, 512]  absorbed no-position query (strides below)
  const bf16_t* q_pe;          // [T, H, 64]   rope query (strides below)
  const uint8_t* kv_pool;      // [num_locations, bytes_per_token] pool rows (layout: template)
  const int32_t* indices;      // [T, topk] pool locations; < 0 or >= num_locations: skipped
  const int32_t* topk_length;  // [T] or nullptr: token t reads slots [0, min(topk_length[t], topk))
  bf16_t* o_lat;               // [T, H, 512]  softmax-weighted latent values
  float* lse;                  // [T, H]       natural log; +inf where no slot is valid
  float* max_logits;           // [T, H] or nullptr: max over valid slots of sm_scale·q·k
                               // (-inf where none is valid)
  int64_t q_abs_token_stride;  // elements between tokens / heads of q_abs; its last dim is
  int64_t q_abs_head_stride;   //   contiguous
  int64_t q_pe_token_stride;   // the same for q_pe
  int64_t q_pe_head_stride;
  int64_t num_tokens;     // T
  int64_t num_locations;  // pool rows
  int num_heads;          // H
  int topk;               // slots per token
  float sm_scale;         // softmax scale on q·k
  float k_scale;          // fp8-raw pool: value = e4m3 * k_scale
};

// mma.sync kernel: one CTA per (token, group of kHeadsPerCta heads). Returns the launch status.
template <int kHeadsPerCta, KvLayout kLayout>
cudaError_t run_sparse_mla(const SparseMlaParams& params, cudaStream_t stream);

// wgmma kernel: one CTA of three warpgroups per (token, group of 64 heads). Returns the launch
// status.
template <KvLayout kLayout>
cudaError_t run_sparse_mla_sm90(const SparseMlaParams& params, cudaStream_t stream);

// wgmma kernel with keys on the wgmma M dimension: one CTA of three warpgroups per two work items
// of kHeads heads (a token's heads [kHeads i, + kHeads)). Returns the launch status
// (cudaErrorInvalidValue for H > 16 on bf16 pools).
template <int kHeads, KvLayout kLayout>
cudaError_t run_sparse_mla_sm90_few_heads(const SparseMlaParams& params, cudaStream_t stream);

}  // namespace dsakit::cuda::sparse_mla

// One row of DSAKIT_SPARSE_MLA_SM80_INSTANCES (src/cuda/attention/instances.h).
#define DSAKIT_INSTANTIATE_SPARSE_MLA_SM80(kHeadsPerCta, kLayout)                    \
  template cudaError_t                                                               \
  dsakit::cuda::sparse_mla::run_sparse_mla<kHeadsPerCta, dsakit::KvLayout::kLayout>( \
      const dsakit::cuda::sparse_mla::SparseMlaParams&, cudaStream_t);

// One row of DSAKIT_SPARSE_MLA_SM90_FEW_HEADS_INSTANCES.
#define DSAKIT_INSTANTIATE_SPARSE_MLA_SM90_FEW_HEADS(kHeads, kLayout)                         \
  template cudaError_t                                                                        \
  dsakit::cuda::sparse_mla::run_sparse_mla_sm90_few_heads<kHeads, dsakit::KvLayout::kLayout>( \
      const dsakit::cuda::sparse_mla::SparseMlaParams&, cudaStream_t);

// One row of DSAKIT_SPARSE_MLA_SM90_INSTANCES.
#define DSAKIT_INSTANTIATE_SPARSE_MLA_SM90(kLayout)                                              \
  template cudaError_t dsakit::cuda::sparse_mla::run_sparse_mla_sm90<dsakit::KvLayout::kLayout>( \
      const dsakit::cuda::sparse_mla::SparseMlaParams&, cudaStream_t);
