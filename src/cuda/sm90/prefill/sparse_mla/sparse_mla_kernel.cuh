// Sparse MLA on Hopper (wgmma, warp-specialized) for bf16 q / o_lat, d_c = 512, d_rope = 64.
//
// One CTA of three warpgroups per (token t, group of 64 heads). Heads are the wgmma M dimension
// (64 rows; heads >= H are zero rows). The token's selected pool rows are taken 64 at a time
// (a block); block 2i goes to buffer K0, block 2i + 1 to K1:
//
//   WG2 (producer): Q once, then every block's rows gathered from the pool by location into the
//     swizzled tiles of its buffer (bf16 pools: cp.async; fp8 pools: the codes loaded into
//     registers one half ahead, before that half's buffer is free, then widened to the operand
//     type and stored), and a valid flag per slot. Each buffer is two halves with their own full /
//     empty mbarriers: L = dims [0, 256) (tiles 0-3), R = dims [256, 576) (tiles 4-8).
//     656-byte pools at 65-128 heads: the token's two CTAs run as a cluster pair, and each
//     producer widens half of every block for both (produce_blocks, kPair).
//   WG0 / WG1 (consumers): WG b owns block 2i + b of iteration i and output dims
//     [256b, 256b + 256). It computes S_b = Q·K_bᵀ (64 x 64, K = 576), the online softmax of its
//     block with the running max the two groups share, P_b·V_b over its own dims (P_b from
//     registers), and P_(1-b)·V_(1-b) over its own dims with the other group's P from shared
//     memory. WG0 starts its P·V with its own max and rescales once WG1 has folded in S1's max.
//
//   S[h, n] = Q[h, 0:576] · K[n, 0:576],  P = exp2(S · sm_scale · log2 e − m),
//   O[h, :] = Σ_n P[h, n] · K[n, 0:512] / Σ_n P[h, n]
//
// Shared memory (bytes; tiles are [64 rows][64 16-bit values], 128-byte swizzled, 1024-aligned):
//   Q   [9 tiles]  73728      K0 [9 tiles] 73728      K1 [9 tiles] 73728
//   P1  [1 tile]    8192      P0 lives in K0's tile 8 (its rope dims: read by S0 only, and
//                             reloaded by the producer only after WG1 has consumed P0)
//   mbarriers, valid flags [2][64], row offsets [3][64] (WG0's own; the final one, by iteration
//   parity), row sums [2][64], Q's power-of-two shift and the producer warps' |Q| maxima (f16)
//
// Synchronization per iteration (named barriers between the consumer groups, 256 threads):
//   WG0: softmax with the offset after S0 -> row_max[0]; arrive MAX0; O += P0·V0L; wait; release
//        K0.L (the first half the producer refills); sync MAX1 (the iteration's final offset in
//        row_max[1 + i % 2]); P0 rescaled -> smem; arrive P0; rescale O; sync P1; O += P1·V1L;
//        issue the next S0's L half; wait for P1·V1L; release K1.L; issue the next S0's R half;
//        wait. (Offsets: see m below; a rescale by 1 is skipped.)
//   WG1: sync MAX0; final offset from row_max[0] and S1 -> row_max[1 + i % 2]; arrive MAX1;
//        softmax; O += P1·V1R; P1 -> smem; arrive P1; sync P0; O += P0·V0R; wait; release K1.R,
//        K0.R; next S1 (R half, then L).
// A group passes MAX0 of iteration i + 1 only after WG0's P1·V1L of iteration i has completed,
// so P1's buffer is free when WG1 writes it again.
//
// Operand types: bf16, except for the fp8-raw pool, whose codes widen to f16 exactly (one
// conversion per pair); that kernel stages Q as f16 scaled by a power of two into f16's range
// (load_q_f16) and folds the power into the softmax scale.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <type_traits>

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
  // f32 [3][64]: WG0's softmax offset, then the final one (by WG1) in two slots by iteration
  // parity; in the epilogue slot 0 holds WG1's exact max.
  static constexpr int kRowMax = kValid + 2 * kBlock;
  static constexpr int kRowSum = kRowMax + 3 * 4 * kHeads;  // f32 [2][64]
  // f16 operands (the fp8-raw pool): the power-of-two exponent Q was scaled by (i32), and the
  // producer warps' partial maxima of |Q| (u32 [4], bf16 magnitude bits).
  static constexpr int kQShift = kRowSum + 2 * 4 * kHeads;
  static constexpr int kQAmax = kQShift + 16;
  // kLaneRows producers: the CTA's slot list (const int32_t*) and slot count (i32), where the
  // loop reads them once an iteration (produce_blocks).
  static constexpr int kSlotList = kQAmax + 16;
  static constexpr int kSmemBytes = kSlotList + 16;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kK0 % 1024 == 0 && kK1 % 1024 == 0 && kP1 % 1024 == 0 && kP0 % 1024 == 0);

  // Named barriers between the two consumer groups.
  static constexpr int kSyncMax0 = 1, kSyncMax1 = 2, kSyncP0 = 3, kSyncP1 = 4, kSyncSum = 5;
  // Among the (first) producer's four warps (128 threads): the |Q| maximum of the f16 path, then
  // (kLaneRows) the slot list's store; a paired producer's stores of a half done before its bulk
  // copies to the peer.
  static constexpr int kSyncProducer = 6, kSyncProducerPair = 7;
  // A paired producer's 32 rows of a tile (produce_blocks): bytes [kPairRowBytes · rank, + that).
  static constexpr int kPairRowBytes = kTileBytes / 2;

  // How far (log2 units) a block's max may pass the softmax offset before O is rescaled.
  static constexpr float kRescaleSlack = 8.f;
};

// A CTA's warpgroups: consumer groups 0 and 1, then one producer group. setmaxnreg moves
// registers within the CTA's launch allocation (kLaunchRegs x kThreads under
// __launch_bounds__(kThreads, 1)): 2 x 128 x kConsumerRegs + 128 x kProducerRegs must not
// exceed it, or the consumers' increase waits forever.
struct Sm90Warps {
  static constexpr int kThreads = 384, kLaunchRegs = 168;
  static constexpr int kConsumerRegs = 208, kProducerRegs = 88;
};
static_assert(2 * 128 * Sm90Warps::kConsumerRegs + 128 * Sm90Warps::kProducerRegs <=
              Sm90Warps::kLaunchRegs * Sm90Warps::kThreads);

// The MMA operand type per pool layout: the fp8-raw pool's codes (one scale for the pool) widen
// to f16 exactly in one conversion per pair, so that kernel computes in f16 with Q scaled by a
// power of two into f16's range; the other layouts compute in bf16.
template <KvLayout kLayout>
inline constexpr sm90::Ab kOperand =
    kLayout == KvLayout::kFp8Raw ? sm90::Ab::kF16 : sm90::Ab::kBf16;

template <sm90::Ab kAb>
__device__ __forceinline__ uint32_t pack_operand_x2(float lo, float hi) {
  return kAb == sm90::Ab::kF16 ? pack_f16x2(lo, hi) : pack_bf16x2(lo, hi);
}

// ---- producer -----------------------------------------------------------------------------

// The producer's share of one block: the pool locations of rows group + 16 i (i < 4) of the
// block. block_rows loads them as the indices hold them (-1 past num_slots) a step or more before
// their first use, and validate_rows turns every invalid one (< 0, >= num_locations) into -1 at
// that use, so the loads' latency is not waited for where they are issued. Invalid rows are
// zero-filled.
struct BlockRows {
  int32_t loc[4];
  __device__ bool ok(int i) const { return loc[i] >= 0; }  // once validated
};

