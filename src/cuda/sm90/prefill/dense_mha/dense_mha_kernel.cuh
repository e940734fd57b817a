// Dense MHA prefill on Hopper (wgmma + TMA, warp-specialized), bf16 in / fp32 accumulate.
//
// One CTA of three warpgroups per (head, tile); a tile is <= 128 query rows of one request and a
// range of its kv blocks (DenseTile, dense_sm90_shape(d_v): blocks of kBlockN rows).
//
//   WG2 (producer; one warp works): Q of the tile once, then per kv block its K tile
//     [k_nope of this head | k_pe shared by all heads] and its V tile, by TMA into a ring of
//     kStages stages (K and V with their own full / empty mbarriers). The tile's last block may
//     reach past the rows its last query sees (later positions of the request, the next request,
//     or the tensor's end, which TMA reads as zeros): those V rows are zeroed before the block is
//     released, so P = 0 there multiplies zeros, never another row's NaN or Inf.
//   WG0 / WG1 (consumers): WG w owns query rows [64w, 64w + 64) of the tile and visits the kv
//     blocks those rows see. A tile of <= 64 rows over >= 2 blocks (a short extend over a
//     prefix, a prompt's last rows) would leave WG1 idle: there both groups take rows [0, 64),
//     group w the blocks w, w + 2, ... (with two stages, always stage w: each block has one
//     consumer), and at the end WG1 hands its (m, l, O) to WG0 through the drained ring, which
//     combines the two by their offsets. Per block b:
//       S = Q_w · K_bᵀ                  (64 x kBlockN, wgmma from shared memory, K = d_qk)
//       P = exp2(S · sm_scale · log2 e − m), the online offset m (a lagging max) and sum l per
//         row (registers)
//       O = O · alpha + P · V_b          (64 x d_v, P from registers as bf16)
//     S of block b + 1 is issued before P·V of block b, and its softmax runs while P·V does:
//     only the O rescale waits for it. The two groups take turns issuing (named barriers
//     kTurn0 + w), so one group's softmax overlaps the other's MMAs.
//   kMasked (DenseMhaParams::kv_mask): S is also masked by the query's bits, read from global
//     memory per block (a thread's two rows x kN / 32 words, loaded before the block's S is
//     issued) and applied with the causal mask; the blocks visited are the causal ones.
//
// Shared memory (tiles are [rows][64 bf16] with the 128-byte swizzle, 1024-byte aligned):
//   Q  [d_qk / 64 tiles of 128 rows]             k_nope tiles, then k_pe
//   K  [kStages][d_qk / 64 tiles of kBlockN rows]
//   V  [kStages][d_v / 64 tiles of kBlockN rows]
//   mbarriers: q_full, k_full[s], k_empty[s], v_full[s], v_empty[s], v_staged[s]
//   split blocks, after the last block: WG1's O, m, l as [kDimV / 2 + 4][128 threads] f32
//     over the K and V stages
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <type_traits>

#include "src/cuda/attention/dense_mha_params.h"
#include "src/cuda/common/hopper.cuh"
#include "src/cuda/common/launch.h"
#include "src/cuda/common/tma.h"
#include "src/cuda/common/warp_mma.cuh"

namespace dsakit::cuda::dense_mha {

// The launch parameters: the shared ones and the TMA maps of the five operands.
struct DenseMhaSm90Params {
  CUtensorMap q_nope;  // [T, H, d_nope] boxes [128 rows][1 head][64]
  CUtensorMap q_pe;    // [T, H, d_rope] the same boxes
  CUtensorMap k_nope;  // [N, H, d_nope] (strided) boxes [kBlockN rows][1 head][64]
  CUtensorMap k_pe;    // [N, d_rope]    boxes [kBlockN rows][64]
  CUtensorMap v;       // [N, H, d_v]    (strided) boxes [kBlockN rows][1 head][64]
  DenseMhaParams p;
};

template <int kDimNope, int kDimRope, int kDimV>
struct DenseSm90Traits {
  static constexpr DenseTileShape kShape = dense_sm90_shape(kDimV);
  static constexpr int kBlockM = kShape.block_m;  // query rows per CTA
  static constexpr int kWgRows = 64;              // query rows per consumer warpgroup
  static constexpr int kBlockN = kShape.block_n;  // kv rows per block
  static constexpr int kDimQk = kDimNope + kDimRope;
  static constexpr int kNopeTiles = kDimNope / 64, kQkTiles = kDimQk / 64, kVTiles = kDimV / 64;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static_assert(kDimNope % 64 == 0 && kDimRope % 64 == 0 && kDimV % 64 == 0);
  static_assert(kBlockM == 2 * kWgRows && (kBlockN == 64 || kBlockN == 80 || kBlockN == 128));
  static_assert(kDimV == 128 || kDimV == 256, "P·V is one m64n128 or m64n256 wgmma per k16");

