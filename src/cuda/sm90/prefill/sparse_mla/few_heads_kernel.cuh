// Sparse MLA on Hopper for few heads (H <= 16: DeepSeek-V3.2's TP8 shard), keys on the wgmma M
// dimension, on bf16 pools (FP8 pools: few_heads_fp8_kernel.cuh, the codes widened in the
// consumers' registers; run_sparse_mla_sm90_few_heads routes them). Same contract and numerics as
// sparse_mla_kernel.cuh (the 64-head kernel), whose CTA order, tile layout and row copies
// (load_half_bf16) it shares.
//
// With heads on M, 16 heads fill a quarter of each 64-row tile and cost what 64 do. Here the
// products are taken transposed, 64 keys (a block) on M and the CTA's 16 heads on N:
//   Sᵀ[n, h]  = K[n, 0:576] · Q[h, 0:576]    A = the block's K tiles (K-major), B = Q (16 rows)
//   Oᵀ[d, h] += Vᵀ[d, n] · Pᵀ[n, h]          A = the same tiles read MN-major (V = K[:, 0:512]),
//                                            B = Pᵀ, a [16 heads][64 keys] tile per group
// so the tensor work is what the 16 heads need; the shared-memory reads per block drop less
// (K is read by both products, as before; Q and P shrink to 16 rows).
//
// One CTA per token: consumer warpgroups 0 and 1 and a producer warpgroup. The producer copies Q
// (16 rows) once, then every block's two halves, L = column tiles 0-3 and R = tiles 4-8, into a
// ring of kStages half-block stages: half i = 2b + h of block b goes to stage i % kStages (each
// stage holds the larger half, R's five tiles). Consumer group b % 2 takes block b with its own
// online softmax and all 512 output dims; the two partial results meet in the epilogue. Per
// block, the group:
//   Sᵀ over L's tiles, then R's (36 m64n16k16); masks the invalid keys (their slot values, loaded
//   a block ahead); per-head block max over the thread's 2 keys, its 8 lane rows (shuffles) and
//   the group's 4 warps (shared memory, named barrier); offset m as in the 64-head kernel
//   (kRescaleSlack); P = exp2(S · scale · log2 e − m); Pᵀ → shared (stmatrix .trans), named
//   barrier;
//   Oᵀ over L's dims (tiles 0-3, 16 m64n16k16), then R's (4-7); each half's stage is released as
//   soon as its Oᵀ has completed.
//
// Accumulators (thread g = lane / 4, q = lane % 4 of warp w):
//   s[4j + 2r + c]      = Sᵀ[key 16w + g + 8r][head 8j + 2q + c]            j, r, c in {0, 1}
//   o[mt][4j + 2r + c]  = Oᵀ[dim 64 mt + 16w + g + 8r][head 8j + 2q + c]     mt < 8
// so a thread holds 4 heads, hi = 2j + c: their offsets m, sums l and maxima m_true.
//
// The table of instances (instances.h) has a row per pool layout (the FP8 rows compile
// few_heads_fp8_kernel.cuh instead); the wgmma path runs it for H <= 16 (cuda_sparse_mla;
// DSAKIT_SPARSE_MLA_SM90_HEADS=64 forces the 64-head kernel).
//
// Shared memory (bytes): Q [9 tiles of 16 x 64 bf16] 18432, 128-byte swizzled (K-major); the
// groups' Pᵀ tiles [2][16 x 64 bf16] 4096; the ring [kStages][5 tiles of 64 x 64 bf16]; the
// mbarriers full / empty [kStages], q_full; the groups' per-warp head maxima / sums and the
// epilogue's per-group (m, l, max). The epilogue stages WG1's scaled Oᵀ (f32, 32 KB) in stage 0
// once both groups are done with the ring.
#pragma once

#include "src/cuda/sm90/prefill/sparse_mla/few_heads_fp8_kernel.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/few_heads_softmax.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {

struct FewHeadsConfig {
  using C = Sm90Config;
  static constexpr int kHeads = FewHeadsSoftmax::kHeads;  // heads per CTA (wgmma N); H <= kHeads
  static constexpr int kQTileBytes = kHeads * 128;        // a Q or Pᵀ tile: 16 rows x 128 bytes
  static constexpr int kStages = 5;
  static constexpr int kStageBytes = (C::kTiles - C::kHalfTiles) * C::kTileBytes;  // R's 5 tiles
  static constexpr int kQ = 0;
  static constexpr int kPt = kQ + C::kTiles * kQTileBytes;  // [2 groups][16 x 64]
  static constexpr int kRing = kPt + 2 * kQTileBytes;
  static constexpr int kBars = kRing + kStages * kStageBytes;
  static constexpr int kBarFull = kBars;                 // + 8 * stage
  static constexpr int kBarEmpty = kBars + 8 * kStages;  // + 8 * stage
  static constexpr int kBarQ = kBars + 16 * kStages;
  static constexpr int kWarpHeads = kBarQ + 8;                // f32 [2][4][16]
  static constexpr int kMerge = kWarpHeads + 4 * 2 * 4 * 16;  // f32 [2][3][16]: m, l, max
  static constexpr int kSmemBytes = kMerge + 4 * 2 * 3 * 16;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kPt % 1024 == 0 && kRing % 1024 == 0 && kStageBytes % 1024 == 0);
  static_assert(128 * 64 * 4 <= kStageBytes, "WG1's Oᵀ staging fits in stage 0");
  // Named barriers: the group's head maxima and sums (1 + b), its Pᵀ (3 + b), both groups (5).
  static constexpr int kSyncHeads = 1, kSyncPt = 3, kSyncMerge = 5;
};

// Sᵀ = K · Qᵀ over column tiles [kFirst, kFirst + kCount): A = the half's tiles, tile t at slot
// t − kFirst of `stage`, B = Q's 16-row tiles.
template <int kFirst, int kCount, sm90::Ab kAb>
__device__ __forceinline__ void issue_kq_tiles(float (&s)[8], uint32_t stage, uint32_t q,
                                               bool accumulate) {
  using F = FewHeadsConfig;
  const uint64_t dk = sm90::smem_desc_sw128(stage, 16, 1024);
  const uint64_t dq = sm90::smem_desc_sw128(q, 16, 1024);
  for_each_k16_step<kFirst, kCount>(accumulate, [&](int tile, int ks, bool acc) {
    sm90::wgmma_m64n16k16_ss<0, 0, kAb>(s, dk + k16_offset(tile - kFirst, ks),
                                        dq + k16_offset<F::kQTileBytes>(tile, ks), acc);
  });
}

// Oᵀ[dims of tiles kFirst .. kFirst + 3] += Vᵀ · Pᵀ over the block's 64 keys: A = tile mt at
// slot mt − kFirst of `stage` read MN-major (64 dims x 16 keys a step), B = the group's Pᵀ tile
// (K-major).
template <int kFirst, sm90::Ab kAb>
__device__ __forceinline__ void issue_vp_tiles(float (&o)[8][8], uint32_t stage, uint32_t pt) {
  const uint64_t dp = sm90::smem_desc_sw128(pt, 16, 1024);
#pragma unroll
  for (int mt = kFirst; mt < kFirst + 4; ++mt) {
    const uint64_t dv = sm90::smem_desc_sw128(stage + (mt - kFirst) * Sm90Config::kTileBytes,
                                              Sm90Config::kTileBytes, 1024);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      sm90::wgmma_m64n16k16_ss<1, 0, kAb>(o[mt], dv + uint64_t(ks * 2048 >> 4),
                                          dp + uint64_t(ks * 32 >> 4), 1);
  }
}

// Stage i % kStages of the ring, where half i lives (an R half's tiles 4-8 at its slots 0-4).
__device__ __forceinline__ uint32_t ring_stage(uint32_t base, int i) {
  using F = FewHeadsConfig;
  return base + F::kRing + (i % F::kStages) * F::kStageBytes;
}