// Slot `slot`'s location as the indices hold it, -1 past num_slots.
__device__ __forceinline__ int32_t slot_location(const int32_t* slots, int slot, int num_slots) {
  return slot < num_slots ? __ldg(slots + slot) : -1;
}

__device__ __forceinline__ BlockRows block_rows(const int32_t* slots, int block, int num_slots,
                                                int group) {
  BlockRows r;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    r.loc[i] = slot_location(slots, block * Sm90Config::kBlock + group + 16 * i, num_slots);
  return r;
}

__device__ __forceinline__ int32_t valid_location(const SparseMlaParams& p, int32_t loc) {
  return loc < p.num_locations ? loc : -1;
}

__device__ __forceinline__ void validate_rows(const SparseMlaParams& p, BlockRows& r) {
#pragma unroll
  for (int i = 0; i < 4; ++i) r.loc[i] = valid_location(p, r.loc[i]);
}

// The other way to hold them, one location per lane (the 64-head kernel's fp8 producers without a
// cluster pair, kLaneRows): the eight lanes of a group (group = 4 w + lane / 8 in warp w) hold
// its eight rows of iteration it, lane 4 b + i of the group row group + 16 i of block 2 it + b
// (-1 past num_slots). A thread's location of either block is one shuffle within its group, from
// a lane known at compile time (iteration_row).
__device__ __forceinline__ int32_t iteration_slot(int it, int lane, int warp) {
  const int b = (lane / 4) % 2, i = lane % 4;
  return (2 * it + b) * Sm90Config::kBlock + 4 * warp + lane / 8 + 16 * i;
}

__device__ __forceinline__ int32_t load_iteration_rows(const int32_t* slots, int it, int num_slots,
                                                       int lane, int warp) {
  return slot_location(slots, iteration_slot(it, lane, warp), num_slots);
}

// Row group + 16 i of buffer `buffer`'s block from the warp's `held` locations (every lane of
// the warp calls it with the same buffer and i).
__device__ __forceinline__ int32_t iteration_row(int32_t held, int buffer, int i) {
  return __shfl_sync(0xffffffffu, held, 4 * buffer + i, 8);
}

// Pool row `loc` (validated), or row 0 for an invalid one (< 0): a mapped address that the
// zero-filling copies and predicated loads never read.
template <KvLayout kLayout>
__device__ __forceinline__ const uint8_t* pool_row(const SparseMlaParams& p, int32_t loc) {
  return p.kv_pool + int64_t(max(loc, 0)) * PoolRow<kLayout>::kBytes;
}

// bf16 pools: cp.async of tiles [tile_begin, tile_end) of a block's rows straight into the
// swizzled tiles of `buffer` (chunk `lane8` of each tile row); the caller arrives on the half's
// full barrier when they land.
__device__ __forceinline__ void load_half_bf16(const SparseMlaParams& p, const BlockRows& rows,
                                               uint32_t buffer, int tile_begin, int tile_end,
                                               int group, int lane8) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = group + 16 * i;
    const uint8_t* src = pool_row<KvLayout::kBf16>(p, rows.loc[i]);
#pragma unroll
    for (int tile = tile_begin; tile < tile_end; ++tile)
      sm90::cp_async_16_prefetch(
          buffer + tile * Sm90Config::kTileBytes + sm90::swizzled_chunk(row, lane8),
          src + tile * 128 + lane8 * 16, rows.ok(i));
  }
}

// Where the 64-head kernel's 656-byte producer reads a row's two tile scales of a half: with its
// codes, into registers (Fp8Row::scales), without a cluster pair; paired, at the store, from the
// line prefetched into L1 with the codes. Each measured faster there than the other
// (docs/perf.md, run AI2).
template <KvLayout kLayout, bool kPair>
inline constexpr bool kStagedScales = kLayout == KvLayout::kFp8Scaled && !kPair;

// fp8 pools: this thread's share of one row of a block's half, held in registers between its
// load and its store. Half h's latent part is columns [256 h, 256 h + 256): codes[j] are the 16
// codes at 256 h + 128 j + 16 lane8 (tile 2 h + j); rope fp8-raw's rope codes [8 lane8, +8) (R
// half only); scales (kStagedScales) the scales of tiles 2 h and 2 h + 1 (0 for an invalid row).
// The 656-byte layout's bf16 rope chunk lane8 (R half) is prefetched into L1 with the codes and
// copied through L1 by cp.async once the buffer is free.
struct Fp8Row {
  uint4 codes[2];
  uint2 rope;
  float2 scales;
};

template <KvLayout kLayout, int kHalf, bool kPair>
__device__ __forceinline__ void load_row_fp8(const SparseMlaParams& p, int32_t loc, int lane8,
                                             Fp8Row& staged) {
  using Row = PoolRow<kLayout>;
  const bool ok = loc >= 0;
  const uint8_t* src = pool_row<kLayout>(p, loc);
#pragma unroll
  for (int j = 0; j < 2; ++j)
    staged.codes[j] = sm90::ld_global_nc_u32x4(src + 256 * kHalf + 128 * j + 16 * lane8, ok);
  if constexpr (kLayout == KvLayout::kFp8Scaled) {
    if constexpr (kStagedScales<kLayout, kPair>) {
      const uint2 scales = sm90::ld_global_nc_u32x2(src + Row::kScalesOffset + 8 * kHalf, ok);
      staged.scales = make_float2(__uint_as_float(scales.x), __uint_as_float(scales.y));
    } else {
      sm90::prefetch_l1(src + Row::kScalesOffset + 8 * kHalf);
    }
    if constexpr (kHalf == 1) sm90::prefetch_l1(src + Row::kRopeOffset + 16 * lane8);
  } else if constexpr (kHalf == 1)
    staged.rope = sm90::ld_global_nc_u32x2(src + Row::kRopeOffset + 8 * lane8, ok);
}

// Where this thread's stores land in a buffer, as byte offsets from the buffer for the rows
// group + 16 i at i = 0 (row i adds 16 i rows of 128 bytes; every such row has the same swizzle,
// row % 8 = group % 8): the thread's 16 codes of a tile row widen to chunks 2 (lane8 % 4) and
// 2 (lane8 % 4) + 1 of tile lane8 / 4 (add 2 j + 4 h tiles for codes[j] of half h); store c
// writes chunk 2 (lane8 % 4) + (c ^ swap). Tiles are 8 KB apart, so chunks of equal index in
// the two tiles share banks: with swap = lane8 / 4 (lanes 4-7 store their second 8 codes first)
// the eight lanes of a row write eight different chunks in each store, one wavefront instead of
// two. Only the 576-byte layout swaps: in the 656-byte one the extra selects spill the producer
// and it ran no faster (docs/perf.md). rope: chunk lane8 of the rope tile.
template <KvLayout kLayout>
__device__ __forceinline__ bool fp8_store_swap(int lane8) {
  return kLayout == KvLayout::kFp8Raw && lane8 >= 4;
}

struct Fp8StoreOffsets {
  uint32_t pair[2];
  uint32_t rope;
};

