// Dense MHA prefill kernel (docs/design.md#dense-mha), FlashAttention-2 style, bf16 in / fp32
// accumulate.
//
// One CTA of 4 warps per (tile, head): a tile is <= 64 query rows of one request and a range of
// its kv blocks (all of them, or one split of them: DenseTile). Warp w owns query rows
// [16w, 16w + 16) and keeps their whole softmax state in registers: S = Q·K^T (16 x 64 per kv
// block), the online max / sum, and O (16 x d_v). P feeds the P·V MMA straight from the S
// accumulators (the C layout of two adjacent n-tiles is the A layout of one k-step).
//
// Shared memory (swizzled 16-byte chunks, SwizzledTile):
//   q  [64][d_qk] bf16              d_qk = d_nope + d_rope: [q_nope, q_pe]
//   k  [2 stages][64][d_qk] bf16    [k_nope[n, h], k_pe[n]]
//   v  [2 stages][64][d_v] bf16
#pragma once

#include <cuda_bf16.h>

#include "src/cuda/attention/dense_mha_params.h"
#include "src/cuda/common/launch.h"
#include "src/cuda/common/warp_mma.cuh"

namespace dsakit::cuda::dense_mha {

template <int kDimNope, int kDimRope, int kDimV>
struct DenseMhaTraits {
  static constexpr int kThreads = 128;
  static constexpr int kBlockM = kDenseBlockM;  // query rows per CTA (16 per warp)
  static constexpr int kBlockN = kDenseBlockN;  // kv rows per stage
  static constexpr int kDimQk = kDimNope + kDimRope;
  static constexpr int kChunksNope = kDimNope / 8;
  static constexpr int kChunksQk = kDimQk / 8;
  static constexpr int kChunksV = kDimV / 8;
  static constexpr int kSTiles = kBlockN / 8;  // 8 n-tiles of S per warp
  static constexpr int kVTiles = kDimV / 8;    // n-tiles of O per warp
  // Grouped tile loads (load_split_rows) keep per-thread bases live across the kv loop: the
  // d_v = 256 instance, whose O accumulators take 128 registers, then spills ~320 bytes.
  static constexpr bool kGroupedLoads = kDimV <= 128;
  static_assert(kDimNope % 8 == 0 && kDimRope % 8 == 0 && kDimQk % 16 == 0 && kDimV % 16 == 0);
  static_assert(kBlockM == 16 * (kThreads / kWarpSize));

