// Sparse MLA on Hopper for few heads (H <= 16: DeepSeek-V3.2's TP8 shard), keys on the wgmma M
// dimension, on bf16 pools (FP8 pools: few_heads_fp8_kernel.cuh, the codes widened in the
// consumers' registers; run_sparse_mla_sm90_few_heads routes them). Same contract and numerics as
// sparse_mla_kernel.cuh (the 64-head kernel), whose token order (last to first), tile layout and
// row copies (load_half_bf16) it shares.
//
// With heads on M, 16 heads fill a quarter of each 64-row tile and cost what 64 do. Here the
// products are taken transposed, 64 keys (a block) on M and the CTA's 16 heads on N:
//   Sᵀ[n, h]  = K[n, 0:576] · Q[h, 0:576]    A = the block's K tiles (K-major), B = Q (16 rows)
//   Oᵀ[d, h] += Vᵀ[d, n] · Pᵀ[n, h]          A = the same tiles read MN-major (V = K[:, 0:512]),
//                                            B = Pᵀ, a [16 heads][64 keys] tile per group
// so the tensor work is what the 16 heads need; the shared-memory reads per block drop less
// (K is read by both products, as before; Q and P shrink to 16 rows).
//
// A CTA of two consumer warpgroups and a producer warpgroup takes two work items (pair_work: two
// adjacent tokens, in a causal prompt at most one block apart). The producer copies each item's Q
// (16 rows) once, then every block's three parts, part j = column tiles 3j .. 3j + 2, into a ring
// of kStages part stages: part j of the block at ring index i goes to stage (3i + j) % kStages;
// blocks enter the ring in PairOrder (the items' blocks alternating). Consumer group i takes every
// block of item i with its own Q, online softmax and all 512 output dims, and writes its item's
// output alone (a CTA's start and end are paid once per two tokens; no partial results meet).
// Per block, the group:
//   Sᵀ over part 0's tiles, then 1's, then 2's (36 m64n16k16, each part as it lands); masks the
//   invalid keys (their slot values, loaded a block ahead); per-head block max over the thread's
//   2 keys, its 8 lane rows (shuffles) and the group's 4 warps (shared memory, named barrier);
//   offset m as in the 64-head kernel (kRescaleSlack); P = exp2(S · scale · log2 e − m); Pᵀ →
//   shared (stmatrix .trans), named barrier;
//   Oᵀ over part 0's dims (tiles 0-2), 1's (3-5), 2's (6-7; tile 8 is the rope, Sᵀ's only), 32
//   m64n16k16; each part's stage is released as soon as its Oᵀ has completed.
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
// Shared memory (bytes): Q [2 items][9 tiles of 16 x 64 bf16] 2 x 18432, 128-byte swizzled
// (K-major); the groups' Pᵀ tiles [2][16 x 64 bf16] 4096; the ring [kStages][3 tiles of 64 x 64
// bf16] (as many stages as fit: 7); the mbarriers full / empty [kStages], q_full [2]; the groups'
// per-warp head maxima / sums.
#pragma once

#include "src/cuda/sm90/prefill/sparse_mla/few_heads_fp8_kernel.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/few_heads_softmax.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {

struct FewHeadsConfig {
  using C = Sm90Config;
  static constexpr int kHeads = FewHeadsSoftmax<>::kHeads;  // heads per CTA (wgmma N); H <= kHeads
  static constexpr int kQTileBytes = kHeads * 128;          // a Q or Pᵀ tile: 16 rows x 128 bytes
  static constexpr int kQBytes = C::kTiles * kQTileBytes;   // one item's Q
  // A ring stage holds a part of a block: kPartTiles column tiles (part j: tiles 3j .. 3j + 2).
  static constexpr int kPartTiles = 3;
  static constexpr int kParts = C::kTiles / kPartTiles;
  static constexpr int kStageBytes = kPartTiles * C::kTileBytes;
  static constexpr int kQ = 0;                  // [2 items]
  static constexpr int kPt = kQ + 2 * kQBytes;  // [2 groups][16 x 64]
  static constexpr int kRing = kPt + 2 * kQTileBytes;
  static constexpr int kStages = (227 * 1024 - 1024 - kRing) / kStageBytes;  // as many as fit
  static constexpr int kBars = kRing + kStages * kStageBytes;
  static constexpr int kBarFull = kBars;                 // + 8 * stage
  static constexpr int kBarEmpty = kBars + 8 * kStages;  // + 8 * stage
  static constexpr int kBarQ = kBars + 16 * kStages;     // + 8 * item
  static constexpr int kWarpHeads = kBarQ + 16;          // f32 [2][4][16]
  static constexpr int kSmemBytes = kWarpHeads + 4 * 2 * 4 * 16;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kParts * kPartTiles == C::kTiles && kParts == 3);
  static_assert(kPt % 1024 == 0 && kRing % 1024 == 0 && kStageBytes % 1024 == 0);
  // Named barriers of group b's 128 threads: its head maxima and sums (1 + b), its Pᵀ (3 + b).
  static constexpr int kSyncHeads = 1, kSyncPt = 3;
};