template <KvLayout kLayout>
__device__ __forceinline__ Fp8StoreOffsets fp8_store_offsets(int group, int lane8) {
  using C = Sm90Config;
  const int swap = kLayout == KvLayout::kFp8Raw ? lane8 / 4 : 0;  // fp8_store_swap as 0 / 1
  Fp8StoreOffsets o;
#pragma unroll
  for (int c = 0; c < 2; ++c)
    o.pair[c] =
        (lane8 / 4) * C::kTileBytes + sm90::swizzled_chunk(group, 2 * (lane8 % 4) + (c ^ swap));
  o.rope = C::kLatentTiles * C::kTileBytes + sm90::swizzled_chunk(group, lane8);
  return o;
}

// The 656-byte layout's rope chunk lane8 of row i (bf16, as stored) by cp.async into `buffer`'s
// rope tile (zero-filled for an invalid row).
__device__ __forceinline__ void copy_rope_656(const SparseMlaParams& p, int32_t loc,
                                              uint32_t buffer, int i,
                                              const Fp8StoreOffsets& offsets, int lane8) {
  constexpr KvLayout kLayout = KvLayout::kFp8Scaled;
  sm90::cp_async_16_l1(buffer + i * 16 * 128 + offsets.rope,
                       pool_row<kLayout>(p, loc) + PoolRow<kLayout>::kRopeOffset + lane8 * 16,
                       loc >= 0);
}

// Widens staged row i of half kHalf to the operand type (bf16; f16 for fp8-raw) into the swizzled
// tiles of `buffer` (an invalid row was loaded as zero codes; its scales are 0 or 1). Alone
// (!kPair), the 656-byte layout's R half also starts the row's rope cp.async.
template <KvLayout kLayout, int kHalf, bool kPair>
__device__ __forceinline__ void store_row_fp8(const SparseMlaParams& p, int32_t loc,
                                              const Fp8Row& staged, uint32_t buffer, int i,
                                              const Fp8StoreOffsets& offsets, int lane8) {
  using C = Sm90Config;
  const uint32_t row = buffer + i * 16 * 128;
  float2 scales = {1.f, 1.f};
  if constexpr (kStagedScales<kLayout, kPair>) {
    scales = staged.scales;
  } else if constexpr (kLayout == KvLayout::kFp8Scaled) {
    const bool ok = loc >= 0;
    // The row's address is recomputed here, not held from its load a step earlier.
    asm volatile("" : "+r"(loc));
    const uint8_t* src = pool_row<kLayout>(p, loc);
    if (ok)
      scales =
          __ldg(reinterpret_cast<const float2*>(src + PoolRow<kLayout>::kScalesOffset) + kHalf);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float scale = j == 0 ? scales.x : scales.y;
    const uint4 c = staged.codes[j];
    const uint32_t tile = row + (4 * kHalf + 2 * j) * C::kTileBytes;
    const bool swap = fp8_store_swap<kLayout>(lane8);  // second 8 codes first (Fp8StoreOffsets)
    const uint2 first = make_uint2(swap ? c.z : c.x, swap ? c.w : c.y);
    const uint2 second = make_uint2(swap ? c.x : c.z, swap ? c.y : c.w);
    if constexpr (kOperand<kLayout> == sm90::Ab::kF16) {
      sm90::st_shared_u32x4(tile + offsets.pair[0], e4m3x8_to_f16(first));
      sm90::st_shared_u32x4(tile + offsets.pair[1], e4m3x8_to_f16(second));
    } else {
      sm90::st_shared_u32x4(tile + offsets.pair[0], e4m3x8_to_bf16(first, scale));
      sm90::st_shared_u32x4(tile + offsets.pair[1], e4m3x8_to_bf16(second, scale));
    }
  }
  if constexpr (kLayout == KvLayout::kFp8Scaled && kHalf == 1 && !kPair)
    copy_rope_656(p, loc, buffer, i, offsets, lane8);
  if constexpr (kLayout == KvLayout::kFp8Raw && kHalf == 1)
    sm90::st_shared_u32x4(row + offsets.rope, e4m3x8_to_f16(staged.rope));
}

// Q of the CTA's kRows heads (bf16) by cp.async into swizzled Q tiles of kRows rows, kTileBytes
// = kRows x 128 apart: rows group + 16 i, chunk lane8 of every tile (heads >= H zero-filled). The
// 64-head kernel's 64 rows by default; the keys-on-M kernel's 16 (few_heads_kernel.cuh).
template <int kRows = Sm90Config::kHeads>
__device__ __forceinline__ void copy_q_bf16(const SparseMlaParams& p, int64_t t, int head0,
                                            uint32_t q_tiles, int group, int lane8) {
  using C = Sm90Config;
  constexpr int kTileBytes = kRows * 128;
#pragma unroll
  for (int i = 0; i < kRows / 16; ++i) {
    const int row = group + 16 * i, head = head0 + row;
    const bool ok = head < p.num_heads;
    const int64_t h = ok ? head : 0;
    const bf16_t* latent = p.q_abs + t * p.q_abs_token_stride + h * p.q_abs_head_stride + lane8 * 8;
#pragma unroll
    for (int tile = 0; tile < C::kLatentTiles; ++tile)
      sm90::cp_async_16_prefetch(q_tiles + tile * kTileBytes + sm90::swizzled_chunk(row, lane8),
                                 latent + tile * 64, ok);
    sm90::cp_async_16_prefetch(
        q_tiles + C::kLatentTiles * kTileBytes + sm90::swizzled_chunk(row, lane8),
        p.q_pe + t * p.q_pe_token_stride + h * p.q_pe_head_stride + lane8 * 8, ok);
  }
}

// The largest finite magnitude of the bf16 values in v folded into m2 (two 16-bit maxima of
// bf16 magnitude bits, which order like the magnitudes; inf / NaN count as 0).
__device__ __forceinline__ void fold_finite_max_bf16(uint32_t& m2, uint4 v) {
  for (const uint32_t w : {v.x, v.y, v.z, v.w}) {
    const uint32_t mag = w & 0x7fff7fffu;
    m2 = __vmaxu2(m2, mag & __vcmpltu2(mag, 0x7f807f80u));
  }
}

// The power-of-two exponent `shift` that scales Q (bf16) into f16: the largest finite |q| over
// the producer warpgroup's 128 threads (m2: each thread's fold_finite_max_bf16) lands in
// [2^14, 2^15) at Q · 2^-shift. Reduced through amax_scratch (u32 [4]) and named barrier `sync`
// of those 128 threads; thread 0 writes it to *q_shift.
__device__ __forceinline__ int q_f16_shift(uint32_t m2, uint32_t* amax_scratch, int* q_shift,
                                           int wtid, int sync = Sm90Config::kSyncProducer) {
  uint32_t m = __reduce_max_sync(0xffffffffu, max(m2 & 0xffffu, m2 >> 16));
  if (wtid % 32 == 0) amax_scratch[wtid / 32] = m;
  sm90::named_barrier_sync(sync, 128);
  m = max(max(amax_scratch[0], amax_scratch[1]), max(amax_scratch[2], amax_scratch[3]));
  // m's exponent field E: the largest |q| is in [2^(E-127), 2^(E-126)).
  const int shift = m == 0 ? 0 : min(max(int(m >> 7) - 127 - 14, -112), 112);
  if (wtid == 0) *q_shift = shift;
  return shift;
}