  static constexpr int kQBytes = kBlockM * kDimQk * 2;
  static constexpr int kKStageBytes = kBlockN * kDimQk * 2;
  static constexpr int kVStageBytes = kBlockN * kDimV * 2;
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBytes;
  static constexpr int kVOffset = kKOffset + 2 * kKStageBytes;
  static constexpr int kSmemBytes = kVOffset + 2 * kVStageBytes;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
};

// Rows [0, kRows) of a [kRows][d_nope + d_rope] tile from a per-head part (row stride
// per_head_stride elements, d_nope wide) and a part shared by all heads (d_rope wide); rows
// >= num_ok_rows (>= 1) are zero-filled without being read.
// kGrouped: thread t copies chunk columns (t % 8) + 8j of rows t / 8 + 16i. Every part is a
// whole number of 8-chunk swizzle groups, so a thread's row & 7, and with it its swizzled
// column within a group, is the same in every pass: each address is a per-thread base plus a
// pass offset (no division or swizzle arithmetic per chunk; ~20% fewer instructions in the
// kernel). Otherwise thread t copies chunks t, t + kThreads, ... of the row-major tile.
template <int kRows, int kThreads, int kDimNope, int kDimRope, bool kGrouped>
__device__ __forceinline__ void load_split_rows(uint32_t tile, const bf16_t* per_head,
                                                int64_t per_head_stride, const bf16_t* shared,
                                                int64_t shared_stride, int num_ok_rows, int tid) {
  constexpr int kChunksNope = kDimNope / 8;
  constexpr int kChunks = (kDimNope + kDimRope) / 8;
  if constexpr (kGrouped) {
    static_assert(kThreads == 128 && kRows % 16 == 0, "16 rows of 8 chunks per pass");
    static_assert(kDimNope % 64 == 0 && kDimRope % 64 == 0, "parts of whole swizzle groups");
    const int col = tid % 8, row0 = tid / 8;
    const uint32_t dst0 = tile + uint32_t(row0 * kChunks + (col ^ (row0 & 7))) * 16u;
    const bf16_t* src_head = per_head + row0 * per_head_stride + col * 8;
#pragma unroll 1
    for (int i = 0; i < kRows / 16; ++i) {
      const bool ok = row0 + 16 * i < num_ok_rows;
      const uint32_t dst = dst0 + uint32_t(16 * i * kChunks) * 16u;
      // A row past the end reads nothing; its source stays a mapped address (row 0).
      const bf16_t* src = ok ? src_head + 16 * i * per_head_stride : per_head;
#pragma unroll
      for (int j = 0; j < kDimNope / 64; ++j) cp_async_16(dst + j * 128u, src + 64 * j, ok);
      if constexpr (kDimRope > 0) {
        const bf16_t* src_shared = ok ? shared + (row0 + 16 * i) * shared_stride + col * 8 : shared;
#pragma unroll
        for (int j = 0; j < kDimRope / 64; ++j)
          cp_async_16(dst + (kChunksNope + 8 * j) * 16u, src_shared + 64 * j, ok);
      }
    }
  } else {
    for (int i = tid; i < kRows * kChunks; i += kThreads) {
      const int row = i / kChunks, chunk = i % kChunks;
      const bool ok = row < num_ok_rows;
      const int r = ok ? row : 0;
      const bf16_t* src = chunk < kChunksNope
                              ? per_head + r * per_head_stride + chunk * 8
                              : shared + r * shared_stride + (chunk - kChunksNope) * 8;
      cp_async_16(tile + SwizzledTile<kChunks>::offset(row, chunk), src, ok);
    }
  }
}

template <int kDimNope, int kDimRope, int kDimV>
__global__ void __launch_bounds__(DenseMhaTraits<kDimNope, kDimRope, kDimV>::kThreads)
    dense_mha_kernel(const __grid_constant__ DenseMhaParams p) {
  using Tr = DenseMhaTraits<kDimNope, kDimRope, kDimV>;
  extern __shared__ __align__(128) char smem[];
  const uint32_t q_addr = smem_addr(smem + Tr::kQOffset);
  const uint32_t k_addr = smem_addr(smem + Tr::kKOffset);
  const uint32_t v_addr = smem_addr(smem + Tr::kVOffset);

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int g = lane / 4, q = lane % 4;
  // blockIdx.x = (tile * H + h) * v_slices + v_slice; the CTA computes output columns
  // [v_slice * d_v, (v_slice + 1) * d_v) of d_v_total (S is computed by every slice).
  const int v_slice = int(blockIdx.x % unsigned(p.v_slices));
  const unsigned tile_head = blockIdx.x / unsigned(p.v_slices);
  const int h = int(tile_head % unsigned(p.num_heads));
  const unsigned tile_index = tile_head / unsigned(p.num_heads);
  const DenseTile tile = p.tiles != nullptr ? p.tiles[tile_index] : p.inline_tiles[tile_index];
  const int64_t H = p.num_heads;

  // kv rows the tile reads: the last query row sees positions [0, first_query_pos + q_len - 1],
  // of which blocks [block_begin, block_end) are this tile's (may be none: a split past them).
  const int kv_len = tile.first_query_pos + tile.q_len;
  const int block_begin = tile.block_begin;
  const int block_end = min(tile.block_end, (kv_len + Tr::kBlockN - 1) / Tr::kBlockN);

  const auto load_kv = [&](int block, int stage) {
    const int64_t row0 = int64_t(tile.kv_begin) + int64_t(block) * Tr::kBlockN;
    const int ok_rows = min(Tr::kBlockN, kv_len - block * Tr::kBlockN);
    load_split_rows<Tr::kBlockN, Tr::kThreads, kDimNope, kDimRope, Tr::kGroupedLoads>(
        k_addr + stage * Tr::kKStageBytes, p.k_nope + row0 * p.k_row_stride + h * p.k_head_stride,
        p.k_row_stride, p.k_pe + row0 * kDimRope, kDimRope, ok_rows, tid);
    // V is a per-head tile with no shared part.
    load_split_rows<Tr::kBlockN, Tr::kThreads, kDimV, 0, Tr::kGroupedLoads>(
        v_addr + stage * Tr::kVStageBytes,
        p.v + row0 * p.v_row_stride + h * p.v_head_stride + v_slice * kDimV, p.v_row_stride,
        nullptr, 0, ok_rows, tid);
  };

  const int64_t q_row0 = tile.q_begin;
  if (block_begin < block_end) {  // else only the "no key" rows are written below
    load_split_rows<Tr::kBlockM, Tr::kThreads, kDimNope, kDimRope, Tr::kGroupedLoads>(
        q_addr, p.q_nope + (q_row0 * H + h) * kDimNope, H * kDimNope,
        p.q_pe + (q_row0 * H + h) * kDimRope, H * kDimRope, tile.q_len, tid);
    load_kv(block_begin, 0);
  }
  cp_async_commit();

  const float scale_log2 = p.sm_scale * kLog2e;
  float acc_o[Tr::kVTiles][4];
#pragma unroll
  for (int j = 0; j < Tr::kVTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain
  float row_sum[2] = {0.f, 0.f};              // this thread's columns only
  // Position limit of this thread's two rows: key position n is visible iff n <= limit.
  const int row_in_tile = warp * 16 + g;
  const int limit[2] = {tile.first_query_pos + row_in_tile, tile.first_query_pos + row_in_tile + 8};

  for (int b = block_begin; b < block_end; ++b) {
    const int stage = (b - block_begin) & 1;
    if (b + 1 < block_end) load_kv(b + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const uint32_t ks_addr = k_addr + stage * Tr::kKStageBytes;
    const uint32_t vs_addr = v_addr + stage * Tr::kVStageBytes;

    float acc_s[Tr::kSTiles][4];
#pragma unroll
    for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[j][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < Tr::kDimQk / 16; ++ks) {
      uint32_t a[4];
      load_a_frag<Tr::kChunksQk>(a, q_addr, warp * 16, 2 * ks, lane);
#pragma unroll
      for (int j = 0; j < Tr::kSTiles; j += 2) {
        uint32_t bf[4];
        load_bt_frag_x2n<Tr::kChunksQk>(bf, ks_addr, j * 8, 2 * ks, lane);
        mma_bf16_16816(acc_s[j], a, bf[0], bf[1]);
        mma_bf16_16816(acc_s[j + 1], a, bf[2], bf[3]);
      }
    }

    // Causal mask (only blocks reaching past the tile's first query need it), log2 scaling.
    const int n0 = b * Tr::kBlockN;
    const bool needs_mask = n0 + Tr::kBlockN - 1 > tile.first_query_pos;
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = n0 + j * 8 + 2 * q + (e & 1);
        const bool visible = !needs_mask || pos <= limit[e >> 1];
        acc_s[j][e] = visible ? acc_s[j][e] * scale_log2 : -INFINITY;
        block_max[e >> 1] = fmaxf(block_max[e >> 1], acc_s[j][e]);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(row_max[r], quad_max(block_max[r]));
      alpha[r] = exp2f(row_max[r] - softmax_offset(m_new));
      row_max[r] = m_new;
      row_sum[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc_s[j][e] = exp2f(acc_s[j][e] - softmax_offset(row_max[e >> 1]));
        row_sum[e >> 1] += acc_s[j][e];
      }
#pragma unroll
    for (int j = 0; j < Tr::kVTiles; ++j) {
      acc_o[j][0] *= alpha[0];
      acc_o[j][1] *= alpha[0];
      acc_o[j][2] *= alpha[1];
      acc_o[j][3] *= alpha[1];
    }

    // O += P · V: k-step kk covers kv columns [16kk, 16kk + 16) = S n-tiles 2kk and 2kk + 1.
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack_bf16x2(acc_s[2 * kk][0], acc_s[2 * kk][1]),
                             pack_bf16x2(acc_s[2 * kk][2], acc_s[2 * kk][3]),
                             pack_bf16x2(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]),
                             pack_bf16x2(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < Tr::kVTiles; j += 2) {
        uint32_t bf[4];
        load_b_frag_x2n<Tr::kChunksV>(bf, vs_addr, kk * 16, j, lane);
        mma_bf16_16816(acc_o[j], a, bf[0], bf[1]);
        mma_bf16_16816(acc_o[j + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();  // the stage is refilled next iteration
  }
  cp_async_wait<0>();

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // l >= 1 when the tile covers all of the row's blocks (every query sees its own key); a
    // split may hold none of the row's keys (l = 0: lse +inf, o 0). NaN inputs keep l NaN.
    const float l = quad_sum(row_sum[r]);
    const int row = row_in_tile + 8 * r;
    if (row >= tile.q_len) continue;
    const bool no_key = l == 0.f;
    const float inv = no_key ? 0.f : 1.f / l;
    const float lse = no_key ? INFINITY : (row_max[r] + log2f(l)) * kLn2;
    const int64_t out_row = (q_row0 + row) * H + h;
    const int64_t out_col = int64_t(v_slice) * kDimV + 2 * q;
    const bool writes_lse = q == 0 && v_slice == 0;
    if (p.o_parts == nullptr || tile.part == kDenseWholeTile) {
      bf16_t* out = p.o + out_row * p.d_v_total + out_col;
#pragma unroll
      for (int j = 0; j < Tr::kVTiles; ++j)
        *reinterpret_cast<uint32_t*>(out + j * 8) =
            pack_bf16x2(acc_o[j][2 * r] * inv, acc_o[j][2 * r + 1] * inv);
      if (writes_lse) p.lse[out_row] = lse;
    } else {
      // merge_partials skips a slot with lse +inf without reading its o: none is written.
      const int64_t slot_row = int64_t(tile.part) * p.rows + out_row;
      if (writes_lse) p.lse_parts[slot_row] = lse;
      if (no_key) continue;
      float* out = p.o_parts + slot_row * p.d_v_total + out_col;
#pragma unroll
      for (int j = 0; j < Tr::kVTiles; ++j)
        *reinterpret_cast<float2*>(out + j * 8) =
            make_float2(acc_o[j][2 * r] * inv, acc_o[j][2 * r + 1] * inv);
    }
  }
}

template <int kDimNope, int kDimRope, int kDimV>
cudaError_t run_dense_mha(const DenseMhaParams& params, cudaStream_t stream) {
  using Tr = DenseMhaTraits<kDimNope, kDimRope, kDimV>;
  if (params.num_tiles == 0 || params.num_heads == 0) return cudaSuccess;
  if (params.kv_mask != nullptr) return cudaErrorInvalidValue;  // the wgmma kernel's alone
  auto* kernel = &dense_mha_kernel<kDimNope, kDimRope, kDimV>;
  static std::atomic<uint64_t> smem_set{0};
  const cudaError_t err =
      opt_in_dynamic_smem(reinterpret_cast<const void*>(kernel), Tr::kSmemBytes, smem_set);
  if (err != cudaSuccess) return err;
  if (params.v_slices < 1 || params.d_v_total != kDimV * params.v_slices)
    return cudaErrorInvalidValue;
  const int64_t num_ctas = int64_t(params.num_tiles) * params.num_heads * params.v_slices;
  if (num_ctas > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(num_ctas)), Tr::kThreads, Tr::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda::dense_mha
