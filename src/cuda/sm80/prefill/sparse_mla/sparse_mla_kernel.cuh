// Sparse MLA kernel (docs/design.md#sparse-mla) for bf16 q / o_lat, d_c = 512, d_rope = 64.
//
// One CTA of 16 (64 heads) or 8 (16 heads) warps per (token t, group of kHeadsPerCta heads). All
// heads of a token attend to the same selected latent rows, so each stage gathers 64 selected pool
// rows once (by location; fp8 codes widened exactly to bf16, scales applied in fp32) and every
// head of the CTA uses them:
//
//   S[h, n] = sm_scale · Q[h, 0:576] · KV[n, 0:576]        (16 x kSCols per warp)
//   O[h, :] = Σ_n softmax_n(S)[h, n] · KV[n, 0:512]        (16 x kVCols per warp)
//
// Warp w owns m-tile mt = w % kMTiles (16 heads) and column group wc = w / kMTiles: kv columns
// [wc·kSCols, +kSCols) of S and output dims [wc·kVCols, +kVCols) of O. The kWarpsPerMTile warps
// of one m-tile exchange their row maxima through shared memory each stage (so all use the same
// running max) and their partial row sums once at the end; P goes through shared memory because
// each warp's P·V needs all 64 columns of its rows.
//
// Shared memory (swizzled 16-byte chunks, SwizzledTile):
//   q      [kHeadsPerCta][576] bf16
//   kv     [2 stages][64][576] bf16    double buffer: stage b+1 loads while stage b computes
//   p      [kHeadsPerCta][64]  bf16
//   red    [kWarpsPerMTile][kHeadsPerCta] f32   row max per stage, row sum at the end
//   valid  [2 stages][64] i32          slot holds an in-range location
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "src/cuda/attention/sparse_mla_params.h"
#include "src/cuda/common/launch.h"
#include "src/cuda/common/warp_mma.cuh"

namespace dsakit::cuda::sparse_mla {

template <int kHeadsPerCta, KvLayout kLayout>
struct SparseMlaTraits {
  static_assert(kHeadsPerCta == 16 || kHeadsPerCta == 64, "head groups of 16 or 64");
  // 16 warps for 64 heads keep the O accumulator at 64 fp32 registers per thread.
  static constexpr int kWarps = kHeadsPerCta == 64 ? 16 : 8;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kBlockKv = 64;                         // selected rows per stage
  static constexpr int kChunksQk = kDimQk / 8;                // 72 chunks per 576-wide row
  static constexpr int kChunksP = kBlockKv / 8;               // 8 chunks per P row
  static constexpr int kMTiles = kHeadsPerCta / 16;           // 4 | 1
  static constexpr int kWarpsPerMTile = kWarps / kMTiles;     // 4 | 8
  static constexpr int kSCols = kBlockKv / kWarpsPerMTile;    // 16 | 8 kv columns of S per warp
  static constexpr int kSTiles = kSCols / 8;                  // 2 | 1
  static constexpr int kVCols = kDimLatent / kWarpsPerMTile;  // 128 | 64 output dims per warp
  static constexpr int kVTiles = kVCols / 8;                  // 16 | 8
  static_assert(kSTiles == 1 || kSTiles % 2 == 0);
  static_assert(kVTiles % 2 == 0);

  // Gather: kThreadsPerRow threads per selected row, each moving every kThreadsPerRow-th chunk.
  static constexpr int kThreadsPerRow = 8;
  static constexpr int kRowsPerPass = kThreads / kThreadsPerRow;       // 64 | 32
  static constexpr int kPasses = kBlockKv / kRowsPerPass;              // 1 | 2
  static constexpr int kChunksPerThread = kChunksQk / kThreadsPerRow;  // 9
  static_assert(kChunksQk % kThreadsPerRow == 0 && kBlockKv % kRowsPerPass == 0);