// f16 operands: Q as copy_q_bf16 copies it, then converted in place by the thread that copied
// each chunk to f16 scaled by 2^-shift, shift chosen so the largest finite |q| of the CTA lands
// in [2^14, 2^15): none overflows, and every value that lands at 2^-17 or above (at least 2^-31
// of the largest) converts exactly (a bf16 significand's 8 bits above f16's 2^-24 spacing). Writes
// shift to *q_shift (the consumers multiply S by 2^shift) and arrives on bar_q. The maximum is
// reduced over the producer's four warps through amax_scratch (u32 [4]).
__device__ __forceinline__ void load_q_f16(const SparseMlaParams& p, int64_t t, int head0,
                                           uint32_t q_tiles, uint32_t* amax_scratch, int* q_shift,
                                           uint32_t bar_q, int wtid) {
  using C = Sm90Config;
  const int group = wtid / 8, lane8 = wtid % 8;
  copy_q_bf16(p, t, head0, q_tiles, group, lane8);
  cp_async_commit();
  cp_async_wait<0>();
  const auto chunk = [&](int i, int tile) {
    return q_tiles + tile * C::kTileBytes + sm90::swizzled_chunk(group + 16 * i, lane8);
  };
  // Pass 1: the largest finite |q|.
  uint32_t m2 = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int tile = 0; tile < C::kTiles; ++tile)
      fold_finite_max_bf16(m2, sm90::ld_shared_u32x4(chunk(i, tile)));
  const int shift = q_f16_shift(m2, amax_scratch, q_shift, wtid);
  const float down = __int_as_float((127 - shift) << 23);  // 2^-shift

  // Pass 2: convert in place.
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int tile = 0; tile < C::kTiles; ++tile) {
      const uint4 v = sm90::ld_shared_u32x4(chunk(i, tile));
      uint32_t h[4];
      int j = 0;
      for (const uint32_t w : {v.x, v.y, v.z, v.w})
        h[j++] =
            pack_f16x2(__uint_as_float(w << 16) * down, __uint_as_float(w & 0xffff0000u) * down);
      sm90::st_shared_u32x4(chunk(i, tile), make_uint4(h[0], h[1], h[2], h[3]));
    }
  sm90::fence_proxy_async_shared();
  sm90::mbarrier_arrive(bar_q);
}

// ---- consumers ----------------------------------------------------------------------------

// The k16 steps of a product over column tiles [kFirst, kFirst + kCount) of K-major swizzled
// tiles: mma(tile, ks, accumulate) per step (ks < 4 within the tile), accumulating after the
// first step unless `accumulate`.
template <int kFirst, int kCount, typename Mma>
__device__ __forceinline__ void for_each_k16_step(bool accumulate, Mma&& mma) {
#pragma unroll
  for (int tile = kFirst; tile < kFirst + kCount; ++tile)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) mma(tile, ks, accumulate || tile > kFirst || ks > 0);
}
// Step ks of tile `tile` in a chain of tiles kTileBytes apart, in a descriptor's 16-byte units.
template <int kTileBytes = Sm90Config::kTileBytes>
__device__ __forceinline__ uint64_t k16_offset(int tile, int ks) {
  return uint64_t(tile * kTileBytes + ks * 32) >> 4;
}

// S = Q · K_bᵀ over column tiles [kFirst, kFirst + kCount).
template <int kFirst, int kCount, sm90::Ab kAb>
__device__ __forceinline__ void issue_qk_tiles(float (&s)[32], uint32_t q, uint32_t k,
                                               bool accumulate) {
  const uint64_t dq = sm90::smem_desc_sw128(q, 16, 1024);
  const uint64_t dk = sm90::smem_desc_sw128(k, 16, 1024);
  for_each_k16_step<kFirst, kCount>(accumulate, [&](int tile, int ks, bool acc) {
    const uint64_t offset = k16_offset(tile, ks);
    sm90::wgmma_m64n64k16_ss<0, kAb>(s, dq + offset, dk + offset, acc);
  });
}

// O[64 x 256] += P · V over one block: P from registers (a[ks]: keys 16 ks ..), V = tiles
// [v_tile, v_tile + 4) of a buffer, MN-major.
template <sm90::Ab kAb>
__device__ __forceinline__ void issue_pv_rs(float (&o)[128], const uint32_t (&a)[4][4],
                                            uint32_t v) {
  const uint64_t dv = sm90::smem_desc_sw128(v, Sm90Config::kTileBytes, 1024);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    sm90::wgmma_m64n256k16_rs<1, kAb>(o, a[ks], dv + uint64_t(ks * 2048 >> 4), 1);
}

// The same with P from a shared-memory tile (K-major: row = head, 64 keys).
template <sm90::Ab kAb>
__device__ __forceinline__ void issue_pv_ss(float (&o)[128], uint32_t p, uint32_t v) {
  const uint64_t dp = sm90::smem_desc_sw128(p, 16, 1024);
  const uint64_t dv = sm90::smem_desc_sw128(v, Sm90Config::kTileBytes, 1024);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    sm90::wgmma_m64n256k16_ss<1, kAb>(o, dp + uint64_t(ks * 32 >> 4), dv + uint64_t(ks * 2048 >> 4),
                                      1);
}

// P (fp32, the S accumulator layout) as A fragments of the operand type, one per 16 keys.
template <sm90::Ab kAb>
__device__ __forceinline__ void p_fragments(const float (&s)[32], uint32_t (&a)[4][4]) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a[ks][i] = pack_operand_x2<kAb>(s[8 * ks + 2 * i], s[8 * ks + 2 * i + 1]);
}

// Writes P (fp32, the S accumulator layout) of this warp's 16 rows into a swizzled [64][64] tile
// of the operand type, 16 keys (one stmatrix) at a time.
template <sm90::Ab kAb>
__device__ __forceinline__ void store_p(const float (&s)[32], uint32_t tile, int warp, int lane) {
  const int row = 16 * warp + ((lane >> 3) & 1) * 8 + (lane & 7);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks)
    sm90::stmatrix_x4(tile + sm90::swizzled_chunk(row, 2 * ks + (lane >> 4)),
                      pack_operand_x2<kAb>(s[8 * ks], s[8 * ks + 1]),
                      pack_operand_x2<kAb>(s[8 * ks + 2], s[8 * ks + 3]),
                      pack_operand_x2<kAb>(s[8 * ks + 4], s[8 * ks + 5]),
                      pack_operand_x2<kAb>(s[8 * ks + 6], s[8 * ks + 7]));
}

// ---- shared memory, the CTA's token, the producer (both sm90 sparse kernels) ----------------

// Addresses in the CTA's shared memory (Sm90Config's layout) from its base.
struct Sm90Smem {
  uint32_t base;
  __device__ uint32_t q() const { return base + Sm90Config::kQ; }
  __device__ uint32_t k(int buffer) const {
    return base + (buffer == 0 ? Sm90Config::kK0 : Sm90Config::kK1);
  }
  __device__ uint32_t q_full() const { return base + Sm90Config::kBarQFull; }
  __device__ uint32_t full(int buffer, int half) const {
    return base + Sm90Config::kBarKFull + 16 * buffer + 8 * half;
  }
  __device__ uint32_t empty(int buffer, int half) const {
    return base + Sm90Config::kBarKEmpty + 16 * buffer + 8 * half;
  }
  __device__ uint32_t valid_full() const { return base + Sm90Config::kBarValid; }
  // Paired CTAs: the peer's shared::cluster address of this CTA's address `base + x` is
  // `base + x + peer_delta()`.
  __device__ uint32_t peer_delta() const {
    return sm90::map_shared_to_rank(base, sm90::cluster_ctarank() ^ 1) - base;
  }
};

