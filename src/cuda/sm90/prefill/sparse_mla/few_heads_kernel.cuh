// Sparse MLA on Hopper for few heads (H <= 16: DeepSeek-V3.2's TP8 shard), keys on the wgmma M
// dimension, on bf16 pools (FP8 pools: few_heads_fp8_kernel.cuh, the codes widened in the
// consumers' registers; run_sparse_mla_sm90_few_heads routes them). Same contract and numerics as
// sparse_mla_kernel.cuh (the 64-head kernel), whose shared-memory layout, CTA order and producer
// (produce_blocks) it takes unchanged.
//
// With heads on M, 16 heads fill a quarter of each 64-row tile and cost what 64 do. Here the
// products are taken transposed, 64 keys (a block) on M and the CTA's 16 heads on N:
//   Sᵀ[n, h]  = K[n, 0:576] · Q[h, 0:576]    A = the block's K tiles (K-major), B = Q's rows 0-15
//   Oᵀ[d, h] += Vᵀ[d, n] · Pᵀ[n, h]          A = the same tiles read MN-major (V = K[:, 0:512]),
//                                            B = Pᵀ, a [16 heads][64 keys] tile per group
// so the tensor work is what the 16 heads need; the shared-memory reads per block drop less
// (K is read by both products, as before; Q and P shrink to 16 rows).
//
// One CTA per token: consumer warpgroups 0 and 1, then the 64-head kernel's producer
// (produce_blocks: block 2i into buffer K0, 2i + 1 into K1, halves L = tiles 0-3 and R = tiles
// 4-8). Consumer group b takes the blocks of buffer b with its own online softmax and all 512
// output dims; the two partial results meet in the epilogue. Per block, group b (WG0 works L
// first, WG1 R first: the order the producer fills them):
//   Sᵀ over the first half's tiles, then the second's (36 m64n16k16); mask the invalid keys;
//   per-head block max over the thread's 2 keys, its 8 lane rows (shuffles) and the group's 4
//   warps (shared memory, named barrier); offset m as in the 64-head kernel (kRescaleSlack);
//   P = exp2(S · scale · log2 e − m); Pᵀ → shared (stmatrix .trans), named barrier;
//   Oᵀ over the first half's dims (tiles 0-3 / 4-7, 16 m64n16k16), then the second's; each half
//   is released as soon as its Oᵀ has completed (the producer refills it), then the next Sᵀ.
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
// Shared memory: Sm90Config's layout; P1's tile holds the groups' Pᵀ tiles (2 KB each); past it
// the groups' per-warp head maxima / sums and the epilogue's per-group (m, l, max). The epilogue
// also stages WG1's scaled Oᵀ (fp32, 32 KB) in Q's tiles once both groups' last Sᵀ is done (a
// token with no slot has no Sᵀ, and the producer copies no Q for it).
#pragma once

#include "src/cuda/sm90/prefill/sparse_mla/few_heads_fp8_kernel.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/few_heads_softmax.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {

struct FewHeadsConfig {
  static constexpr int kHeads = FewHeadsSoftmax::kHeads;  // heads per CTA (wgmma N); H <= kHeads
  using C = Sm90Config;
  static constexpr int kPt = C::kP1;                          // bf16 / f16 [2][16][64], swizzled
  static constexpr int kPtBytes = kHeads * 128;               // one group's Pᵀ tile
  static constexpr int kWarpHeads = C::kSmemBytes;            // f32 [2][4][16]
  static constexpr int kMerge = kWarpHeads + 4 * 2 * 4 * 16;  // f32 [2][3][16]: m, l, max
  static constexpr int kSmemBytes = kMerge + 4 * 2 * 3 * 16;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(2 * kPtBytes <= C::kTileBytes);
  static_assert(128 * 64 * 4 <= C::kK0 - C::kQ, "WG1's Oᵀ staging fits in Q's tiles");
  // Named barriers: the group's head maxima and sums (1 + b), its Pᵀ (3 + b), both groups (5).
  static constexpr int kSyncHeads = 1, kSyncPt = 3, kSyncMerge = 5;
};

// Sᵀ = K · Qᵀ over column tiles [kFirst, kFirst + kCount) of buffer k (A) and Q (B, 16 rows).
template <int kFirst, int kCount, sm90::Ab kAb>
__device__ __forceinline__ void issue_kq_tiles(float (&s)[8], uint32_t k, uint32_t q,
                                               bool accumulate) {
  const uint64_t dk = sm90::smem_desc_sw128(k, 16, 1024);
  const uint64_t dq = sm90::smem_desc_sw128(q, 16, 1024);
  for_each_k16_step<kFirst, kCount>(accumulate, [&](uint64_t offset, bool acc) {
    sm90::wgmma_m64n16k16_ss<0, 0, kAb>(s, dk + offset, dq + offset, acc);
  });
}

// Oᵀ[dims of tiles kFirst .. kFirst + 3] += Vᵀ · Pᵀ over the block's 64 keys: A = tile mt of
// buffer k read MN-major (64 dims x 16 keys a step), B = the group's Pᵀ tile (K-major).
template <int kFirst, sm90::Ab kAb>
__device__ __forceinline__ void issue_vp_tiles(float (&o)[8][8], uint32_t k, uint32_t pt) {
  const uint64_t dp = sm90::smem_desc_sw128(pt, 16, 1024);
#pragma unroll
  for (int mt = kFirst; mt < kFirst + 4; ++mt) {
    const uint64_t dv =
        sm90::smem_desc_sw128(k + mt * Sm90Config::kTileBytes, Sm90Config::kTileBytes, 1024);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      sm90::wgmma_m64n16k16_ss<1, 0, kAb>(o[mt], dv + uint64_t(ks * 2048 >> 4),
                                          dp + uint64_t(ks * 32 >> 4), 1);
  }
}

