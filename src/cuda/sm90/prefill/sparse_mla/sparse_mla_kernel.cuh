// Sparse MLA on Hopper (wgmma, warp-specialized) for bf16 q / o_lat, d_c = 512, d_rope = 64.
//
// One CTA of three warpgroups per (token t, group of 64 heads). Heads are the wgmma M dimension
// (64 rows; heads >= H are zero rows). The token's selected pool rows are taken 64 at a time
// (a block); block 2i goes to buffer K0, block 2i + 1 to K1:
//
//   WG2 (producer): Q once, then every block's rows gathered from the pool by location into the
//     swizzled tiles of its buffer (bf16 pools: cp.async; fp8 pools: codes staged in place by
//     cp.async, then widened to bf16 in place), and a valid flag per slot. Each buffer is two
//     halves with their own full / empty mbarriers: L = dims [0, 256) (tiles 0-3), R = dims
//     [256, 576) (tiles 4-8).
//   WG0 / WG1 (consumers): WG b owns block 2i + b of iteration i and output dims
//     [256b, 256b + 256). It computes S_b = Q·K_bᵀ (64 x 64, K = 576), the online softmax of its
//     block with the running max the two groups share, P_b·V_b over its own dims (P_b from
//     registers), and P_(1-b)·V_(1-b) over its own dims with the other group's P from shared
//     memory. WG0 starts its P·V with its own max and rescales once WG1 has folded in S1's max.
//
//   S[h, n] = Q[h, 0:576] · K[n, 0:576],  P = exp2(S · sm_scale · log2 e − m),
//   O[h, :] = Σ_n P[h, n] · K[n, 0:512] / Σ_n P[h, n]
//
// Shared memory (bytes; tiles are [64 rows][64 bf16], 128-byte swizzled, 1024-aligned):
//   Q   [9 tiles]  73728      K0 [9 tiles] 73728      K1 [9 tiles] 73728
//   P1  [1 tile]    8192      P0 lives in K0's tile 8 (its rope dims: read by S0 only, and
//                             reloaded by the producer only after WG1 has consumed P0)
//   mbarriers, valid flags [2][64], row maxima [3][64] (WG0's own; the final one, by iteration
//   parity), row sums [2][64]
//
// Synchronization per iteration (named barriers between the consumer groups, 256 threads):
//   WG0: softmax with max(m, S0) -> row_max[0]; arrive MAX0; O += P0·V0L; sync MAX1 (the
//        final max in row_max[1 + i % 2]); P0 rescaled -> smem; arrive P0; wait; release K0.L;
//        rescale O; sync P1; O += P1·V1L; issue the next S0; wait for P1·V1L; release K1.L.
//   WG1: sync MAX0; final max = max(row_max[0], S1) -> row_max[1 + i % 2]; arrive MAX1;
//        softmax; O += P1·V1R; P1 -> smem; arrive P1; sync P0; O += P0·V0R; wait; release K1.R,
//        K0.R; next S1.
// A group passes MAX0 of iteration i + 1 only after WG0's P1·V1L of iteration i has completed,
// so P1's buffer is free when WG1 writes it again.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "src/cuda/attention/sparse_mla_params.h"
#include "src/cuda/common/hopper.cuh"
#include "src/cuda/common/launch.h"

namespace dsakit::cuda::sparse_mla {

struct Sm90Config {
  static constexpr int kHeads = 64;                     // heads per CTA (wgmma M)
  static constexpr int kBlock = 64;                     // selected rows per block (S's N, P·V's K)
  static constexpr int kTiles = kDimQk / 64;            // 9 column tiles of a 576-wide row
  static constexpr int kLatentTiles = kDimLatent / 64;  // 8
  static constexpr int kHalfTiles = 4;                  // tiles of the L half; R is tiles 4-8
  static constexpr int kTileBytes = 64 * 128;
  static constexpr int kThreads = 384;
  // setmaxnreg moves registers within the CTA's launch allocation (168 x 384 under
  // __launch_bounds__(384, 1)): 2 x 128 x kConsumerRegs + 128 x kProducerRegs must not exceed
  // it, or the consumers' increase waits forever.
  static constexpr int kConsumerRegs = 224;
  static constexpr int kProducerRegs = 56;
  static_assert(2 * 128 * kConsumerRegs + 128 * kProducerRegs <= 168 * kThreads);