// The mbarriers, by thread 0 before the CTA's first __syncthreads (cluster_sync when paired).
// A half is full after the producer warpgroup's 128 arrivals, + as many cp.async completions
// in the 656-byte layout's R half (its rope tile), and when paired the peer's bulk copies of its
// rows (transactions the local producer's thread 0 expects); empty after its consumer
// warpgroup's 128 arrivals, and the peer's group's when paired. Q is the producer's.
template <KvLayout kLayout, bool kPair = false>
__device__ __forceinline__ void init_barriers(const Sm90Smem& sm) {
  constexpr uint32_t kPeers = kPair ? 2 : 1, kProducerThreads = 128;
  sm90::mbarrier_init(sm.q_full(), 128);
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 2; ++h) {
      const bool rope_copies = kLayout == KvLayout::kFp8Scaled && h == 1;
      sm90::mbarrier_init(sm.full(b, h), kProducerThreads * (rope_copies ? 2 : 1));
      sm90::mbarrier_init(sm.empty(b, h), 128 * kPeers);
    }
  sm90::mbarrier_init(sm.valid_full(), kProducerThreads);
  sm90::fence_barrier_init();
}

// A CTA's token and heads: CTA b takes token T - 1 - b / num_groups (last to first: in a prefill
// batch the later tokens of a request see the longer contexts, so the long CTAs start first and
// the short ones fill the tail) and heads [head0, head0 + heads_per_cta).
struct CtaWork {
  int64_t t;
  int head0;
  int num_slots;  // slots read: min(topk_length[t], topk), or topk
  int num_iters;  // pairs of 64-slot blocks
  const int32_t* slots;
  // 64-slot blocks (the keys-on-M kernels take them one at a time).
  __device__ int num_blocks() const {
    return (num_slots + Sm90Config::kBlock - 1) / Sm90Config::kBlock;
  }
};

// Work item `item` (< num_tokens · ceil(H / heads_per_cta)): the last tokens first, a token's head
// groups in order.
__device__ __forceinline__ CtaWork cta_work(const SparseMlaParams& p, int heads_per_cta,
                                            unsigned item) {
  const int num_groups = (p.num_heads + heads_per_cta - 1) / heads_per_cta;
  CtaWork w;
  w.t = p.num_tokens - 1 - int64_t(item / num_groups);
  w.head0 = int(item % num_groups) * heads_per_cta;
  w.num_slots = p.topk;
  if (p.topk_length != nullptr) w.num_slots = min(max(p.topk_length[w.t], 0), p.topk);
  w.num_iters = (w.num_slots + 2 * Sm90Config::kBlock - 1) / (2 * Sm90Config::kBlock);
  w.slots = p.indices + w.t * p.topk;
  return w;
}
// This CTA's item: one per CTA.
__device__ __forceinline__ CtaWork cta_work(const SparseMlaParams& p, int heads_per_cta) {
  return cta_work(p, heads_per_cta, blockIdx.x);
}

// How the 64-head kernel's producer holds its rows' locations: one per lane (iteration_slot)
// for the fp8 pools without a cluster pair, as BlockRows otherwise; each measured faster there
// than the other (docs/perf.md).
template <KvLayout kLayout, bool kPair>
inline constexpr bool kLaneRows = (kLayout != KvLayout::kBf16) && !kPair;