// The producer warpgroup: Q once (cp.async, zero-filled past H), then both halves of every block
// in order into the ring. Thread wtid copies rows group + 16 k (k < 4) of each half, group =
// wtid / 8, 16-byte chunk wtid % 8 of each tile row; a block's row locations are loaded a block
// before its copies and checked there.
__device__ __forceinline__ void produce_bf16_halves(const SparseMlaParams& p, uint32_t base,
                                                    const CtaWork& work, int num_blocks, int wtid) {
  using C = Sm90Config;
  using F = FewHeadsConfig;
  if (num_blocks == 0) return;
  const int group = wtid / 8, lane8 = wtid % 8;
  copy_q_bf16<F::kHeads>(p, work.t, work.head0, base + F::kQ, group, lane8);
  sm90::cp_async_mbarrier_arrive(base + F::kBarQ);
  BlockRows next = block_rows(work.slots, 0, work.num_slots, group);
#pragma unroll 1
  for (int b = 0; b < num_blocks; ++b) {
    BlockRows rows = next;
#pragma unroll
    for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(rows.loc[k]));  // checked here, not at load
    validate_rows(p, rows);
    if (b + 1 < num_blocks) next = block_rows(work.slots, b + 1, work.num_slots, group);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int i = 2 * b + h, stage = i % F::kStages;
      sm90::mbarrier_wait(base + F::kBarEmpty + 8 * stage, ((i / F::kStages) & 1) ^ 1);
      // load_half_bf16 writes tile t at buffer + t · kTileBytes: R's buffer starts kHalfTiles
      // tiles before the stage (unsigned arithmetic; only the sums are addresses).
      load_half_bf16(p, rows, ring_stage(base, i) - h * C::kHalfTiles * C::kTileBytes,
                     h == 0 ? 0 : C::kHalfTiles, h == 0 ? C::kHalfTiles : C::kTiles, group, lane8);
      sm90::cp_async_mbarrier_arrive(base + F::kBarFull + 8 * stage);
    }
  }
  cp_async_wait<0>();
}

template <KvLayout kLayout>
__global__ void __launch_bounds__(Sm90Warps::kThreads, 1)
    sparse_mla_sm90_few_heads_kernel(const __grid_constant__ SparseMlaParams p) {
  static_assert(kLayout == KvLayout::kBf16, "FP8 pools: few_heads_fp8_kernel.cuh");
  using C = Sm90Config;
  using F = FewHeadsConfig;
  constexpr sm90::Ab kAb = sm90::Ab::kBf16;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = smem_addr(smem);
  int wg, wtid;
  if (!start_keys_on_m_cta<F::kStages, 1>(
          base + F::kBarFull, base + F::kBarEmpty, base + F::kBarQ, wg, wtid, [&] {
            const CtaWork work = cta_work(p, F::kHeads);
            produce_bf16_halves(p, base, work, work.num_blocks(), wtid);
          }))
    return;
  const CtaWork work = cta_work(p, F::kHeads);
  const int num_blocks = work.num_blocks();

  // ---- consumers: group wg takes blocks wg, wg + 2, ... --------------------------------------
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const uint32_t q_tiles = base + F::kQ;
  const uint32_t pt_tile = base + F::kPt + wg * F::kQTileBytes;
  float* warp_heads = reinterpret_cast<float*>(smem + F::kWarpHeads) + wg * 4 * F::kHeads;
  float* merge = reinterpret_cast<float*>(smem + F::kMerge);  // [group][m, l, max][16]
  const float scale_log2 = p.sm_scale * kLog2e;

  float o[8][8] = {};
  float s[8];
  FewHeadsSoftmax softmax;

  // The slot values of this thread's two Sᵀ rows (keys 16w + g, + 8) of block blk: loaded a
  // block ahead (next), checked as their block starts.
  const auto row_slots = [&](int blk, int32_t(&v)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) v[r] = slot_value(work, blk * C::kBlock + 16 * warp + g + 8 * r);
  };
  const int my_blocks = (num_blocks - wg + 1) / 2;
  int32_t next[2] = {-1, -1};
  if (my_blocks > 0) {
    row_slots(wg, next);
    sm90::mbarrier_wait(base + F::kBarQ, 0);
  }

  constexpr int kL = C::kHalfTiles, kR = C::kTiles - C::kHalfTiles;