  static constexpr int kQTileBytes = kBlockM * 128;
  static constexpr int kKvTileBytes = kBlockN * 128;
  static constexpr int kQBytes = kQkTiles * kQTileBytes;
  static constexpr int kKStageBytes = kQkTiles * kKvTileBytes;
  static constexpr int kVStageBytes = kVTiles * kKvTileBytes;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQBytes;
  static constexpr int kV = kK + kStages * kKStageBytes;
  static constexpr int kBars = kV + kStages * kVStageBytes;
  static constexpr int kBarQ = kBars;
  static constexpr int kBarKFull = kBarQ + 8;  // + 8 * stage, likewise below
  static constexpr int kBarKEmpty = kBarKFull + 8 * kStages;
  static constexpr int kBarVFull = kBarKEmpty + 8 * kStages;
  static constexpr int kBarVEmpty = kBarVFull + 8 * kStages;
  static constexpr int kBarVStaged = kBarVEmpty + 8 * kStages;
  static constexpr int kSmemBytes = kBarVStaged + 8 * kStages;
  static constexpr int kTurn0 = 1;  // named barriers kTurn0 + w: group w's turn to issue MMAs
  static constexpr int kMerge = 3;  // named barrier of the split-block hand-over (256 threads)
  static constexpr int kMergeBytes = (kDimV / 2 + 4) * 128 * 4;
  static_assert(kMergeBytes <= kBars - kK, "the hand-over fits in the K and V stages");
  // How far (log2 units) a block's max may pass the softmax offset before O is rescaled.
  static constexpr float kRescaleSlack = 8.f;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");

  // setmaxnreg moves registers within the launch allocation (168 x 384 under
  // __launch_bounds__(384, 1)).
  static constexpr int kConsumerRegs = 232;
  static constexpr int kProducerRegs = 40;
  static_assert(2 * 128 * kConsumerRegs + 128 * kProducerRegs <= 168 * kThreads);
};

// S[64 x kN] = Q_w · Kᵀ over kTiles column tiles of 64: Q_w from `q` (this group's first row of
// tile 0; tiles kQTileBytes apart), K from `k` (kN rows per tile, tiles kKTileBytes apart).
template <int kN, int kTiles, int kQTileBytes, int kKTileBytes>
__device__ __forceinline__ void issue_qk(float (&s)[kN / 2], uint32_t q, uint32_t k) {
  const uint64_t dq = sm90::smem_desc_sw128(q, 16, 1024);
  const uint64_t dk = sm90::smem_desc_sw128(k, 16, 1024);
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint64_t oq = uint64_t(tile * kQTileBytes + ks * 32) >> 4;
      const uint64_t ok = uint64_t(tile * kKTileBytes + ks * 32) >> 4;
      if constexpr (kN == 128)
        sm90::wgmma_m64n128k16_ss<0>(s, dq + oq, dk + ok, tile > 0 || ks > 0);
      else if constexpr (kN == 80)
        sm90::wgmma_m64n80k16_ss<0>(s, dq + oq, dk + ok, tile > 0 || ks > 0);
      else
        sm90::wgmma_m64n64k16_ss<0>(s, dq + oq, dk + ok, tile > 0 || ks > 0);
    }
}

// O[64 x kDimV] += P · V: P from registers (a[ks]: kv rows 16 ks ..), V tiles of kKTileBytes
// (kv rows) x 64 columns, MN-major.
template <int kDimV, int kKSteps, int kKTileBytes>
__device__ __forceinline__ void issue_pv(float (&o)[kDimV / 2], const uint32_t (&a)[kKSteps][4],
                                         uint32_t v) {
  const uint64_t dv = sm90::smem_desc_sw128(v, kKTileBytes, 1024);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const uint64_t offset = uint64_t(ks * 16 * 128) >> 4;
    if constexpr (kDimV == 128)
      sm90::wgmma_m64n128k16_rs<1>(o, a[ks], dv + offset, 1);
    else
      sm90::wgmma_m64n256k16_rs<1>(o, a[ks], dv + offset, 1);
  }
}