template <KvLayout kLayout>
__global__ void __launch_bounds__(Sm90Warps::kThreads, 1)
    sparse_mla_sm90_few_heads_kernel(const __grid_constant__ SparseMlaParams p) {
  static_assert(kLayout == KvLayout::kBf16, "FP8 pools: few_heads_fp8_kernel.cuh");
  using C = Sm90Config;
  using F = FewHeadsConfig;
  constexpr sm90::Ab kAb = sm90::Ab::kBf16;
  extern __shared__ __align__(1024) char smem[];
  const Sm90Smem sm{smem_addr(smem)};
  const CtaWork work = cta_work(p, F::kHeads);

  int wg, wtid;
  if (!start_cta<kLayout>(p, smem, sm, work, wg, wtid)) return;

  // ---- consumers: group wg takes buffer wg ----------------------------------------------------
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const int num_iters = work.num_iters;
  const uint32_t k_tiles = sm.k(wg), q_tiles = sm.q();
  const uint32_t pt_tile = sm.base + F::kPt + wg * F::kPtBytes;
  const uint8_t* slot_ok = reinterpret_cast<const uint8_t*>(smem + C::kValid) + wg * C::kBlock;
  float* warp_heads = reinterpret_cast<float*>(smem + F::kWarpHeads) + wg * 4 * F::kHeads;
  float* merge = reinterpret_cast<float*>(smem + F::kMerge);  // [group][m, l, max][16]
  const float scale_log2 = p.sm_scale * kLog2e;
  // The halves in the order the producer fills this group's buffer: WG0 L then R, WG1 R then L.
  const int first_half = wg;  // 0 = L, 1 = R

  float o[8][8] = {};
  float s[8];
  FewHeadsSoftmax softmax;

  constexpr int kL = C::kHalfTiles, kR = C::kTiles - C::kHalfTiles;
  const auto issue_s = [&](int it) {
    const uint32_t phase = it & 1;
    if (wg == 0) {
      sm90::mbarrier_wait(sm.full(0, 0), phase);
      sm90::wgmma_fence();
      issue_kq_tiles<0, kL, kAb>(s, k_tiles, q_tiles, false);
      sm90::mbarrier_wait(sm.full(0, 1), phase);
      sm90::wgmma_fence();
      issue_kq_tiles<kL, kR, kAb>(s, k_tiles, q_tiles, true);
    } else {
      sm90::mbarrier_wait(sm.full(1, 1), phase);
      sm90::wgmma_fence();
      issue_kq_tiles<kL, kR, kAb>(s, k_tiles, q_tiles, false);
      sm90::mbarrier_wait(sm.full(1, 0), phase);
      sm90::wgmma_fence();
      issue_kq_tiles<0, kL, kAb>(s, k_tiles, q_tiles, true);
    }
    sm90::wgmma_commit();
  };

  if (num_iters > 0) {
    sm90::mbarrier_wait(sm.q_full(), 0);
    sm90::fence_operands(s);
    issue_s(0);
    sm90::wgmma_wait<0>();
    sm90::fence_operands(s);
  }

  for (int it = 0; it < num_iters; ++it) {
    // ---- mask, per-head block max (S stays unscaled: the scale folds into the exponent) ------
    sm90::mbarrier_wait(sm.valid_full(), it & 1);
    const bool ok[2] = {slot_ok[16 * warp + g] != 0, slot_ok[16 * warp + g + 8] != 0};
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
    if (wg == 0) {
      issue_vp_tiles<0, kAb>(o, k_tiles, pt_tile);
      sm90::wgmma_commit();
      issue_vp_tiles<4, kAb>(o, k_tiles, pt_tile);
    } else {
      issue_vp_tiles<4, kAb>(o, k_tiles, pt_tile);
      sm90::wgmma_commit();
      issue_vp_tiles<0, kAb>(o, k_tiles, pt_tile);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<1>();
    sm90::mbarrier_arrive(sm.empty(wg, first_half));
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    sm90::mbarrier_arrive(sm.empty(wg, 1 - first_half));

    if (it + 1 < num_iters) {
      sm90::fence_operands(s);
      issue_s(it + 1);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(s);
    }
  }

  // ---- epilogue: the two groups merged, normalize, write -------------------------------------
  // Once both groups' (m, l, max) are in, both groups' last Sᵀ has completed (Q's tiles are
  // free for WG1's scaled Oᵀ).
  float total[4], factor[4], offset[4];
  float* staged = reinterpret_cast<float*>(smem + C::kQ);  // [64 values][128 threads]
  softmax.merge_and_stage(o, warp_heads, merge, staged, wg, wtid, F::kSyncHeads + wg, F::kSyncMerge,
                          F::kSyncMerge, 1.f, total, factor, offset);
  if (wg == 1) return;
  write_heads(p, work, warp, g, q, total, offset, merge, [&](int hi, int64_t th) {
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