  static constexpr int kQ = 0;
  static constexpr int kK0 = kQ + kTiles * kTileBytes;
  static constexpr int kK1 = kK0 + kTiles * kTileBytes;
  static constexpr int kP1 = kK1 + kTiles * kTileBytes;
  static constexpr int kP0 = kK0 + kLatentTiles * kTileBytes;  // K0's rope tile
  // mbarriers: q_full, k_full[buffer][half], k_empty[buffer][half], valid_full.
  static constexpr int kBars = kP1 + kTileBytes;
  static constexpr int kBarQFull = kBars;
  static constexpr int kBarKFull = kBars + 8;    // + 8 * (2 * buffer + half)
  static constexpr int kBarKEmpty = kBars + 40;  // + 8 * (2 * buffer + half)
  static constexpr int kBarValid = kBars + 72;
  static constexpr int kValid = kBars + 80;  // u8 [2][64]
  // f32 [3][64]: WG0's max, then the final max (by WG1) in two slots by iteration parity.
  static constexpr int kRowMax = kValid + 2 * kBlock;
  static constexpr int kRowSum = kRowMax + 3 * 4 * kHeads;  // f32 [2][64]
  static constexpr int kSmemBytes = kRowSum + 2 * 4 * kHeads;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kK0 % 1024 == 0 && kK1 % 1024 == 0 && kP1 % 1024 == 0 && kP0 % 1024 == 0);

  // Named barriers between the two consumer groups.
  static constexpr int kSyncMax0 = 1, kSyncMax1 = 2, kSyncP0 = 3, kSyncP1 = 4, kSyncSum = 5;
};

// ---- producer -----------------------------------------------------------------------------

// The producer's share of one block: rows group + 16 i (i < 4) of the block, their locations
// and validity (slot < num_slots, location in range).
struct BlockRows {
  int64_t loc[4];
  bool ok[4];
};

__device__ __forceinline__ BlockRows block_rows(const SparseMlaParams& p, const int32_t* slots,
                                                int block, int num_slots, int group) {
  BlockRows r;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int slot = block * Sm90Config::kBlock + group + 16 * i;
    const int64_t loc = slot < num_slots ? int64_t(__ldg(slots + slot)) : int64_t(-1);
    r.ok[i] = loc >= 0 && loc < p.num_locations;
    r.loc[i] = r.ok[i] ? loc : 0;
  }
  return r;
}

// Gathers tiles [tile_begin, tile_end) of a block's rows into `buffer`: chunk `lane8` of each
// tile row, invalid rows zero-filled.
//  * bf16 pools: cp.async straight into the tiles; the caller arrives on the half's full
//    barrier when they land.
//  * fp8 pools: each chunk's 8 e4m3 codes (and, for the 656-byte layout, its 128-column tile's
//    fp32 scale) go to the first 12 bytes of the very chunk they become (this thread's chunks
//    only); convert_half() widens them in place once this thread's copies have landed. The
//    656-byte layout's bf16 rope tile is copied as it is.
template <KvLayout kLayout>
__device__ __forceinline__ void load_half(const SparseMlaParams& p, const BlockRows& rows,
                                          uint32_t buffer, int tile_begin, int tile_end, int group,
                                          int lane8) {
  using Row = PoolRow<kLayout>;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = group + 16 * i;
    const uint8_t* src = p.kv_pool + rows.loc[i] * Row::kBytes;
#pragma unroll
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const uint32_t dst =
          buffer + tile * Sm90Config::kTileBytes + sm90::swizzled_chunk(row, lane8);
      if constexpr (kLayout == KvLayout::kBf16) {
        sm90::cp_async_16_prefetch(dst, src + tile * 128 + lane8 * 16, rows.ok[i]);
      } else if (kLayout == KvLayout::kFp8Scaled && tile == Sm90Config::kLatentTiles) {
        sm90::cp_async_16_prefetch(dst, src + Row::kRopeOffset + lane8 * 16, rows.ok[i]);
      } else {
        sm90::cp_async_small<8>(dst, src + tile * 64 + lane8 * 8, rows.ok[i]);
        if constexpr (kLayout == KvLayout::kFp8Scaled)
          sm90::cp_async_small<4>(dst + 8, src + Row::kScalesOffset + 4 * (tile / 2), rows.ok[i]);
      }
    }
  }
}