// Split blocks, after both groups' last block: WG1's O (its fragment, kDimV / 2 values), offsets
// m and partial sums l of rows row0, row0 + 8 pass to WG0 through `xfer` ([kDimV / 2 + 4][128]
// f32, thread-minor: conflict-free), and WG0 combines them with its own: each side weighted by
// 2^(m_w - max m) (0 for a side that saw no key of the row, m_w = -inf), so O / l and m are those
// of all the tile's blocks. Threads of the two groups with the same index hold the same rows and
// columns. Every MMA of both groups has completed and every block has landed before the first
// barrier: the K and V stages are free.
template <int kMerge, int kDimV>
__device__ __forceinline__ void merge_split_blocks(float (&o)[kDimV / 2], float (&m)[2],
                                                   float (&l)[2], float* xfer, int wg, int wtid) {
  constexpr int kM = kDimV / 2, kL = kDimV / 2 + 2;  // rows of xfer holding m[2], l[2]
  sm90::named_barrier_sync(kMerge, 256);
  if (wg == 1) {
#pragma unroll
    for (int i = 0; i < kDimV / 2; ++i) xfer[i * 128 + wtid] = o[i];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      xfer[(kM + r) * 128 + wtid] = m[r];
      xfer[(kL + r) * 128 + wtid] = l[r];
    }
    sm90::named_barrier_arrive(kMerge, 256);
    return;
  }
  sm90::named_barrier_sync(kMerge, 256);
  float mine[2], theirs[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m1 = xfer[(kM + r) * 128 + wtid], l1 = xfer[(kL + r) * 128 + wtid];
    const float mx = fmaxf(m[r], m1);
    mine[r] = m[r] == -INFINITY ? 0.f : exp2f(m[r] - mx);
    theirs[r] = m1 == -INFINITY ? 0.f : exp2f(m1 - mx);
    l[r] = l[r] * mine[r] + l1 * theirs[r];
    m[r] = mx;
  }
#pragma unroll
  for (int i = 0; i < kDimV / 2; ++i) {
    const int r = (i >> 1) & 1;  // o[4 j + 2 r + e] is row row0 + 8 r
    o[i] = o[i] * mine[r] + xfer[i * 128 + wtid] * theirs[r];
  }
}