// The producer warpgroup of a CTA (thread wtid of 128), for a token with a slot to read: Q of
// heads [head0, head0 + 64) into the
// Q tiles (zero rows past H; f16 operands: scaled into f16's range, load_q_f16), then blocks 2i
// and 2i + 1 of the token's slots into K0 and K1, half by half in the order K0.L, K1.R, K0.R, K1.L
// of every iteration, each half on its empty barrier of the iteration's parity, with the slots'
// valid flags (both buffers' once per iteration, on valid_full).
// kPair (the 656-byte layout; a cluster of the two CTAs of one token's two 64-head groups, which
// read the same rows): each producer widens half of every block — rows group + 16 i for
// i = 2 rank, 2 rank + 1, i.e. rows [32 rank, 32 rank + 32), bytes [4096 rank, + 4096) of each
// tile — into its own buffer, then sends those bytes of each latent tile to the peer's buffer
// with one bulk copy per tile, completing on the peer's full barrier; it waits for both CTAs'
// consumers to release a half. Each CTA copies every row's rope (bf16 as stored) for itself.
// Flags, Q and valid_full stay per CTA.
template <KvLayout kLayout, bool kPair = false>
__device__ __forceinline__ void produce_blocks(const SparseMlaParams& p, char* smem,
                                               const CtaWork& work, int wtid) {
  static_assert(!kPair || kLayout == KvLayout::kFp8Scaled,
                "paired producers: the 656-byte layout (run_sparse_mla_sm90)");
  using C = Sm90Config;
  constexpr sm90::Ab kAb = kOperand<kLayout>;
  const int64_t t = work.t;
  const int head0 = work.head0, num_slots = work.num_slots, num_iters = work.num_iters;
  const int32_t* slots = work.slots;
  const Sm90Smem sm{smem_addr(smem)};
  const uint32_t q_tiles = sm.q(), k0_tiles = sm.k(0), k1_tiles = sm.k(1);
  const uint32_t bar_q = sm.q_full(), bar_valid = sm.valid_full();
  const auto bar_full = [&](int buffer, int half) { return sm.full(buffer, half); };
  const auto bar_empty = [&](int buffer, int half) { return sm.empty(buffer, half); };
  uint8_t* valid = reinterpret_cast<uint8_t*>(smem + C::kValid);  // [2][64]
  const int group = wtid / 8, lane8 = wtid % 8;
  // A token with no slot to read: no consumer waits for Q or a block, so nothing is copied.
  if (num_iters == 0) return;
  if constexpr (kAb == sm90::Ab::kF16) {
    load_q_f16(p, t, head0, q_tiles, reinterpret_cast<uint32_t*>(smem + C::kQAmax),
               reinterpret_cast<int*>(smem + C::kQShift), bar_q, wtid);
  } else {
    copy_q_bf16(p, t, head0, q_tiles, group, lane8);
    sm90::cp_async_mbarrier_arrive(bar_q);
  }

  // The locations of this iteration's blocks, validated by their first use:
  // - as BlockRows: rows[b], buffer b's block, loaded at least a step before the wait for the
  //   first half they fill (the next iteration's buffer 0 before step K1.L, buffer 1 after it);
  // - kLaneRows: held, one per lane (load_iteration_rows), validated; next_held, the next
  //   iteration's, loaded at the end of the previous iteration and validated before step K1.L
  //   (whose fp8 loads are the next K0.L's rows), three steps later.
  // fp8 pools also hold row i of the next step in registers (staged[i]), loaded as soon as row i
  // of this step is stored, so each load has a whole step (and the wait for the next buffer) to
  // land.
  // This producer widens rows group + 16 (row0 + k) of each block, k < kOwnRows.
  constexpr int kOwnRows = kPair ? 2 : 4;
  const uint32_t rank = kPair ? sm90::cluster_ctarank() : 0;
  const int row0 = 2 * int(rank);  // 0 unless kPair
  constexpr bool kLane = kLaneRows<kLayout, kPair>;
  const int warp = wtid / 32, lane = wtid % 32;
  // The peer's shared::cluster address of this CTA's shared-memory address `addr`.
  const uint32_t peer_delta = kPair ? sm.peer_delta() : 0;
  const auto peer = [&](uint32_t addr) { return addr + peer_delta; };

  BlockRows rows[2];
  int32_t held, next_held;
  Fp8Row staged[kOwnRows];
  const Fp8StoreOffsets offsets = fp8_store_offsets<kLayout>(group, lane8);
  // kLaneRows: the loop takes the slot list and count from shared memory (Sm90Config::kSlotList)
  // where it loads the next iteration's locations; held in registers through the loop, they
  // spill at the producer's 88.
  const auto slot_list = reinterpret_cast<const int32_t* volatile*>(smem + C::kSlotList);
  const auto slot_count = reinterpret_cast<volatile int*>(smem + C::kSlotList + 8);
  if constexpr (kLane) {
    if (wtid == 0) {
      *slot_list = slots;
      *slot_count = num_slots;
    }
    sm90::named_barrier_sync(C::kSyncProducer, 128);
    held = valid_location(p, load_iteration_rows(slots, 0, num_slots, lane, warp));
    next_held = num_iters > 1 ? load_iteration_rows(slots, 1, num_slots, lane, warp) : -1;
  } else {
    rows[0] = block_rows(slots, 0, num_slots, group);
    rows[1] = block_rows(slots, 1, num_slots, group);
    if constexpr (kLayout != KvLayout::kBf16) validate_rows(p, rows[0]);
  }
  // Row row0 + k of the producer's share of buffer b's block, this iteration's or (kNext) the
  // next one's; the BlockRows' rows[0] holds the next iteration's from before step K1.L.
  // (rank selects between compile-time indices: a run-time index would put loc in local memory)
  const auto own_row = [&](auto next_c, int b, int k) {
    if constexpr (kLane)
      return iteration_row(decltype(next_c)::value ? next_held : held, b, k);
    else
      return rank != 0 ? rows[b].loc[2 + k] : rows[b].loc[k];
  };
  using Now = std::false_type;
  if constexpr (kLayout != KvLayout::kBf16) {
#pragma unroll
    for (int k = 0; k < kOwnRows; ++k)
      load_row_fp8<kLayout, 0, kPair>(p, own_row(Now{}, 0, k), lane8, staged[k]);
  }

  // Halves in the order the consumers release them: K0.L, K1.R, K0.R, K1.L (the four steps of
  // an iteration), each on its buffer's empty barrier of the iteration's parity. A buffer's
  // valid flags are written at steps 0 and 1: they are read only by the buffer's own group,
  // which has masked the previous iteration once it released its first half of the buffer.
  // (kLaneRows: each lane writes the flag of the row it holds.)
  const auto store_flags = [&](int buffer) {
    if constexpr (kLane) {
      if ((lane / 4) % 2 == buffer) valid[iteration_slot(0, lane, warp)] = held >= 0;
    } else if (lane8 == 0) {
#pragma unroll
      for (int i = 0; i < 4; ++i) valid[buffer * C::kBlock + group + 16 * i] = rows[buffer].ok(i);
    }
  };
  const auto step = [&](auto buffer_c, auto half_c, int it, bool has_next) {
    constexpr int kBuffer = decltype(buffer_c)::value, kHalf = decltype(half_c)::value;
    const uint32_t full = bar_full(kBuffer, kHalf);
    const uint32_t tiles = kBuffer == 0 ? k0_tiles : k1_tiles;
    sm90::mbarrier_wait(bar_empty(kBuffer, kHalf), (it & 1) ^ 1);
    // BlockRows are validated at their first use: bf16, the step that copies the block's first
    // half; fp8, the step that loads them for the next one.
    if constexpr (kLayout == KvLayout::kBf16 && kBuffer == kHalf) validate_rows(p, rows[kBuffer]);
    if constexpr (kLayout != KvLayout::kBf16 && !kLane && kHalf == 0)
      validate_rows(p, rows[1 - kBuffer]);
    if constexpr (kLayout == KvLayout::kBf16) {
      load_half_bf16(p, rows[kBuffer], tiles, kHalf == 0 ? 0 : C::kHalfTiles,
                     kHalf == 0 ? C::kHalfTiles : C::kTiles, group, lane8);
      sm90::cp_async_mbarrier_arrive(full);
    } else {
      // The next step: (1, R) after (0, L); (0, R) after (1, R); (1, L) after (0, R); the
      // next iteration's (0, L) after (1, L).
      constexpr int kNextBuffer = 1 - kBuffer, kNextHalf = kBuffer == 0 ? 1 - kHalf : kHalf;
      using Next = std::bool_constant<kBuffer == 1 && kHalf == 0>;  // the next iteration's rows
#pragma unroll
      for (int k = 0; k < kOwnRows; ++k) {
        store_row_fp8<kLayout, kHalf, kPair>(p, own_row(Now{}, kBuffer, k), staged[k], tiles,
                                             row0 + k, offsets, lane8);
        if (has_next)
          load_row_fp8<kLayout, kNextHalf, kPair>(p, own_row(Next{}, kNextBuffer, k), lane8,
                                                  staged[k]);
      }
      if constexpr (kPair && kLayout == KvLayout::kFp8Scaled && kHalf == 1)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          copy_rope_656(p, rows[kBuffer].loc[i], tiles, i, offsets, lane8);
      sm90::fence_proxy_async_shared();
      // Paired: once the warpgroup's stores are fenced, thread 0 sends this producer's rows of
      // the half's latent tiles to the peer (the bulk copies read them through the async proxy)
      // and expects the peer's as transactions on this half's barrier.
      constexpr int kFirstTile = kHalf == 0 ? 0 : C::kHalfTiles;
      constexpr int kEndTile = kHalf == 0 ? C::kHalfTiles : C::kLatentTiles;
      constexpr uint32_t kPeerBytes = (kEndTile - kFirstTile) * C::kPairRowBytes;
      if constexpr (kPair) {
        sm90::named_barrier_sync(C::kSyncProducerPair, 128);
        if (wtid == 0)
#pragma unroll
          for (int tile = kFirstTile; tile < kEndTile; ++tile) {
            const uint32_t rows_src = tiles + tile * C::kTileBytes + C::kPairRowBytes * rank;
            sm90::bulk_copy_to_peer(peer(rows_src), rows_src, C::kPairRowBytes, peer(full));
          }
      }
      if (kPair && wtid == 0)
        sm90::mbarrier_arrive_expect_tx(full, kPeerBytes);
      else
        sm90::mbarrier_arrive(full);
      // The 656-byte layout's R half also waits for its rope copies (a second arrival each).
      if constexpr (kLayout == KvLayout::kFp8Scaled && kHalf == 1)
        sm90::cp_async_mbarrier_arrive(full);
    }
    if constexpr (kBuffer == kHalf) store_flags(kBuffer);  // steps 0 and 1
    if constexpr (kBuffer == 1 && kHalf == 1) sm90::mbarrier_arrive(bar_valid);
  };
  using Zero = std::integral_constant<int, 0>;
  using One = std::integral_constant<int, 1>;
#pragma unroll 1
  for (int it = 0; it < num_iters; ++it) {
    const bool more = it + 1 < num_iters;
    step(Zero{}, Zero{}, it, true);  // K0.L; fp8: loads K1.R
    step(One{}, One{}, it, true);    // K1.R; fp8: loads K0.R
    step(Zero{}, One{}, it, true);   // K0.R; fp8: loads K1.L
    // The next iteration's rows (fp8: for the loads issued during K1.L).
    if constexpr (kLane)
      next_held = valid_location(p, next_held);
    else if (more)
      rows[0] = block_rows(slots, 2 * it + 2, num_slots, group);
    step(One{}, Zero{}, it, more);  // K1.L; fp8: loads the next K0.L
    if constexpr (kLane) {
      held = next_held;
      if (it + 2 < num_iters)
        next_held = load_iteration_rows(*slot_list, it + 2, *slot_count, lane, warp);
    } else if (more) {
      rows[1] = block_rows(slots, 2 * it + 3, num_slots, group);
    }
  }
  cp_async_wait<0>();
}