// fp8 pools: widens this thread's staged chunks of tiles [tile_begin, tile_end) to bf16 in
// place: bf16(e4m3 · scale) for the 656-byte layout, the exact e4m3 value for fp8-raw (its
// k_scale multiplies S and O instead).
template <KvLayout kLayout>
__device__ __forceinline__ void convert_half(uint32_t buffer, int tile_begin, int tile_end,
                                             int group, int lane8) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = group + 16 * i;
#pragma unroll
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      if (kLayout == KvLayout::kFp8Scaled && tile == Sm90Config::kLatentTiles) continue;
      const uint32_t chunk =
          buffer + tile * Sm90Config::kTileBytes + sm90::swizzled_chunk(row, lane8);
      const uint2 codes = sm90::ld_shared_u32x2(chunk);
      const float scale = kLayout == KvLayout::kFp8Scaled ? sm90::ld_shared_f32(chunk + 8) : 1.f;
      const uint32_t words[2] = {codes.x, codes.y};
      uint32_t out[4];
#pragma unroll
      for (int pair = 0; pair < 4; ++pair) {
        const auto two = static_cast<__nv_fp8x2_storage_t>(words[pair / 2] >> (16 * (pair % 2)));
        const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3)));
        out[pair] = pack_bf16x2(f.x * scale, f.y * scale);
      }
      sm90::st_shared_u32x4(chunk, make_uint4(out[0], out[1], out[2], out[3]));
    }
  }
}

// ---- consumers ----------------------------------------------------------------------------

// S = Q · K_bᵀ over column tiles [kFirst, kFirst + kCount), accumulating after the first MMA
// unless `accumulate`.
template <int kFirst, int kCount>
__device__ __forceinline__ void issue_qk_tiles(float (&s)[32], uint32_t q, uint32_t k,
                                               bool accumulate) {
  const uint64_t dq = sm90::smem_desc_sw128(q, 16, 1024);
  const uint64_t dk = sm90::smem_desc_sw128(k, 16, 1024);
#pragma unroll
  for (int tile = kFirst; tile < kFirst + kCount; ++tile)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t offset = uint64_t(tile * Sm90Config::kTileBytes + ks * 32) >> 4;
      sm90::wgmma_m64n64k16_ss<0>(s, dq + offset, dk + offset,
                                  accumulate || tile > kFirst || ks > 0);
    }
}

// O[64 x 256] += P · V over one block: P from registers (a[ks]: keys 16 ks ..), V = tiles
// [v_tile, v_tile + 4) of a buffer, MN-major.
__device__ __forceinline__ void issue_pv_rs(float (&o)[128], const uint32_t (&a)[4][4],
                                            uint32_t v) {
  const uint64_t dv = sm90::smem_desc_sw128(v, Sm90Config::kTileBytes, 1024);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    sm90::wgmma_m64n256k16_rs<1>(o, a[ks], dv + uint64_t(ks * 2048 >> 4), 1);
}

// The same with P from a shared-memory tile (K-major: row = head, 64 keys).
__device__ __forceinline__ void issue_pv_ss(float (&o)[128], uint32_t p, uint32_t v) {
  const uint64_t dp = sm90::smem_desc_sw128(p, 16, 1024);
  const uint64_t dv = sm90::smem_desc_sw128(v, Sm90Config::kTileBytes, 1024);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    sm90::wgmma_m64n256k16_ss<1>(o, dp + uint64_t(ks * 32 >> 4), dv + uint64_t(ks * 2048 >> 4), 1);
}