template <int kDimNope, int kDimRope, int kDimV, bool kMasked>
__global__ void __launch_bounds__(DenseSm90Traits<kDimNope, kDimRope, kDimV>::kThreads, 1)
    dense_mha_sm90_kernel(const __grid_constant__ DenseMhaSm90Params params) {
  using Tr = DenseSm90Traits<kDimNope, kDimRope, kDimV>;
  constexpr int kN = Tr::kBlockN, kStages = Tr::kStages;
  const DenseMhaParams& p = params.p;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = smem_addr(smem);
  const uint32_t q_tiles = base + Tr::kQ, k_tiles = base + Tr::kK, v_tiles = base + Tr::kV;
  const uint32_t bar_q = base + Tr::kBarQ;
  const auto bar = [&](int offset, int stage) { return base + offset + 8 * stage; };

  // Heads in L2-sized groups, tile-major within a group (dense_sm90_cta_work).
  const DenseCtaWork work = dense_sm90_cta_work(blockIdx.x, p.num_tiles, p.num_heads, p.head_group);
  const int h = work.head, tile_index = work.tile;
  const DenseTile tile = p.tiles != nullptr ? p.tiles[tile_index] : p.inline_tiles[tile_index];
  const int kv_len = tile.first_query_pos + tile.q_len;  // rows the tile's last query sees
  const int block_begin = tile.block_begin;
  const int block_end = max(block_begin, min(tile.block_end, (kv_len + kN - 1) / kN));
  // Split blocks: both groups on rows [0, 64), block i (from block_begin) consumed by group i % 2
  // alone, so a stage is released by 128 threads rather than 256.
  const bool split_blocks =
      p.split_short_tiles != 0 && tile.q_len <= Tr::kWgRows && block_end - block_begin >= 2;
  const uint32_t releasers = split_blocks ? 128 : 256;

  if (threadIdx.x == 0) {
    sm90::mbarrier_init(bar_q, 1);
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(bar(Tr::kBarKFull, s), 1);
      sm90::mbarrier_init(bar(Tr::kBarKEmpty, s), releasers);
      sm90::mbarrier_init(bar(Tr::kBarVFull, s), 1);
      sm90::mbarrier_init(bar(Tr::kBarVEmpty, s), releasers);
      sm90::mbarrier_init(bar(Tr::kBarVStaged, s), 1);
    }
    sm90::fence_barrier_init();
  }
  __syncthreads();

  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0), wtid = threadIdx.x % 128;
  if (wg == 2) {
    // ---- producer ----------------------------------------------------------------------------
    sm90::setmaxnreg_dec<Tr::kProducerRegs>();
    if (wtid >= 32 || block_begin == block_end) return;
    const int lane = wtid;
    if (lane == 0) {
      sm90::prefetch_tensor_map(&params.k_nope);
      sm90::prefetch_tensor_map(&params.k_pe);
      sm90::prefetch_tensor_map(&params.v);
      sm90::mbarrier_arrive_expect_tx(bar_q, Tr::kQBytes);
#pragma unroll
      for (int c = 0; c < Tr::kQkTiles; ++c) {
        const uint32_t dst = q_tiles + c * Tr::kQTileBytes;
        if (c < Tr::kNopeTiles)
          sm90::tma_load_3d(dst, &params.q_nope, bar_q, 64 * c, h, tile.q_begin);
        else
          sm90::tma_load_3d(dst, &params.q_pe, bar_q, 64 * (c - Tr::kNopeTiles), h, tile.q_begin);
      }
    }
    // A group's step over block i waits for K of its next block and V of block i: the next
    // block is i + 1 (K of block i loaded before V of block i, k_ahead 0) or, with split
    // blocks, i + 2 (K of block i + 1 before V of block i: k_ahead 1).
    const int num_blocks = block_end - block_begin, k_ahead = split_blocks ? 1 : 0;
    const auto load_k = [&](int i) {
      const int stage = i % kStages;
      const uint32_t k = k_tiles + stage * Tr::kKStageBytes, k_full = bar(Tr::kBarKFull, stage);
      const int row0 = tile.kv_begin + (block_begin + i) * kN;
      sm90::mbarrier_wait(bar(Tr::kBarKEmpty, stage), ((i / kStages) & 1) ^ 1);
      sm90::mbarrier_arrive_expect_tx(k_full, Tr::kKStageBytes);
#pragma unroll
      for (int c = 0; c < Tr::kQkTiles; ++c) {
        const uint32_t dst = k + c * Tr::kKvTileBytes;
        if (c < Tr::kNopeTiles)
          sm90::tma_load_3d(dst, &params.k_nope, k_full, 64 * c, h, row0);
        else
          sm90::tma_load_2d(dst, &params.k_pe, k_full, 64 * (c - Tr::kNopeTiles), row0);
      }
    };
    int k_next = 0;  // the next block whose K is loaded
    for (int i = 0; i < num_blocks; ++i) {
      const int b = block_begin + i, stage = i % kStages;
      const uint32_t free_phase = ((i / kStages) & 1) ^ 1;
      const int row0 = tile.kv_begin + b * kN;
      const int ok_rows = kv_len - b * kN;  // >= 1
      if (lane == 0)
        for (; k_next <= i + k_ahead && k_next < num_blocks; ++k_next) load_k(k_next);
      // V lands on v_full, or, for a block reaching past the tile's last visible row (its
      // last block: at most once per CTA, so v_staged's phase is 0), on v_staged first.
      const bool whole = ok_rows >= kN;
      const uint32_t v = v_tiles + stage * Tr::kVStageBytes;
      const uint32_t v_full = bar(Tr::kBarVFull, stage), v_staged = bar(Tr::kBarVStaged, stage);
      if (lane == 0) {
        const uint32_t v_bar = whole ? v_full : v_staged;
        sm90::mbarrier_wait(bar(Tr::kBarVEmpty, stage), free_phase);
        sm90::mbarrier_arrive_expect_tx(v_bar, Tr::kVStageBytes);
#pragma unroll
        for (int c = 0; c < Tr::kVTiles; ++c)
          sm90::tma_load_3d(v + c * Tr::kKvTileBytes, &params.v, v_bar, 64 * c, h, row0);
      }
      if (!whole) {
        sm90::mbarrier_wait(v_staged, 0);
        // Rows [ok_rows, kN) of every V tile: 8 chunks of 16 bytes per row (the swizzle only
        // permutes chunks within a row).
        const int zero_chunks = Tr::kVTiles * (kN - ok_rows) * 8;
        for (int idx = lane; idx < zero_chunks; idx += 32) {
          const int chunk = idx % 8, rest = idx / 8;
          const int row = ok_rows + rest % (kN - ok_rows), c = rest / (kN - ok_rows);
          sm90::st_shared_u32x4(v + c * Tr::kKvTileBytes + row * 128 + chunk * 16,
                                make_uint4(0, 0, 0, 0));
        }
        sm90::fence_proxy_async_shared();
        __syncwarp();
        if (lane == 0) sm90::mbarrier_arrive(v_full);
      }
    }
    return;
  }

  // ---- consumers ----------------------------------------------------------------------------
  sm90::setmaxnreg_inc<Tr::kConsumerRegs>();
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const int row_base = split_blocks ? 0 : Tr::kWgRows * wg;  // this group's first row
  const int row0 = row_base + 16 * warp + g;                 // this thread's rows: row0, row0 + 8
  // Blocks this group's rows see: [block_begin, my_end); the CTA's later blocks it only
  // releases. With split blocks the group's own are every other one of those, from its index:
  // blocks first, first + step, ... (relative to block_begin).
  const int my_rows = max(0, min(tile.q_len - row_base, Tr::kWgRows));
  const int my_end =
      my_rows == 0 ? block_begin
                   : max(block_begin,
                         min(block_end, (tile.first_query_pos + row_base + my_rows + kN - 1) / kN));
  const int first = split_blocks ? wg : 0, step = split_blocks ? 2 : 1;
  const int my_blocks = max(0, my_end - block_begin - first + step - 1) / step;
  const int num_blocks = block_end - block_begin;
  const int limit[2] = {tile.first_query_pos + row0, tile.first_query_pos + row0 + 8};
  const float scale_log2 = p.sm_scale * kLog2e;

  // kMasked: the bits of one block, chunk c of row r covering positions n0 + 32 c + [0, 32),
  // shifted right by 2 q: column 4 j + e of s (position n0 + 8 j + 2 q + (e & 1)) is kept iff
  // bit 8 (j % 4) + (e & 1) of mask_bits[e >> 1][j / 4] is set. The loads need no branch: a row
  // past the tile's rows reads the tile's last row (its results are never stored), and a word
  // past the row's end reads the row's last word (kv_mask_words · 32 >= every kv length, so
  // those positions lie past each row's causal limit and the causal mask removes them).
  constexpr int kMaskChunks = (kN + 31) / 32;
  uint32_t mask_bits[2][kMaskChunks];
  const uint32_t* mask_row[2] = {nullptr, nullptr};
  if constexpr (kMasked)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      mask_row[r] =
          p.kv_mask +
          (int64_t(tile.q_begin) + max(0, min(row0 + 8 * r, tile.q_len - 1))) * p.kv_mask_words;
  const auto load_mask = [&](int b) {
    if constexpr (kMasked) {
      const int n0 = b * kN, w0 = n0 / 32, last_word = p.kv_mask_words - 1;
      const auto word = [&](int r, int w) { return __ldg(mask_row[r] + min(w, last_word)); };
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < kMaskChunks; ++c) {
          uint32_t bits = word(r, w0 + c);
          if constexpr (kN % 32 != 0) bits = __funnelshift_r(bits, word(r, w0 + c + 1), n0 % 32);
          mask_bits[r][c] = bits >> (2 * q);
        }
    }
  };

  float o[kDimV / 2];