  static constexpr int kQBytes = kHeadsPerCta * kChunksQk * 16;
  static constexpr int kStageBytes = kBlockKv * kChunksQk * 16;
  static constexpr int kPBytes = kHeadsPerCta * kChunksP * 16;
  static constexpr int kRedBytes = kWarpsPerMTile * kHeadsPerCta * 4;
  // fp8 rows keep their e4m3 codes (exact in bf16) in the stage; scales are applied in fp32:
  // fp8 per (row, 128-dim tile) from `scales`, fp8-raw's single k_scale to S and O.
  static constexpr bool kTileScales = kLayout == KvLayout::kFp8Scaled;
  static constexpr int kScaleTiles = kDimLatent / kFp8TileSize;  // 4
  // Slot validity: a flag per slot, or for fp8 a positive first tile scale (store_kv's scales
  // are >= FLT_MIN; an invalid slot gets 0), which keeps 64 heads within 227 KB.
  static constexpr int kValidBytes = kTileScales ? 0 : 2 * kBlockKv * 4;
  static constexpr int kScaleBytes = kTileScales ? 2 * kBlockKv * kScaleTiles * 4 : 0;

  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + kQBytes;
  static constexpr int kPOffset = kKvOffset + 2 * kStageBytes;
  static constexpr int kRedOffset = kPOffset + kPBytes;
  static constexpr int kValidOffset = kRedOffset + kRedBytes;
  static constexpr int kScaleOffset = kValidOffset + kValidBytes;
  static constexpr int kSmemBytes = kScaleOffset + kScaleBytes;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
};

// Gathers the 64 selected rows of slots [slot0, slot0 + 64) into one kv stage as bf16
// [64][576] (fp8: the codes; their scales into `scales` [64][4]) and records which slots are
// valid. Invalid slots (past num_slots, location out of range) are zero-filled and their
// locations never dereferenced.
template <int kHeadsPerCta, KvLayout kLayout>
__device__ __forceinline__ void load_kv_stage(const SparseMlaParams& p, const int32_t* slot_locs,
                                              int slot0, int num_slots, char* stage, int32_t* valid,
                                              float* scales, int tid) {
  using Tr = SparseMlaTraits<kHeadsPerCta, kLayout>;
  using Tile = SwizzledTile<Tr::kChunksQk>;
  using Row = PoolRow<kLayout>;
  const uint32_t stage_addr = smem_addr(stage);
  const int sub = tid % Tr::kThreadsPerRow;
#pragma unroll
  for (int pass = 0; pass < Tr::kPasses; ++pass) {
    const int row = pass * Tr::kRowsPerPass + tid / Tr::kThreadsPerRow;
    const int slot = slot0 + row;
    const int64_t loc = slot < num_slots ? int64_t(slot_locs[slot]) : int64_t(-1);
    const bool ok = loc >= 0 && loc < p.num_locations;
    if constexpr (!Tr::kTileScales) {
      if (sub == 0) valid[row] = ok ? 1 : 0;
    }
    const uint8_t* src = p.kv_pool + (ok ? loc : 0) * Row::kBytes;
    if constexpr (kLayout == KvLayout::kBf16) {
#pragma unroll
      for (int j = 0; j < Tr::kChunksPerThread; ++j) {
        const int chunk = sub + j * Tr::kThreadsPerRow;
        cp_async_16(stage_addr + Tile::offset(row, chunk), src + chunk * 16, ok);
      }
    } else {
      // fp8: c_kv chunks (and fp8-raw's rope chunks) are dequantized through registers; the fp8
      // layout's bf16 rope chunks are copied as they are.
      constexpr bool kRawRope = kLayout == KvLayout::kFp8Raw;
      constexpr int kDequantChunks = kRawRope ? Tr::kChunksQk : kDimLatent / 8;
      if constexpr (Tr::kTileScales) {
        if (sub < Tr::kScaleTiles)
          scales[row * Tr::kScaleTiles + sub] =
              ok ? __ldg(reinterpret_cast<const float*>(src + Row::kScalesOffset) + sub) : 0.f;
      }
      uint2 codes[Tr::kChunksPerThread];
#pragma unroll
      for (int j = 0; j < Tr::kChunksPerThread; ++j) {
        const int chunk = sub + j * Tr::kThreadsPerRow;
        codes[j] = make_uint2(0u, 0u);
        if (chunk < kDequantChunks && ok)
          codes[j] = __ldg(reinterpret_cast<const uint2*>(src + chunk * 8));
      }
#pragma unroll
      for (int j = 0; j < Tr::kChunksPerThread; ++j) {
        const int chunk = sub + j * Tr::kThreadsPerRow;
        if (chunk < kDequantChunks) {
          *reinterpret_cast<uint4*>(stage + Tile::offset(row, chunk)) =
              ok ? e4m3x8_to_bf16(codes[j]) : make_uint4(0u, 0u, 0u, 0u);
        } else {
          const int rope_chunk = chunk - kDequantChunks;
          cp_async_16(stage_addr + Tile::offset(row, chunk),
                      src + Row::kRopeOffset + rope_chunk * 16, ok);
        }
      }
    }
  }
}

// Q rows of heads [head0, head0 + kHeadsPerCta) of token t as bf16 [kHeadsPerCta][576];
// heads >= H are zero-filled.
template <int kHeadsPerCta, KvLayout kLayout>
__device__ __forceinline__ void load_q(const SparseMlaParams& p, int64_t t, int head0, char* q,
                                       int tid) {
  using Tr = SparseMlaTraits<kHeadsPerCta, kLayout>;
  using Tile = SwizzledTile<Tr::kChunksQk>;
  constexpr int kLatentChunks = kDimLatent / 8;
  const uint32_t q_addr = smem_addr(q);
  for (int i = tid; i < kHeadsPerCta * Tr::kChunksQk; i += Tr::kThreads) {
    const int row = i / Tr::kChunksQk, chunk = i % Tr::kChunksQk;
    const int head = head0 + row;
    const bool ok = head < p.num_heads;
    const int64_t h = ok ? head : 0;
    const bf16_t* src =
        chunk < kLatentChunks
            ? p.q_abs + t * p.q_abs_token_stride + h * p.q_abs_head_stride + chunk * 8
            : p.q_pe + t * p.q_pe_token_stride + h * p.q_pe_head_stride +
                  (chunk - kLatentChunks) * 8;
    cp_async_16(q_addr + Tile::offset(row, chunk), src, ok);
  }
}

template <int kHeadsPerCta, KvLayout kLayout>
__global__ void __launch_bounds__(SparseMlaTraits<kHeadsPerCta, kLayout>::kThreads, 1)
    sparse_mla_kernel(const SparseMlaParams p) {
  using Tr = SparseMlaTraits<kHeadsPerCta, kLayout>;
  extern __shared__ __align__(128) char smem[];
  char* q_smem = smem + Tr::kQOffset;
  char* p_smem = smem + Tr::kPOffset;
  float* red = reinterpret_cast<float*>(smem + Tr::kRedOffset);          // [kWarpsPerMTile][heads]
  int32_t* valid = reinterpret_cast<int32_t*>(smem + Tr::kValidOffset);  // [2][kBlockKv]
  float* scales = reinterpret_cast<float*>(smem + Tr::kScaleOffset);     // fp8: [2][kBlockKv][4]
  const uint32_t q_addr = smem_addr(q_smem);
  const uint32_t p_addr = smem_addr(p_smem);

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int mt = warp % Tr::kMTiles, wc = warp / Tr::kMTiles;
  const int g = lane / 4, q = lane % 4;
  const int row0 = mt * 16 + g;  // this thread's accumulator rows: row0 and row0 + 8

  const int num_groups = (p.num_heads + kHeadsPerCta - 1) / kHeadsPerCta;
  const int64_t t = blockIdx.x / num_groups;
  const int head0 = int(blockIdx.x % num_groups) * kHeadsPerCta;

  int num_slots = p.topk;
  if (p.topk_length != nullptr) num_slots = min(max(p.topk_length[t], 0), p.topk);
  const int num_blocks = (num_slots + Tr::kBlockKv - 1) / Tr::kBlockKv;
  const int32_t* slot_locs = p.indices + t * p.topk;

  load_q<kHeadsPerCta, kLayout>(p, t, head0, q_smem, tid);
  if (num_blocks > 0)
    load_kv_stage<kHeadsPerCta, kLayout>(p, slot_locs, 0, num_slots, smem + Tr::kKvOffset, valid,
                                         scales, tid);
  cp_async_commit();

  // fp8-raw: every stored value is code * k_scale, so k_scale multiplies S and O.
  const float value_scale = kLayout == KvLayout::kFp8Raw ? p.k_scale : 1.f;
  const float scale_log2 = p.sm_scale * value_scale * kLog2e;
  float acc_o[Tr::kVTiles][4];
#pragma unroll
  for (int j = 0; j < Tr::kVTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[j][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain, shared by the m-tile's warps
  float row_sum[2] = {0.f, 0.f};              // this thread's columns only

  for (int b = 0; b < num_blocks; ++b) {
    const int stage = b & 1;
    if (b + 1 < num_blocks)
      load_kv_stage<kHeadsPerCta, kLayout>(
          p, slot_locs, (b + 1) * Tr::kBlockKv, num_slots,
          smem + Tr::kKvOffset + (stage ^ 1) * Tr::kStageBytes, valid + (stage ^ 1) * Tr::kBlockKv,
          scales + (stage ^ 1) * Tr::kBlockKv * Tr::kScaleTiles, tid);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // stage b (and Q) visible to every warp

    const uint32_t kv_addr = smem_addr(smem + Tr::kKvOffset + stage * Tr::kStageBytes);
    const int32_t* stage_valid = valid + stage * Tr::kBlockKv;
    const float* stage_scales = scales + stage * Tr::kBlockKv * Tr::kScaleTiles;

    // S = Q · KV^T over the 576 key dims; k-steps [ks_begin, ks_end) accumulate into acc.
    const auto qk_steps = [&](float(&acc)[Tr::kSTiles][4], int ks_begin, int ks_end) {
#pragma unroll
      for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll 4
      for (int ks = ks_begin; ks < ks_end; ++ks) {
        uint32_t a[4];
        load_a_frag<Tr::kChunksQk>(a, q_addr, mt * 16, 2 * ks, lane);
        if constexpr (Tr::kSTiles == 1) {
          uint32_t bf[2];
          load_bt_frag_x1n<Tr::kChunksQk>(bf, kv_addr, wc * Tr::kSCols, 2 * ks, lane);
          mma_bf16_16816(acc[0], a, bf[0], bf[1]);
        } else {
#pragma unroll
          for (int j = 0; j < Tr::kSTiles; j += 2) {
            uint32_t bf[4];
            load_bt_frag_x2n<Tr::kChunksQk>(bf, kv_addr, wc * Tr::kSCols + j * 8, 2 * ks, lane);
            mma_bf16_16816(acc[j], a, bf[0], bf[1]);
            mma_bf16_16816(acc[j + 1], a, bf[2], bf[3]);
          }
        }
      }
    };
    float acc_s[Tr::kSTiles][4];
    if constexpr (Tr::kTileScales) {
      // Σ over 128-dim tiles of scale[n][tile] · (q_tile · codes_tile), then the bf16 rope dims.
      constexpr int kStepsPerTile = kFp8TileSize / 16;
      qk_steps(acc_s, Tr::kScaleTiles * kStepsPerTile, kDimQk / 16);
#pragma unroll
      for (int tile = 0; tile < Tr::kScaleTiles; ++tile) {
        float part[Tr::kSTiles][4];
        qk_steps(part, tile * kStepsPerTile, (tile + 1) * kStepsPerTile);
#pragma unroll
        for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = wc * Tr::kSCols + j * 8 + 2 * q + (e & 1);
            acc_s[j][e] += part[j][e] * stage_scales[col * Tr::kScaleTiles + tile];
          }
      }
    } else {
      qk_steps(acc_s, 0, kDimQk / 16);
    }

    // Scale into the log2 domain, mask invalid slots, and share this warp's row maxima.
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = wc * Tr::kSCols + j * 8 + 2 * q + (e & 1);
        const bool slot_valid =
            Tr::kTileScales ? stage_scales[col * Tr::kScaleTiles] > 0.f : stage_valid[col] != 0;
        acc_s[j][e] = slot_valid ? acc_s[j][e] * scale_log2 : -INFINITY;
        block_max[e >> 1] = fmaxf(block_max[e >> 1], acc_s[j][e]);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      block_max[r] = quad_max(block_max[r]);
      if (q == 0) red[wc * kHeadsPerCta + row0 + 8 * r] = block_max[r];
    }
    __syncthreads();

    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m_new = row_max[r];
#pragma unroll
      for (int w = 0; w < Tr::kWarpsPerMTile; ++w)
        m_new = fmaxf(m_new, red[w * kHeadsPerCta + row0 + 8 * r]);
      alpha[r] = exp2f(row_max[r] - softmax_offset(m_new));
      row_max[r] = m_new;
      row_sum[r] *= alpha[r];
    }

    // P = exp2(S - m) as bf16 into shared memory (row = head, col = slot in the stage).
#pragma unroll
    for (int j = 0; j < Tr::kSTiles; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float off = softmax_offset(row_max[r]);
        const float p0 = exp2f(acc_s[j][2 * r] - off);
        const float p1 = exp2f(acc_s[j][2 * r + 1] - off);
        row_sum[r] += p0 + p1;
        const int col = wc * Tr::kSCols + j * 8 + 2 * q;
        *reinterpret_cast<uint32_t*>(
            p_smem + SwizzledTile<Tr::kChunksP>::offset(row0 + 8 * r, col / 8) + (col % 8) * 2) =
            pack_bf16x2(p0, p1);
      }
#pragma unroll
    for (int j = 0; j < Tr::kVTiles; ++j) {
      acc_o[j][0] *= alpha[0];
      acc_o[j][1] *= alpha[0];
      acc_o[j][2] *= alpha[1];
      acc_o[j][3] *= alpha[1];
    }
    __syncthreads();  // P complete

    // O += P · V, V = the first 512 dims of the stage's rows.
#pragma unroll
    for (int ks = 0; ks < Tr::kBlockKv / 16; ++ks) {
      uint32_t a[4];
      load_a_frag<Tr::kChunksP>(a, p_addr, mt * 16, 2 * ks, lane);
      if constexpr (Tr::kTileScales) {
        // The warp's output dims lie in one scale tile: fold scale[n][tile] into P's columns.
        static_assert(kFp8TileSize % Tr::kVCols == 0);
        const float* col_scales = stage_scales + (wc * Tr::kVCols) / kFp8TileSize;
        const int n = ks * 16 + 2 * q;
        const float s0 = col_scales[n * Tr::kScaleTiles],
                    s1 = col_scales[(n + 1) * Tr::kScaleTiles];
        const float s8 = col_scales[(n + 8) * Tr::kScaleTiles];
        const float s9 = col_scales[(n + 9) * Tr::kScaleTiles];
        a[0] = scale_bf16x2(a[0], s0, s1);
        a[1] = scale_bf16x2(a[1], s0, s1);
        a[2] = scale_bf16x2(a[2], s8, s9);
        a[3] = scale_bf16x2(a[3], s8, s9);
      }
#pragma unroll
      for (int j = 0; j < Tr::kVTiles; j += 2) {
        uint32_t bf[4];
        load_b_frag_x2n<Tr::kChunksQk>(bf, kv_addr, ks * 16, (wc * Tr::kVCols) / 8 + j, lane);
        mma_bf16_16816(acc_o[j], a, bf[0], bf[1]);
        mma_bf16_16816(acc_o[j + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();  // the stage, P and red are rewritten next iteration
  }
  cp_async_wait<0>();

  // Combine the row sums of the m-tile's warps (fixed order: deterministic), then normalize.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] = quad_sum(row_sum[r]);
    if (q == 0) red[wc * kHeadsPerCta + row0 + 8 * r] = row_sum[r];
  }
  __syncthreads();
  float inv_sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < Tr::kWarpsPerMTile; ++w) l += red[w * kHeadsPerCta + row0 + 8 * r];
    // l == 0 exactly when no slot was valid (the max slot contributes 1); NaN propagates.
    inv_sum[r] = l == 0.f ? 0.f : value_scale / l;
    const int head = head0 + row0 + 8 * r;
    if (wc == 0 && q == 0 && head < p.num_heads) {
      p.lse[t * p.num_heads + head] = l == 0.f ? INFINITY : (row_max[r] + log2f(l)) * kLn2;
      if (p.max_logits != nullptr)
        p.max_logits[t * p.num_heads + head] = l == 0.f ? -INFINITY : row_max[r] * kLn2;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = head0 + row0 + 8 * r;
    if (head >= p.num_heads) continue;
    bf16_t* out = p.o_lat + (t * p.num_heads + head) * kDimLatent + wc * Tr::kVCols + 2 * q;
#pragma unroll
    for (int j = 0; j < Tr::kVTiles; ++j)
      *reinterpret_cast<uint32_t*>(out + j * 8) =
          pack_bf16x2(acc_o[j][2 * r] * inv_sum[r], acc_o[j][2 * r + 1] * inv_sum[r]);
  }
}

template <int kHeadsPerCta, KvLayout kLayout>
cudaError_t run_sparse_mla(const SparseMlaParams& params, cudaStream_t stream) {
  using Tr = SparseMlaTraits<kHeadsPerCta, kLayout>;
  if (params.num_tokens == 0 || params.num_heads == 0) return cudaSuccess;
  auto* kernel = &sparse_mla_kernel<kHeadsPerCta, kLayout>;
  static std::atomic<uint64_t> smem_set{0};
  const cudaError_t err =
      opt_in_dynamic_smem(reinterpret_cast<const void*>(kernel), Tr::kSmemBytes, smem_set);
  if (err != cudaSuccess) return err;
  const int64_t num_groups = (params.num_heads + kHeadsPerCta - 1) / kHeadsPerCta;
  const int64_t num_ctas = params.num_tokens * num_groups;
  if (num_ctas > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(num_ctas)), Tr::kThreads, Tr::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda::sparse_mla