// P (fp32, the S accumulator layout) as bf16 A fragments, one per 16 keys.
__device__ __forceinline__ void p_fragments(const float (&s)[32], uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i) a[ks][i] = pack_bf16x2(s[8 * ks + 2 * i], s[8 * ks + 2 * i + 1]);
}

// Writes P (fp32, the S accumulator layout) of this warp's 16 rows into a swizzled [64][64] bf16
// tile, 16 keys (one stmatrix) at a time.
__device__ __forceinline__ void store_p(const float (&s)[32], uint32_t tile, int warp, int lane) {
  const int row = 16 * warp + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    sm90::stmatrix_x4(
        tile + sm90::swizzled_chunk(row, 2 * ks + (lane >> 4)),
        pack_bf16x2(s[8 * ks], s[8 * ks + 1]), pack_bf16x2(s[8 * ks + 2], s[8 * ks + 3]),
        pack_bf16x2(s[8 * ks + 4], s[8 * ks + 5]), pack_bf16x2(s[8 * ks + 6], s[8 * ks + 7]));
}

template <KvLayout kLayout>
__global__ void __launch_bounds__(Sm90Config::kThreads, 1)
    sparse_mla_sm90_kernel(const __grid_constant__ SparseMlaParams p) {
  using C = Sm90Config;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = smem_addr(smem);
  const uint32_t q_tiles = base + C::kQ;
  const uint32_t k0_tiles = base + C::kK0, k1_tiles = base + C::kK1;
  const uint32_t bar_q = base + C::kBarQFull;
  const auto bar_full = [&](int buffer, int half) {
    return base + C::kBarKFull + 16 * buffer + 8 * half;
  };
  const auto bar_empty = [&](int buffer, int half) {
    return base + C::kBarKEmpty + 16 * buffer + 8 * half;
  };
  const uint32_t bar_valid = base + C::kBarValid;
  uint8_t* valid = reinterpret_cast<uint8_t*>(smem + C::kValid);  // [2][64]
  float* row_max = reinterpret_cast<float*>(smem + C::kRowMax);   // [3][64]
  float* row_sum = reinterpret_cast<float*>(smem + C::kRowSum);   // [2][64]

  // Tokens last to first: in a prefill batch the later tokens of a request see the longer
  // contexts, so the long CTAs start first and the short ones fill the tail.
  const int num_groups = (p.num_heads + C::kHeads - 1) / C::kHeads;
  const int64_t t = p.num_tokens - 1 - int64_t(blockIdx.x / num_groups);
  const int head0 = int(blockIdx.x % num_groups) * C::kHeads;
  int num_slots = p.topk;
  if (p.topk_length != nullptr) num_slots = min(max(p.topk_length[t], 0), p.topk);
  const int num_iters = (num_slots + 2 * C::kBlock - 1) / (2 * C::kBlock);
  const int32_t* slots = p.indices + t * p.topk;

  if (threadIdx.x == 0) {
    sm90::mbarrier_init(bar_q, 128);
    for (int b = 0; b < 2; ++b)
      for (int h = 0; h < 2; ++h) {
        sm90::mbarrier_init(bar_full(b, h), 128);
        sm90::mbarrier_init(bar_empty(b, h), 128);
      }
    sm90::mbarrier_init(bar_valid, 128);
    sm90::fence_barrier_init();
  }
  __syncthreads();

  // The warpgroup index, warp-uniform as the compiler sees it (wgmma must not sit on a path it
  // considers divergent).
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0), wtid = threadIdx.x % 128;
  if (wg == 2) {
    // ---- producer ----------------------------------------------------------------------------
    sm90::setmaxnreg_dec<C::kProducerRegs>();
    const int group = wtid / 8, lane8 = wtid % 8;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = group + 16 * i, head = head0 + row;
      const bool ok = head < p.num_heads;
      const int64_t h = ok ? head : 0;
      const bf16_t* latent =
          p.q_abs + t * p.q_abs_token_stride + h * p.q_abs_head_stride + lane8 * 8;
#pragma unroll
      for (int tile = 0; tile < C::kLatentTiles; ++tile)
        sm90::cp_async_16_prefetch(
            q_tiles + tile * C::kTileBytes + sm90::swizzled_chunk(row, lane8), latent + tile * 64,
            ok);
      sm90::cp_async_16_prefetch(
          q_tiles + C::kLatentTiles * C::kTileBytes + sm90::swizzled_chunk(row, lane8),
          p.q_pe + t * p.q_pe_token_stride + h * p.q_pe_head_stride + lane8 * 8, ok);
    }
    sm90::cp_async_mbarrier_arrive(bar_q);

    // Halves in the order the consumers release them: K0.L, K1.R, K0.R, K1.L. fp8 pools keep
    // one half in flight while the one before it is converted: the next half is staged first
    // when its buffer is already free (never waiting for it while a staged half is unfinished,
    // so no consumer waits on a half the producer holds back).
    struct Pending {
      uint32_t buffer = 0, full = 0;
      int tile_begin = 0, tile_end = 0;
      bool active = false;
    } pending;
    const auto finish = [&](bool newer_in_flight) {
      if (newer_in_flight)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
      convert_half<kLayout>(pending.buffer, pending.tile_begin, pending.tile_end, group, lane8);
      sm90::fence_proxy_async_shared();
      sm90::mbarrier_arrive(pending.full);
      pending.active = false;
    };
    for (int it = 0; it < num_iters; ++it) {
      const uint32_t free_phase = (it & 1) ^ 1;
#pragma unroll 1
      for (int step = 0; step < 4; ++step) {
        const int buffer = step & 1, half = ((step + 1) >> 1) & 1;  // 0L, 1R, 0R, 1L
        const uint32_t empty = bar_empty(buffer, half), full = bar_full(buffer, half);
        const uint32_t tiles = buffer == 0 ? k0_tiles : k1_tiles;
        const int tile_begin = half == 0 ? 0 : C::kHalfTiles;
        const int tile_end = half == 0 ? C::kHalfTiles : C::kTiles;
        if constexpr (kLayout != KvLayout::kBf16)
          if (pending.active && !sm90::mbarrier_test_wait(empty, free_phase)) finish(false);
        sm90::mbarrier_wait(empty, free_phase);
        const BlockRows rows = block_rows(p, slots, 2 * it + buffer, num_slots, group);
        load_half<kLayout>(p, rows, tiles, tile_begin, tile_end, group, lane8);
        if constexpr (kLayout == KvLayout::kBf16) {
          sm90::cp_async_mbarrier_arrive(full);
        } else {
          cp_async_commit();
          if (pending.active) finish(true);
          pending = {tiles, full, tile_begin, tile_end, true};
        }
        // A buffer's flags are read only by its own group, which has masked the previous
        // iteration once it released its first half of it (steps 0 and 1).
        if (step < 2 && lane8 == 0)
#pragma unroll
          for (int i = 0; i < 4; ++i) valid[buffer * C::kBlock + group + 16 * i] = rows.ok[i];
        if (step == 1) sm90::mbarrier_arrive(bar_valid);
      }
    }
    if constexpr (kLayout != KvLayout::kBf16)
      if (pending.active) finish(false);
    cp_async_wait<0>();
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------
  sm90::setmaxnreg_inc<C::kConsumerRegs>();
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const int row0 = 16 * warp + g;  // this thread's rows: row0, row0 + 8
  // fp8-raw: every stored value is code · k_scale, so k_scale multiplies S and O.
  const float value_scale = kLayout == KvLayout::kFp8Raw ? p.k_scale : 1.f;
  const float scale_log2 = p.sm_scale * value_scale * kLog2e;
  const uint32_t k_own = wg == 0 ? k0_tiles : k1_tiles;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float s[32];
  float m[2] = {-1e30f, -1e30f};  // running max, log2 domain (finite: exp2(m - m) stays 1)
  float l[2] = {0.f, 0.f};        // running sum of this thread's columns

  // S of block 2 it + wg. WG0 reads its buffer L then R, WG1 R then L: the order the producer
  // fills them.
  const auto issue_qk = [&](int it) {
    const uint32_t phase = it & 1;
    constexpr int kL = C::kHalfTiles, kR = C::kTiles - C::kHalfTiles;
    if (wg == 0) {
      sm90::mbarrier_wait(bar_full(0, 0), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<0, kL>(s, q_tiles, k_own, false);
      sm90::mbarrier_wait(bar_full(0, 1), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<kL, kR>(s, q_tiles, k_own, true);
    } else {
      sm90::mbarrier_wait(bar_full(1, 1), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<kL, kR>(s, q_tiles, k_own, false);
      sm90::mbarrier_wait(bar_full(1, 0), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<0, kL>(s, q_tiles, k_own, true);
    }
    sm90::wgmma_commit();
  };

  if (num_iters > 0) {
    sm90::mbarrier_wait(bar_q, 0);
    sm90::fence_operands(s);
    issue_qk(0);
    sm90::wgmma_wait<0>();
    sm90::fence_operands(s);
  }

  for (int it = 0; it < num_iters; ++it) {
    // ---- mask, block max (S stays unscaled: the scale folds into the exponent) --------------
    sm90::mbarrier_wait(bar_valid, it & 1);
    const uint8_t* slot_ok = valid + wg * C::kBlock;
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = 8 * j + 2 * q;
      const bool ok0 = slot_ok[col] != 0, ok1 = slot_ok[col + 1] != 0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float& s0 = s[4 * j + 2 * r];
        float& s1 = s[4 * j + 2 * r + 1];
        s0 = ok0 ? s0 : -INFINITY;
        s1 = ok1 ? s1 : -INFINITY;
        block_max[r] = fmaxf(block_max[r], fmaxf(s0, s1));
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) block_max[r] = quad_max(block_max[r]) * scale_log2;

    uint32_t a[4][4];
    const auto softmax = [&](const float(&m_new)[2]) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float alpha = exp2_approx(m[r] - m_new[r]);
        l[r] *= alpha;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j + 2 * r] *= alpha;
          o[4 * j + 2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          float& s0 = s[4 * j + 2 * r];
          float& s1 = s[4 * j + 2 * r + 1];
          s0 = exp2_approx(fmaf(s0, scale_log2, -m_new[r]));
          s1 = exp2_approx(fmaf(s1, scale_log2, -m_new[r]));
          l[r] += s0 + s1;
        }
        m[r] = m_new[r];
      }
    };

    if (wg == 0) {
      float m_own[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m_own[r] = fmaxf(m[r], block_max[r]);
        if (q == 0) row_max[row0 + 8 * r] = m_own[r];  // WG0's max
      }
      softmax(m_own);
      sm90::named_barrier_arrive(C::kSyncMax0, 256);
      p_fragments(s, a);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
      issue_pv_rs(o, a, k0_tiles);
      sm90::wgmma_commit();

      // The final max of both blocks: rescale this block's P for WG1 and (below) O and l.
      sm90::named_barrier_sync(C::kSyncMax1, 256);
      float beta[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_final = row_max[(1 + (it & 1)) * C::kHeads + row0 + 8 * r];
        beta[r] = exp2_approx(m[r] - m_final);
        m[r] = m_final;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s[4 * j + 2 * r] *= beta[r];
          s[4 * j + 2 * r + 1] *= beta[r];
        }
      }
      store_p(s, base + C::kP0, warp, lane);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier_arrive(C::kSyncP0, 256);

      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::fence_operands(a);
      sm90::mbarrier_arrive(bar_empty(0, 0));
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] *= beta[r];
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j + 2 * r] *= beta[r];
          o[4 * j + 2 * r + 1] *= beta[r];
        }
      }
      sm90::named_barrier_sync(C::kSyncP1, 256);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
      issue_pv_ss(o, base + C::kP1, k1_tiles);
      sm90::wgmma_commit();
      if (it + 1 < num_iters) {
        sm90::fence_operands(s);
        issue_qk(it + 1);
        sm90::wgmma_wait<1>();
        sm90::mbarrier_arrive(bar_empty(1, 0));
        sm90::wgmma_wait<0>();
        sm90::fence_operands(s);
      } else {
        sm90::wgmma_wait<0>();
        sm90::mbarrier_arrive(bar_empty(1, 0));
      }
      sm90::fence_operands(o);
    } else {
      sm90::named_barrier_sync(C::kSyncMax0, 256);
      float m_final[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m_final[r] = fmaxf(row_max[row0 + 8 * r], block_max[r]);
        if (q == 0) row_max[(1 + (it & 1)) * C::kHeads + row0 + 8 * r] = m_final[r];
      }
      sm90::named_barrier_arrive(C::kSyncMax1, 256);
      softmax(m_final);
      p_fragments(s, a);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
      issue_pv_rs(o, a, k1_tiles + C::kHalfTiles * C::kTileBytes);
      sm90::wgmma_commit();
      store_p(s, base + C::kP1, warp, lane);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier_arrive(C::kSyncP1, 256);
      sm90::named_barrier_sync(C::kSyncP0, 256);
      issue_pv_ss(o, base + C::kP0, k0_tiles + C::kHalfTiles * C::kTileBytes);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      sm90::fence_operands(a);
      sm90::mbarrier_arrive(bar_empty(1, 1));
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::mbarrier_arrive(bar_empty(0, 1));
      if (it + 1 < num_iters) {
        sm90::fence_operands(s);
        issue_qk(it + 1);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(s);
      }
    }
  }

  // ---- epilogue: the two groups' row sums, normalize, write -----------------------------------
  float total[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
    if (q == 0) row_sum[wg * C::kHeads + row0 + 8 * r] = l[r];
  }
  sm90::named_barrier_sync(C::kSyncSum, 256);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    total[r] = row_sum[row0 + 8 * r] + row_sum[C::kHeads + row0 + 8 * r];
    const int head = head0 + row0 + 8 * r;
    if (head >= p.num_heads) continue;
    const int64_t th = t * p.num_heads + head;
    // total == 0 exactly when no slot was valid (the max slot contributes 1); NaN propagates.
    const float inv = total[r] == 0.f ? 0.f : value_scale / total[r];
    bf16_t* out = p.o_lat + th * kDimLatent + 256 * wg + 2 * q;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      *reinterpret_cast<uint32_t*>(out + 8 * j) =
          pack_bf16x2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    if (wg == 0 && q == 0) {
      p.lse[th] = total[r] == 0.f ? INFINITY : (m[r] + log2f(total[r])) * kLn2;
      if (p.max_logits != nullptr) p.max_logits[th] = total[r] == 0.f ? -INFINITY : m[r] * kLn2;
    }
  }
}

template <KvLayout kLayout>
cudaError_t run_sparse_mla_sm90(const SparseMlaParams& params, cudaStream_t stream) {
  using C = Sm90Config;
  if (params.num_tokens == 0 || params.num_heads == 0) return cudaSuccess;
  auto* kernel = &sparse_mla_sm90_kernel<kLayout>;
  static std::atomic<uint64_t> smem_set{0};
  const cudaError_t err =
      opt_in_dynamic_smem(reinterpret_cast<const void*>(kernel), C::kSmemBytes, smem_set);
  if (err != cudaSuccess) return err;
  const int64_t num_groups = (params.num_heads + C::kHeads - 1) / C::kHeads;
  const int64_t num_ctas = params.num_tokens * num_groups;
  if (num_ctas > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(num_ctas)), C::kThreads, C::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda::sparse_mla