// The start of a CTA of either sm90 sparse kernel: the mbarriers, then warpgroup 2 lowers its
// registers, runs the producer and gets false; the consumer groups raise theirs and get true.
// wg: the warpgroup index, warp-uniform as the compiler sees it (wgmma must not sit on a path it
// considers divergent); wtid: the thread's index in its warpgroup. kPair: the CTA is one of a
// cluster pair (produce_blocks); its peer's barriers are initialized before any thread goes on,
// and the producer leaves only when every thread of both CTAs is done with the other's shared
// memory (the consumers' cluster_sync at their end).
template <KvLayout kLayout, bool kPair = false>
__device__ __forceinline__ bool start_cta(const SparseMlaParams& p, char* smem, const Sm90Smem& sm,
                                          const CtaWork& work, int& wg, int& wtid) {
  using W = Sm90Warps;
  if (threadIdx.x == 0) init_barriers<kLayout, kPair>(sm);
  if constexpr (kPair)
    sm90::cluster_sync();
  else
    __syncthreads();
  wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  wtid = threadIdx.x % 128;
  if (wg == 2) {
    sm90::setmaxnreg_dec<W::kProducerRegs>();
    // kLaneRows producers compute their work item here: held from before the split, its values
    // are live into the producer's registers and spill there.
    if constexpr (kLaneRows<kLayout, kPair>)
      produce_blocks<kLayout, kPair>(p, smem, cta_work(p, Sm90Config::kHeads), wtid);
    else
      produce_blocks<kLayout, kPair>(p, smem, work, wtid);
    if constexpr (kPair) sm90::cluster_sync();
    return false;
  }
  sm90::setmaxnreg_inc<W::kConsumerRegs>();
  return true;
}