#pragma unroll
  for (int i = 0; i < kDimV / 2; ++i) o[i] = 0.f;
  float s[kN / 2];
  float m[2] = {-INFINITY, -INFINITY};  // running max, log2 domain
  float l[2] = {0.f, 0.f};              // running sum of this thread's columns
  uint32_t a[kN / 16][4];

  const auto stage_of = [](int i) { return i % kStages; };
  const auto phase_of = [](int i) { return uint32_t((i / kStages) & 1); };
  // The two groups take turns issuing their MMAs: group w waits for its turn on
  // named barrier kTurn0 + w and passes it to the other group once its MMAs are issued, so one
  // group's softmax runs while the other's MMAs keep the tensor cores busy. Each group has
  // blocks + 1 turns when the CTA has blocks (its first S, then one per block of WG0: all of
  // them, or with split blocks its ceil(num_blocks / 2)); WG1 hands the first turn to WG0 and
  // does not pass its last, so every barrier phase completes.
  const int num_turns = num_blocks > 0 ? (split_blocks ? (num_blocks + 1) / 2 : num_blocks) + 1 : 0;
  int turn = 0;
  const auto take_turn = [&] { sm90::named_barrier_sync(Tr::kTurn0 + wg, 256); };
  const auto pass_turn = [&] {
    if (wg == 0 || turn + 1 < num_turns) sm90::named_barrier_arrive(Tr::kTurn0 + 1 - wg, 256);
    ++turn;
  };
  if (wg == 1 && num_turns > 0) sm90::named_barrier_arrive(Tr::kTurn0, 256);

  const auto issue_s = [&](int i) {
    const int stage = stage_of(i);
    sm90::fence_operands(s);
    sm90::wgmma_fence();
    issue_qk<kN, Tr::kQkTiles, Tr::kQTileBytes, Tr::kKvTileBytes>(
        s, q_tiles + row_base * 128, k_tiles + stage * Tr::kKStageBytes);
    sm90::wgmma_commit();
  };
  // Mask of block b (causal: kv position n visible to row r iff n <= limit[r]), online softmax:
  // s becomes P (fp32), m and l move on; returns alpha, the factor O must be rescaled by. m is the
  // exponent offset of O and l, not the exact running max: it moves only when a block's max
  // passes it by more than kRescaleSlack (log2 units), so P = 2^(s - m) <= 2^kRescaleSlack and
  // most blocks leave alpha = 1 and skip the O rescale; the output O / l is the same.
  const auto softmax = [&](int b, float(&alpha)[2]) {
    const int n0 = b * kN;
    const bool needs_mask = n0 + kN - 1 > tile.first_query_pos + row_base;
    // kMasked: the causal limit is folded into the bits first (bit i of chunk c of row r is
    // position n0 + 32 c + 2 q + i, kept iff <= limit[r]), so a score takes one bit test.
    if constexpr (kMasked) {
      if (needs_mask) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int c = 0; c < kMaskChunks; ++c) {
            const int d = limit[r] - (n0 + 32 * c + 2 * q);  // the last bit kept
            mask_bits[r][c] &= d >= 31 ? ~0u : d < 0 ? 0u : (2u << d) - 1u;
          }
      }
    }
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float& x = s[4 * j + e];
        if constexpr (kMasked) {
          if (((mask_bits[e >> 1][j / 4] >> (8 * (j % 4) + (e & 1))) & 1u) == 0) x = -INFINITY;
        } else if (needs_mask && n0 + 8 * j + 2 * q + (e & 1) > limit[e >> 1]) {
          x = -INFINITY;
        }
        block_max[e >> 1] = fmaxf(block_max[e >> 1], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_block = quad_max(block_max[r]) * scale_log2;
      const bool moves = m_block > m[r] + Tr::kRescaleSlack;  // false for NaN, true from -inf
      const float m_new = moves ? m_block : m[r];
      const float offset = softmax_offset(m_new);
      alpha[r] = moves ? exp2_approx(m[r] - offset) : 1.f;
      m[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * r + e];
          x = exp2_approx(fmaf(x, scale_log2, -offset));
          sum += x;
        }
      l[r] = l[r] * alpha[r] + sum;
    }
  };

  if (my_blocks > 0) {
    load_mask(block_begin + first);
    sm90::mbarrier_wait(bar_q, 0);
    sm90::mbarrier_wait(bar(Tr::kBarKFull, stage_of(first)), phase_of(first));
    take_turn();
    issue_s(first);
    pass_turn();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(s);
    sm90::mbarrier_arrive(bar(Tr::kBarKEmpty, stage_of(first)));
    float alpha[2];
    softmax(block_begin + first, alpha);
  }
  // Block i of this group: P_i (in s) to bf16, S of its next block (i + step) issued when kNext,
  // P_i·V_i, the softmax of that S while P_i·V_i runs, then the O rescale. Straight-line code per
  // kNext: a branch between a wgmma's issue and its wait makes ptxas serialize the pipeline.
  const auto block_step = [&](int i, auto has_next) {
    constexpr bool kNext = decltype(has_next)::value;
    const int next = i + step;
#pragma unroll
    for (int ks = 0; ks < kN / 16; ++ks)
#pragma unroll
      for (int e = 0; e < 4; ++e) a[ks][e] = pack_bf16x2(s[8 * ks + 2 * e], s[8 * ks + 2 * e + 1]);
    if constexpr (kNext) load_mask(block_begin + next);
    if constexpr (kNext) sm90::mbarrier_wait(bar(Tr::kBarKFull, stage_of(next)), phase_of(next));
    sm90::mbarrier_wait(bar(Tr::kBarVFull, stage_of(i)), phase_of(i));
    take_turn();
    if constexpr (kNext) issue_s(next);
    sm90::fence_operands(o);
    if constexpr (!kNext) sm90::wgmma_fence();
    issue_pv<kDimV, kN / 16, Tr::kKvTileBytes>(o, a, v_tiles + stage_of(i) * Tr::kVStageBytes);
    sm90::wgmma_commit();
    pass_turn();
    float alpha[2] = {1.f, 1.f};
    if constexpr (kNext) {
      sm90::wgmma_wait<1>();
      sm90::fence_operands(s);
      sm90::mbarrier_arrive(bar(Tr::kBarKEmpty, stage_of(next)));
      softmax(block_begin + next, alpha);
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(o);
    sm90::fence_operands(a);
    sm90::mbarrier_arrive(bar(Tr::kBarVEmpty, stage_of(i)));
    if (kNext && (alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < kDimV / 8; ++j) {
        o[4 * j + 0] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }
  };
  for (int j = 0; j + 1 < my_blocks; ++j) block_step(first + j * step, std::true_type{});
  if (my_blocks > 0) block_step(first + (my_blocks - 1) * step, std::false_type{});
  if (split_blocks) {
    // WG1 of an odd block count has one block fewer than WG0: its last turn has no MMA.
    while (turn < num_turns) {
      take_turn();
      pass_turn();
    }
    merge_split_blocks<Tr::kMerge, kDimV>(o, m, l, reinterpret_cast<float*>(smem + Tr::kK), wg,
                                          wtid);
    if (wg == 1) return;
  } else {
    // The CTA's blocks past this group's rows: released once they have landed, each in the turn
    // its block stands for (turn i + 1 for block i), with no MMA; a group with no rows first
    // takes the turn of the S it does not compute. Keeping every group's turn t on block t - 1
    // is what frees the other group: a block's release never waits for a later turn.
    if (my_blocks == 0 && num_blocks > 0) {
      take_turn();
      pass_turn();
    }
    for (int i = my_blocks; i < num_blocks; ++i) {
      sm90::mbarrier_wait(bar(Tr::kBarKFull, stage_of(i)), phase_of(i));
      sm90::mbarrier_wait(bar(Tr::kBarVFull, stage_of(i)), phase_of(i));
      take_turn();
      pass_turn();
      sm90::mbarrier_arrive(bar(Tr::kBarKEmpty, stage_of(i)));
      sm90::mbarrier_arrive(bar(Tr::kBarVEmpty, stage_of(i)));
    }
  }

  // ---- epilogue -----------------------------------------------------------------------------
  const int64_t H = p.num_heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // l >= 1 when the tile covers all of the row's blocks (every query sees its own key); a
    // split may hold none of the row's keys (l = 0: lse +inf, o 0). NaN inputs keep l NaN.
    const float sum = quad_sum(l[r]);
    const int row = row0 + 8 * r;
    if (row >= tile.q_len) continue;
    const bool no_key = sum == 0.f;
    const float inv = no_key ? 0.f : 1.f / sum;
    const float lse = no_key ? INFINITY : (m[r] + log2f(sum)) * kLn2;
    const int64_t out_row = (int64_t(tile.q_begin) + row) * H + h;
    if (p.o_parts == nullptr || tile.part == kDenseWholeTile) {
      bf16_t* out = p.o + out_row * kDimV + 2 * q;
#pragma unroll
      for (int j = 0; j < kDimV / 8; ++j)
        *reinterpret_cast<uint32_t*>(out + 8 * j) =
            pack_bf16x2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
      if (q == 0) p.lse[out_row] = lse;
    } else {
      // merge_partials skips a slot with lse +inf without reading its o: none is written.
      const int64_t slot_row = int64_t(tile.part) * p.rows + out_row;
      if (q == 0) p.lse_parts[slot_row] = lse;
      if (no_key) continue;
      float* out = p.o_parts + slot_row * kDimV + 2 * q;
#pragma unroll
      for (int j = 0; j < kDimV / 8; ++j)
        *reinterpret_cast<float2*>(out + 8 * j) =
            make_float2(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
  }
}

template <int kDimNope, int kDimRope, int kDimV>
cudaError_t run_dense_mha_sm90(const DenseMhaParams& p, cudaStream_t stream) {
  using Tr = DenseSm90Traits<kDimNope, kDimRope, kDimV>;
  if (p.num_tiles == 0 || p.num_heads == 0) return cudaSuccess;
  if (p.v_slices != 1 || p.d_v_total != kDimV || p.head_group < 1 || p.head_group > p.num_heads ||
      (p.kv_mask != nullptr && p.kv_mask_words < 1))
    return cudaErrorInvalidValue;
  const int64_t num_ctas = int64_t(p.num_tiles) * p.num_heads;
  if (num_ctas > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  DenseMhaSm90Params params{};
  params.p = p;
  const uint64_t H = uint64_t(p.num_heads), T = uint64_t(p.rows) / H, N = uint64_t(p.num_kv);
  const uint32_t q_box[3] = {64, 1, uint32_t(Tr::kBlockM)};
  const uint32_t kv_box[3] = {64, 1, uint32_t(Tr::kBlockN)};
  const uint32_t pe_box[2] = {64, uint32_t(Tr::kBlockN)};
  const auto map3 = [](CUtensorMap* map, const void* ptr, uint64_t d, uint64_t heads, uint64_t rows,
                       int64_t head_stride, int64_t row_stride, const uint32_t* box) {
    const uint64_t dims[3] = {d, heads, rows};
    const uint64_t strides[2] = {uint64_t(head_stride) * 2, uint64_t(row_stride) * 2};
    return make_tensor_map_bf16_sw128(map, ptr, 3, dims, strides, box);
  };
  cudaError_t err = map3(&params.q_nope, p.q_nope, kDimNope, H, T, kDimNope, H * kDimNope, q_box);
  if (err == cudaSuccess)
    err = map3(&params.q_pe, p.q_pe, kDimRope, H, T, kDimRope, H * kDimRope, q_box);
  if (err == cudaSuccess)
    err = map3(&params.k_nope, p.k_nope, kDimNope, H, N, p.k_head_stride, p.k_row_stride, kv_box);
  if (err == cudaSuccess)
    err = map3(&params.v, p.v, kDimV, H, N, p.v_head_stride, p.v_row_stride, kv_box);
  if (err == cudaSuccess) {
    const uint64_t dims[2] = {kDimRope, N};
    const uint64_t strides[1] = {kDimRope * 2};
    err = make_tensor_map_bf16_sw128(&params.k_pe, p.k_pe, 2, dims, strides, pe_box);
  }
  if (err != cudaSuccess) return err;
  const bool masked = p.kv_mask != nullptr;
  auto* kernel = masked ? &dense_mha_sm90_kernel<kDimNope, kDimRope, kDimV, true>
                        : &dense_mha_sm90_kernel<kDimNope, kDimRope, kDimV, false>;
  static std::atomic<uint64_t> smem_set[2] = {0, 0};  // per instance: plain, masked
  err = opt_in_dynamic_smem(reinterpret_cast<const void*>(kernel), Tr::kSmemBytes,
                            smem_set[masked ? 1 : 0]);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(unsigned(num_ctas)), Tr::kThreads, Tr::kSmemBytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda::dense_mha