#pragma unroll 1
  for (int n = 0; n < my_blocks; ++n) {
    const int blk = 2 * n + wg, first = 2 * blk;  // ring indices of its halves: first, first + 1
    const uint32_t l_tiles = ring_stage(base, first), r_tiles = ring_stage(base, first + 1);
    const int l_stage = first % F::kStages, r_stage = (first + 1) % F::kStages;
    bool ok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) ok[r] = checked_location(p, next[r]) >= 0;
    if (n + 1 < my_blocks) row_slots(blk + 2, next);

    // ---- Sᵀ over L, then R --------------------------------------------------------------------
    sm90::fence_operands(s);
    sm90::mbarrier_wait(base + F::kBarFull + 8 * l_stage, (first / F::kStages) & 1);
    sm90::wgmma_fence();
    issue_kq_tiles<0, kL, kAb>(s, l_tiles, q_tiles, false);
    sm90::mbarrier_wait(base + F::kBarFull + 8 * r_stage, ((first + 1) / F::kStages) & 1);
    sm90::wgmma_fence();
    issue_kq_tiles<kL, kR, kAb>(s, r_tiles, q_tiles, true);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(s);

    // ---- mask, per-head block max (S stays unscaled: the scale folds into the exponent) ------
    softmax.block(s, o, ok, warp_heads, F::kSyncHeads + wg, scale_log2, warp, g, q);

    // ---- Pᵀ to shared memory: matrix mi = 2 j + r is keys 16 w + 8 r .., heads 8 j .. --------
    {
      const int mi = lane / 8, j = mi / 2, r = mi % 2;
      sm90::stmatrix_x4_trans(pt_tile + sm90::swizzled_chunk(8 * j + lane % 8, 2 * warp + r),
                              pack_bf16x2(s[0], s[1]), pack_bf16x2(s[2], s[3]),
                              pack_bf16x2(s[4], s[5]), pack_bf16x2(s[6], s[7]));
    }
    sm90::fence_proxy_async_shared();
    sm90::named_barrier_sync(F::kSyncPt + wg, 128);

    // ---- Oᵀ += Vᵀ · Pᵀ, each half released once its products have completed ------------------
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    sm90::wgmma_fence();
    issue_vp_tiles<0, kAb>(o, l_tiles, pt_tile);
    sm90::wgmma_commit();
    issue_vp_tiles<4, kAb>(o, r_tiles, pt_tile);
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();
    sm90::mbarrier_arrive(base + F::kBarEmpty + 8 * l_stage);
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    sm90::mbarrier_arrive(base + F::kBarEmpty + 8 * r_stage);
  }

  // ---- epilogue: the two groups merged, normalize, write -------------------------------------
  // Once both groups' (m, l, max) are in, both are done with the ring (every half the producer
  // copied has been read: stage 0 is free for WG1's scaled Oᵀ).
  float total[4], factor[4], offset[4], maxima[4];
  float* staged = reinterpret_cast<float*>(smem + F::kRing);  // [64 values][128 threads]
  softmax.merge_and_stage(o, warp_heads, merge, staged, wg, wtid, F::kSyncHeads + wg, F::kSyncMerge,
                          F::kSyncMerge, 1.f, total, factor, offset, maxima);
  if (wg == 1) return;
  write_heads(p, work, warp, g, q, total, offset, maxima, [&](int hi, int64_t th) {
    // bf16 bits, one value a store (a warp's store covers 4 heads x 8 consecutive dims).
    uint16_t* out = reinterpret_cast<uint16_t*>(p.o_lat + th * kDimLatent);
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 4 * (hi / 2) + 2 * r + hi % 2;
        out[64 * mt + 16 * warp + g + 8 * r] =
            uint16_t(pack_bf16x2(o[mt][i] * factor[hi] + staged[(mt * 8 + i) * 128 + wtid], 0.f));
      }
  });
}

template <KvLayout kLayout>
cudaError_t run_sparse_mla_sm90_few_heads(const SparseMlaParams& params, cudaStream_t stream) {
  using F = FewHeadsConfig;
  // FP8 pools: the codes widened in the consumers' registers (few_heads_fp8_kernel.cuh), 16
  // heads a CTA at any H.
  if constexpr (kLayout != KvLayout::kBf16) {
    return run_sparse_mla_sm90_few_heads_fp8<kLayout>(params, stream);
  } else {
    if (params.num_tokens == 0 || params.num_heads == 0) return cudaSuccess;
    if (params.num_heads > F::kHeads) return cudaErrorInvalidValue;
    return launch_sm90_sparse<&sparse_mla_sm90_few_heads_kernel<kLayout>>(params, params.num_tokens,
                                                                          F::kSmemBytes, stream);
  }
}

}  // namespace dsakit::cuda::sparse_mla