// Sᵀ = K · Qᵀ over column tiles [kFirst, kFirst + kCount): A = the part's tiles, tile t at slot
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

// Oᵀ[dims of tiles kFirst .. kFirst + kCount − 1] += Vᵀ · Pᵀ over the block's 64 keys: A = tile mt
// at slot mt − kFirst of `stage` read MN-major (64 dims x 16 keys a step), B = the group's Pᵀ tile
// (K-major).
template <int kFirst, int kCount, sm90::Ab kAb>
__device__ __forceinline__ void issue_vp_tiles(float (&o)[8][8], uint32_t stage, uint32_t pt) {
  const uint64_t dp = sm90::smem_desc_sw128(pt, 16, 1024);
#pragma unroll
  for (int mt = kFirst; mt < kFirst + kCount; ++mt) {
    const uint64_t dv = sm90::smem_desc_sw128(stage + (mt - kFirst) * Sm90Config::kTileBytes,
                                              Sm90Config::kTileBytes, 1024);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
      sm90::wgmma_m64n16k16_ss<1, 0, kAb>(o[mt], dv + uint64_t(ks * 2048 >> 4),
                                          dp + uint64_t(ks * 32 >> 4), 1);
  }
}

// Part j of the block at ring index i: ring slot kParts · i + j, in stage slot % kStages.
struct RingPart {
  using F = FewHeadsConfig;
  int slot;
  __device__ RingPart(int i, int j) : slot(F::kParts * i + j) {}
  __device__ int stage() const { return slot % F::kStages; }
  __device__ uint32_t phase() const { return (slot / F::kStages) & 1; }
  __device__ uint32_t addr(uint32_t base) const {
    return base + F::kRing + stage() * F::kStageBytes;
  }
};

// The producer warpgroup: each item's Q once (cp.async, zero-filled past H), then the parts of
// every block in ring order (PairOrder) into the ring.
// Thread wtid copies rows group + 16 k (k < 4) of each part, group = wtid / 8, 16-byte chunk
// wtid % 8 of each tile row; a block's row locations are loaded a block before its copies and
// checked there.
__device__ __forceinline__ void produce_bf16_parts(const SparseMlaParams& p, uint32_t base,
                                                   const PairWork& work, int wtid) {
  using C = Sm90Config;
  using F = FewHeadsConfig;
  const CtaWork(&items)[2] = work.item;
  const PairOrder order = work.order;
  const int num_blocks = order.total();
  if (num_blocks == 0) return;
  const int group = wtid / 8, lane8 = wtid % 8;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (order.n[i] == 0) continue;
    copy_q_bf16<F::kHeads>(p, items[i].t, items[i].head0, base + F::kQ + i * F::kQBytes, group,
                           lane8);
    sm90::cp_async_mbarrier_arrive(base + F::kBarQ + 8 * i);
  }
  const auto rows_at = [&](int i) {
    int item, b;
    order.at(i, item, b);
    const CtaWork& w = work.item_of(item);
    return block_rows(w.slots, b, w.num_slots, group);
  };
  BlockRows next = rows_at(0);