// kPair: launched as clusters of 2 CTAs, the token's two 64-head groups (produce_blocks).
template <KvLayout kLayout, bool kPair>
__global__ void __launch_bounds__(Sm90Warps::kThreads, 1)
    sparse_mla_sm90_kernel(const __grid_constant__ SparseMlaParams p) {
  using C = Sm90Config;
  constexpr sm90::Ab kAb = kOperand<kLayout>;
  extern __shared__ __align__(1024) char smem[];
  const Sm90Smem sm{smem_addr(smem)};
  const uint32_t base = sm.base;
  const uint32_t q_tiles = sm.q(), k0_tiles = sm.k(0), k1_tiles = sm.k(1);
  const uint32_t bar_q = sm.q_full(), bar_valid = sm.valid_full();
  const auto bar_full = [&](int buffer, int half) { return sm.full(buffer, half); };
  const auto bar_empty = [&](int buffer, int half) { return sm.empty(buffer, half); };
  const uint8_t* valid = reinterpret_cast<const uint8_t*>(smem + C::kValid);  // [2][64]
  float* row_max = reinterpret_cast<float*>(smem + C::kRowMax);               // [3][64]
  float* row_sum = reinterpret_cast<float*>(smem + C::kRowSum);               // [2][64]

  // The CTA's work item, computed after the warp-role split with kLaneRows (start_cta).
  CtaWork work;
  if constexpr (!kLaneRows<kLayout, kPair>) work = cta_work(p, C::kHeads);
  int wg, wtid;
  if (!start_cta<kLayout, kPair>(p, smem, sm, work, wg, wtid)) return;
  if constexpr (kLaneRows<kLayout, kPair>) work = cta_work(p, C::kHeads);
  const int64_t t = work.t;
  const int head0 = work.head0, num_iters = work.num_iters;

  // ---- consumers ----------------------------------------------------------------------------
  // Paired: a half is released to both CTAs' producers.
  const uint32_t peer_delta = kPair ? sm.peer_delta() : 0;
  const auto release = [&](int buffer, int half) {
    sm90::mbarrier_arrive(bar_empty(buffer, half));
    if constexpr (kPair) sm90::mbarrier_arrive_cluster(bar_empty(buffer, half) + peer_delta);
  };
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const int row0 = 16 * warp + g;  // this thread's rows: row0, row0 + 8
  // fp8-raw: every stored value is code · k_scale, so k_scale multiplies S and O.
  const float value_scale = kLayout == KvLayout::kFp8Raw ? p.k_scale : 1.f;
  // f16 operands: S is the product with Q · 2^-shift (load_q_f16); set once Q has landed.
  float scale_log2 = p.sm_scale * value_scale * kLog2e;
  const uint32_t k_own = wg == 0 ? k0_tiles : k1_tiles;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float s[32];
  // m: the exponent offset of O and l (log2 domain; finite: exp2(m - m) stays 1), shared by the
  // two groups at the end of every iteration. It is not the exact running max: it moves only
  // when a block's max passes it by more than kRescaleSlack, so P = 2^(s - m) <= 2^kRescaleSlack
  // and most iterations leave O unscaled; the output O / l is the same. m_true: the exact max of
  // this group's blocks (max_logits).
  float m[2] = {-1e30f, -1e30f};
  float m_true[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};  // running sum of this thread's columns

  // S of block 2 it + wg, as two commit groups (the half filled first, then the other). WG0 reads
  // its buffer L then R, WG1 R then L: the order the producer fills them. Between the two a
  // group may wait for its older MMAs and release their buffer (`between`).
  const auto issue_qk = [&](int it, auto&& between) {
    const uint32_t phase = it & 1;
    constexpr int kL = C::kHalfTiles, kR = C::kTiles - C::kHalfTiles;
    if (wg == 0) {
      sm90::mbarrier_wait(bar_full(0, 0), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<0, kL, kAb>(s, q_tiles, k_own, false);
      sm90::wgmma_commit();
      between();
      sm90::mbarrier_wait(bar_full(0, 1), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<kL, kR, kAb>(s, q_tiles, k_own, true);
    } else {
      sm90::mbarrier_wait(bar_full(1, 1), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<kL, kR, kAb>(s, q_tiles, k_own, false);
      sm90::wgmma_commit();
      between();
      sm90::mbarrier_wait(bar_full(1, 0), phase);
      sm90::wgmma_fence();
      issue_qk_tiles<0, kL, kAb>(s, q_tiles, k_own, true);
    }
    sm90::wgmma_commit();
  };
  const auto nothing = [] {};

  if (num_iters > 0) {
    sm90::mbarrier_wait(bar_q, 0);
    if constexpr (kAb == sm90::Ab::kF16)
      scale_log2 *= __int_as_float((127 + *reinterpret_cast<const int*>(smem + C::kQShift)) << 23);
    sm90::fence_operands(s);
    issue_qk(0, nothing);
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
    for (int r = 0; r < 2; ++r) {
      block_max[r] = quad_max(block_max[r]) * scale_log2;
      m_true[r] = fmaxf(m_true[r], block_max[r]);
    }
    // The offset after a block with max x over offset m0.
    const auto next_offset = [](float m0, float x) {
      return x > m0 + C::kRescaleSlack ? x : m0;  // false for NaN and for -inf
    };

    uint32_t a[4][4];
    // O and l to offset m_new[r] from m[r] (no work where they are equal).
    const auto rescale_o = [&](const float(&m_new)[2]) {
      if (m_new[0] == m[0] && m_new[1] == m[1]) return;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float alpha = exp2_approx(m[r] - m_new[r]);
        l[r] *= alpha;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          o[4 * j + 2 * r] *= alpha;
          o[4 * j + 2 * r + 1] *= alpha;
        }
      }
    };
    const auto softmax = [&](const float(&m_new)[2]) {
      rescale_o(m_new);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
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
        m_own[r] = next_offset(m[r], block_max[r]);
        if (q == 0) row_max[row0 + 8 * r] = m_own[r];  // WG0's offset
      }
      softmax(m_own);
      sm90::named_barrier_arrive(C::kSyncMax0, 256);
      p_fragments<kAb>(s, a);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
      issue_pv_rs<kAb>(o, a, k0_tiles);
      sm90::wgmma_commit();
      // K0.L is released as soon as P0·V0L completes: it is the first half the producer
      // refills for the next iteration.
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      sm90::fence_operands(a);
      release(0, 0);

      // The offset after both blocks: this block's P for WG1 to it, then O and l.
      sm90::named_barrier_sync(C::kSyncMax1, 256);
      float m_final[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) m_final[r] = row_max[(1 + (it & 1)) * C::kHeads + row0 + 8 * r];
      if (m_final[0] != m[0] || m_final[1] != m[1]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float beta = exp2_approx(m[r] - m_final[r]);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            s[4 * j + 2 * r] *= beta;
            s[4 * j + 2 * r + 1] *= beta;
          }
        }
      }
      store_p<kAb>(s, base + C::kP0, warp, lane);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier_arrive(C::kSyncP0, 256);
      rescale_o(m_final);
#pragma unroll
      for (int r = 0; r < 2; ++r) m[r] = m_final[r];
      sm90::named_barrier_sync(C::kSyncP1, 256);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
      issue_pv_ss<kAb>(o, base + C::kP1, k1_tiles);
      sm90::wgmma_commit();
      // K1.L is released once P1·V1L completes, between the two halves of the next S0, so the
      // release does not wait for K0.R of the next iteration.
      const auto release_k1l = [&] {
        sm90::wgmma_wait<1>();
        sm90::fence_operands(o);
        release(1, 0);
      };
      if (it + 1 < num_iters) {
        sm90::fence_operands(s);
        issue_qk(it + 1, release_k1l);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(s);
      } else {
        sm90::wgmma_wait<0>();
        release(1, 0);
      }
      sm90::fence_operands(o);
    } else {
      sm90::named_barrier_sync(C::kSyncMax0, 256);
      float m_final[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        m_final[r] = next_offset(row_max[row0 + 8 * r], block_max[r]);
        if (q == 0) row_max[(1 + (it & 1)) * C::kHeads + row0 + 8 * r] = m_final[r];
      }
      sm90::named_barrier_arrive(C::kSyncMax1, 256);
      softmax(m_final);
      p_fragments<kAb>(s, a);
      sm90::fence_operands(o);
      sm90::wgmma_fence();
      issue_pv_rs<kAb>(o, a, k1_tiles + C::kHalfTiles * C::kTileBytes);
      sm90::wgmma_commit();
      store_p<kAb>(s, base + C::kP1, warp, lane);
      sm90::fence_proxy_async_shared();
      sm90::named_barrier_arrive(C::kSyncP1, 256);
      sm90::named_barrier_sync(C::kSyncP0, 256);
      issue_pv_ss<kAb>(o, base + C::kP0, k0_tiles + C::kHalfTiles * C::kTileBytes);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();
      sm90::fence_operands(a);
      release(1, 1);
      sm90::wgmma_wait<0>();
      sm90::fence_operands(o);
      release(0, 1);
      if (it + 1 < num_iters) {
        sm90::fence_operands(s);
        issue_qk(it + 1, nothing);
        sm90::wgmma_wait<0>();
        sm90::fence_operands(s);
      }
    }
  }

  // ---- epilogue: the two groups' row sums, normalize, write -----------------------------------
  // WG1's exact max goes to row_max[0]: WG0 wrote that slot last before its final MAX0 arrival,
  // and WG1 read it last after it.
  float total[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
    if (q == 0) {
      row_sum[wg * C::kHeads + row0 + 8 * r] = l[r];
      if (wg == 1) row_max[row0 + 8 * r] = m_true[r];
    }
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
      if (p.max_logits != nullptr)
        p.max_logits[th] =
            total[r] == 0.f ? -INFINITY : fmaxf(m_true[r], row_max[row0 + 8 * r]) * kLn2;
    }
  }
  if constexpr (kPair) sm90::cluster_sync();  // the peer may still arrive on this CTA's barriers
}

// Launches kKernel (an sm90 sparse kernel, compiled for Sm90Warps) on num_ctas CTAs of that many
// threads with smem_bytes of dynamic shared memory, opted in once per device, in clusters of
// cluster_ctas consecutive CTAs (num_ctas a multiple of it).
template <auto kKernel>
cudaError_t launch_sm90_sparse(const SparseMlaParams& params, int64_t num_ctas, int smem_bytes,
                               cudaStream_t stream, unsigned cluster_ctas = 1) {
  static std::atomic<uint64_t> smem_set{0};
  const cudaError_t err =
      opt_in_dynamic_smem(reinterpret_cast<const void*>(kKernel), smem_bytes, smem_set);
  if (err != cudaSuccess) return err;
  if (num_ctas > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(num_ctas));
  config.blockDim = dim3(unsigned(Sm90Warps::kThreads));
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_ctas;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = cluster_ctas > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, kKernel, params);
}

// The 656-byte layout at 65-128 heads (the token's two 64-head groups read the same rows) takes
// the paired kernel: each CTA of the cluster widens half of every block for both
// (produce_blocks). fp8-raw's one conversion per pair costs less than the pairing adds there
// (docs/perf.md, runs R1-R3 and AJ2).
template <KvLayout kLayout>
cudaError_t run_sparse_mla_sm90(const SparseMlaParams& params, cudaStream_t stream) {
  using C = Sm90Config;
  if (params.num_tokens == 0 || params.num_heads == 0) return cudaSuccess;
  const int64_t num_groups = (params.num_heads + C::kHeads - 1) / C::kHeads;
  const int64_t num_ctas = params.num_tokens * num_groups;
  if constexpr (kLayout == KvLayout::kFp8Scaled)
    if (num_groups == 2)
      return launch_sm90_sparse<&sparse_mla_sm90_kernel<kLayout, true>>(params, num_ctas,
                                                                        C::kSmemBytes, stream, 2);
  return launch_sm90_sparse<&sparse_mla_sm90_kernel<kLayout, false>>(params, num_ctas,
                                                                     C::kSmemBytes, stream);
}

}  // namespace dsakit::cuda::sparse_mla