#pragma unroll 1
  for (int i = 0; i < num_blocks; ++i) {
    BlockRows rows = next;
#pragma unroll
    for (int k = 0; k < 4; ++k) asm volatile("" : "+r"(rows.loc[k]));  // checked here, not at load
    validate_rows(p, rows);
    if (i + 1 < num_blocks) next = rows_at(i + 1);
#pragma unroll
    for (int j = 0; j < F::kParts; ++j) {
      const RingPart part(i, j);
      sm90::mbarrier_wait(base + F::kBarEmpty + 8 * part.stage(), part.phase() ^ 1);
      // load_half_bf16 writes tile t at buffer + t · kTileBytes: part j's buffer starts 3j tiles
      // before the stage (unsigned arithmetic; only the sums are addresses).
      load_half_bf16(p, rows, part.addr(base) - j * F::kPartTiles * C::kTileBytes,
                     j * F::kPartTiles, (j + 1) * F::kPartTiles, group, lane8);
      sm90::cp_async_mbarrier_arrive(base + F::kBarFull + 8 * part.stage());
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
  if (!start_keys_on_m_cta<F::kStages, 2>(
          base + F::kBarFull, base + F::kBarEmpty, base + F::kBarQ, wg, wtid,
          [&] {
            const PairWork work = pair_work<F::kHeads>(p);
            produce_bf16_parts(p, base, work, wtid);
          },
          [] { return false; }))
    return;
  const PairWork pair = pair_work<F::kHeads>(p);
  if (wg == 1 && !pair.has_second) return;

  // ---- consumers: group wg takes every block of item wg ---------------------------------------
  const CtaWork work = pair.item_of(wg);
  const int my_blocks = pair.blocks_of(wg);
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const uint32_t q_tiles = base + F::kQ + wg * F::kQBytes;
  const uint32_t pt_tile = base + F::kPt + wg * F::kQTileBytes;
  float* warp_heads = reinterpret_cast<float*>(smem + F::kWarpHeads) + wg * 4 * F::kHeads;
  const float scale_log2 = p.sm_scale * kLog2e;

  float o[8][8] = {};
  float s[8];
  FewHeadsSoftmax<> softmax;

  // The slot values of this thread's two Sᵀ rows (keys 16w + g, + 8) of block blk: loaded a
  // block ahead (next), checked as their block starts.
  const auto row_slots = [&](int blk, int32_t(&v)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) v[r] = slot_value(work, blk * C::kBlock + 16 * warp + g + 8 * r);
  };
  int32_t next[2] = {-1, -1};
  if (my_blocks > 0) {
    row_slots(0, next);
    sm90::mbarrier_wait(base + F::kBarQ + 8 * wg, 0);
  }

#pragma unroll 1
  for (int blk = 0; blk < my_blocks; ++blk) {
    const int i = pair.order.index(wg, blk);  // its ring index
    const RingPart parts[3] = {RingPart(i, 0), RingPart(i, 1), RingPart(i, 2)};
    bool ok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) ok[r] = checked_location(p, next[r]) >= 0;
    if (blk + 1 < my_blocks) row_slots(blk + 1, next);

    // ---- Sᵀ over the three parts, each as it lands --------------------------------------------
    constexpr int kT = F::kPartTiles;
    sm90::fence_operands(s);
    sm90::mbarrier_wait(base + F::kBarFull + 8 * parts[0].stage(), parts[0].phase());
    sm90::wgmma_fence();
    issue_kq_tiles<0, kT, kAb>(s, parts[0].addr(base), q_tiles, false);
    sm90::mbarrier_wait(base + F::kBarFull + 8 * parts[1].stage(), parts[1].phase());
    sm90::wgmma_fence();
    issue_kq_tiles<kT, kT, kAb>(s, parts[1].addr(base), q_tiles, true);
    sm90::mbarrier_wait(base + F::kBarFull + 8 * parts[2].stage(), parts[2].phase());
    sm90::wgmma_fence();
    issue_kq_tiles<2 * kT, kT, kAb>(s, parts[2].addr(base), q_tiles, true);
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

    // ---- Oᵀ += Vᵀ · Pᵀ (dims of tiles 0-7; part 2's rope tile is Sᵀ's only), each part released
    // once its products have completed ---------------------------------------------------------
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    sm90::wgmma_fence();
    issue_vp_tiles<0, kT, kAb>(o, parts[0].addr(base), pt_tile);
    sm90::wgmma_commit();
    issue_vp_tiles<kT, kT, kAb>(o, parts[1].addr(base), pt_tile);
    sm90::wgmma_commit();
    issue_vp_tiles<2 * kT, C::kLatentTiles - 2 * kT, kAb>(o, parts[2].addr(base), pt_tile);
    sm90::wgmma_commit();
    sm90::wgmma_wait<2>();
    sm90::mbarrier_arrive(base + F::kBarEmpty + 8 * parts[0].stage());
    sm90::wgmma_wait<1>();
    sm90::mbarrier_arrive(base + F::kBarEmpty + 8 * parts[1].stage());
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    sm90::mbarrier_arrive(base + F::kBarEmpty + 8 * parts[2].stage());
  }

  // ---- epilogue: normalize, write ------------------------------------------------------------
  float total[4], factor[4], offset[4], maxima[4];
  softmax.finish_alone(warp_heads, warp, g, q, F::kSyncHeads + wg, 1.f, total, factor, offset,
                       maxima);
  write_heads(p, work, warp, g, q, total, offset, maxima, [&](int hi, int64_t th) {
    // bf16 bits, one value a store (a warp's store covers 4 heads x 8 consecutive dims).
    uint16_t* out = reinterpret_cast<uint16_t*>(p.o_lat + th * kDimLatent);
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 4 * (hi / 2) + 2 * r + hi % 2;
        out[64 * mt + 16 * warp + g + 8 * r] = uint16_t(pack_bf16x2(o[mt][i] * factor[hi], 0.f));
      }
  });
}

template <int kHeads, KvLayout kLayout>
cudaError_t run_sparse_mla_sm90_few_heads(const SparseMlaParams& params, cudaStream_t stream) {
  using F = FewHeadsConfig;
  // FP8 pools: the codes widened in the consumers' registers (few_heads_fp8_kernel.cuh), items
  // of kHeads heads at any H.
  if constexpr (kLayout != KvLayout::kBf16) {
    return run_sparse_mla_sm90_few_heads_fp8<kLayout, kHeads>(params, stream);
  } else {
    static_assert(kHeads == F::kHeads, "bf16 pools: 16-head items");
    if (params.num_tokens == 0 || params.num_heads == 0) return cudaSuccess;
    if (params.num_heads > F::kHeads) return cudaErrorInvalidValue;
    // Two tokens a CTA (pair_work; H <= 16: one work item a token).
    return launch_sm90_sparse<&sparse_mla_sm90_few_heads_kernel<kLayout>>(
        params, (params.num_tokens + 1) / 2, F::kSmemBytes, stream);
  }
}

}  // namespace dsakit::cuda::sparse_mla
