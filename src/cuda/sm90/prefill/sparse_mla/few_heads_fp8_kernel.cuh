// Sparse MLA on Hopper for few heads (work items of kN = 16 heads, or 32 on fp8-raw pools) on
// FP8 pools: the rows gathered as stored, their codes widened in the consumers' registers. Two
// layouts:
//   fp8-raw (576 B: 576 e4m3 codes, one scale for the pool);
//   656-byte (512 e4m3 codes | 4 fp32 scales, one per 128 columns | 64 bf16 rope values).
// Same contract and numerics as the other sparse kernels: the codes exactly in f16, Q scaled by a
// power of two into f16's range, P rounded to f16 (656-byte: P times the ratio of each key's tile
// scale to the group's running scale, below).
//
// Keys on the wgmma M dimension as in few_heads_kernel.cuh, but both products take A from
// registers, so the pool's codes never pass through shared memory as 16-bit values:
//   Sᵀ[m, h] = K[m, :] · Q[h, :]     A = 64 keys' codes widened to f16 (k16 steps of 576 columns),
//                                    B = Q (kN heads, K-major, columns permuted, below)
//   Oᵀ[d, h] += Vᵀ[d, m] · Pᵀ[m, h]  A = the same codes read across keys (dims on M), widened,
//                                    B = Pᵀ, [kN heads][64 keys] f16 tiles per group
// A wgmma with A in registers reads only B from shared memory, 0.5 KB a k16 step at N = 16. At
// N = 32 a block's loads and conversions serve twice the heads (FewHeadsFp8Config: its registers,
// ring and row order).
//
// 656-byte pools: the scales are per (key, 128-column tile), so
//   Sᵀ = Σ_t scale[:, t] ⊙ (codes_t · Q_tᵀ) + rope · Q_peᵀ: one f16 accumulator per tile (its
//     scale applied in fp32 once the block's Sᵀ has retired) and the rope's bf16 values as A of
//     bf16 MMAs (Q_pe in bf16, scaled by the same power of two as Q's f16 columns);
//   Oᵀ's M tiles 2t, 2t + 1 are dims of tile t only, and their B is Pᵀ_t = Pᵀ ⊙ scale[:, t] / σ_t:
//     four Pᵀ tiles a group. σ_t is the group's running power of two above every |scale| of tile
//     t it has read (those rows of O rescaled when it grows), so each Pᵀ_t stays below P's bound
//     (2^kRescaleSlack) in f16: rounded to 11 bits where P · scale / σ_t >= 2^-14, to 2^-24
//     below; O_t / σ_t is what the group accumulates (its epilogue multiplies σ_t back).
//
// One CTA of three warpgroups per two work items (a work item: a token's kN-head group; at H <= kN
// two adjacent tokens, in a causal prompt at most one block apart): consumer group i (WG0 / WG1)
// takes every block of item i with its own online softmax over all 512 dims, converts its item's
// Q (permuted) at the start and writes its output at the end: a CTA's start (Q, the first blocks'
// fill) and end are paid once per two items, and no partial results meet. WG2 (producer) copies
// each block of 64 selected rows of both items as stored by cp.async into a ring of kStages buffers
// (5 of 37 KB for fp8-raw rows, 4 of 41 KB for 656-byte ones, 4 of 36 KB for 32-head items;
// invalid rows zero-filled: codes, scales and rope 0), in PairOrder (the items' blocks
// alternating; 32-head items of one token, past 32 heads, share each block); ring index i goes to
// buffer i % kStages.
//
// Row order (16-head items). Buffer row j holds the block's slot j; M index m (the Sᵀ row, the Oᵀ
// k index, the Pᵀ column) is buffer row rho(m), rho swapping bits 0 and 2 of m. With an odd row
// stride in 16-byte chunks (37: 592 bytes; 41: 656) every shared-memory read of both products is
// conflict-free (32-head items: rho the identity, a 576-byte stride and chunk c of row j at
// c ^ ((j >> 1) & 3), FewHeadsFp8Config::chunk_of, conflict-free alike):
//   Sᵀ: lane (g, q) of warp w reads rows rho(16w + g), rho(16w + g + 8), chunk 4u + q for
//     column group u (64 codes); 656-byte rope chunks q, q + 4 of the rope (8 bf16 each);
//   Oᵀ: lane (g, q) reads rows rho(16ks + 2q + {0, 1, 8, 9}): fp8-raw one 16-byte chunk
//     c = 8w + 4(g & 1) + g / 2 of each (dims [16c, 16c + 16), all its rows of every Oᵀ tile);
//     656-byte four 4-byte words, dims [128t + 4c', + 4) with c' = (g & 3) + 16(g / 4) + 4w (a
//     word stride of 164 ≡ 4 mod 32 banks).
// Column order (Sᵀ's k): codes 64u + 16q + 4s + e of a row (e < 4) are this lane's A pairs of
// k16 step 4u + s: e = 0, 1 -> k = 2q, 2q + 1 (a[0] / a[1] by row), e = 2, 3 -> k = 2q + 8, + 9
// (a[2] / a[3]); Q's columns are stored in the same order (logical k of step 4u + s holds Q's
// column 64u + 16(k % 8 / 2) + 4s + (k / 8) * 2 + k % 2), so the dot product is unchanged. The
// 656-byte rope: words e of rope chunk q + 4h are the pairs of step 2h + e / 2 (e even: k = 2q,
// 2q + 1; odd: 2q + 8, + 9); Q_pe's tile holds, at logical k of step s, rope dim
// 8(k % 8 / 2 + 4(s / 2)) + 4(s % 2) + 2(k / 8) + k % 2.
// Dim order (Oᵀ's M): row 16w + g + 8r of Oᵀ tile mt is dim 16c + 2mt + r (fp8-raw: a lane's 16
// codes of a key are its rows of all 8 tiles) or 128(mt / 2) + 4c' + 2(mt % 2) + r (656-byte: a
// lane's word of tile t is its rows of M tiles 2t, 2t + 1).
//
// Accumulators (thread g = lane / 4, q = lane % 4 of warp w):
//   s[4j + 2r + c]      = Sᵀ[m = 16w + g + 8r][head 8j + 2q + c]       j < kN / 8, r, c in {0, 1}
//   o[mt][4j + 2r + c]  = Oᵀ[dim of (mt, r) above][head 8j + 2q + c]   mt < 8
// so a thread holds kN / 4 heads, hi = 2j + c.
//
// Shared memory (bytes):
//   Q    [2 groups][9 tiles of kN x 64 f16] 2 x 18432 | 36864  K-major, 128-byte swizzled
//                                                      (656-byte: tile 8 bf16)
//   Pᵀ   [2 groups][1 | 4][kN x 64 f16]   the same
//   ring [kStages][64 rows][row stride]  rows as stored
//   mbarriers full / empty [kStages], q_full [2]; the groups' per-warp head maxima / sums and
//   scale maxima; per group Q's power-of-two shift and its warps' |Q| maxima; 32-head items the
//   groups' running maxima per head (FewHeadsSoftmax::kMaxInSmem).
#pragma once

#include "src/cuda/sm90/prefill/sparse_mla/few_heads_softmax.cuh"
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {

template <KvLayout kLayout, int kN = 16>
struct FewHeadsFp8Config {
  static_assert(kLayout == KvLayout::kFp8Raw || kLayout == KvLayout::kFp8Scaled);
  static constexpr bool kScaled = kLayout == KvLayout::kFp8Scaled;  // the 656-byte layout
  static_assert(kN == 16 || (kN == 32 && !kScaled), "32-head items: fp8-raw pools only");
  using Softmax = FewHeadsSoftmax<kN>;
  using Row = PoolRow<kLayout>;
  static constexpr int kHeads = kN;    // heads a work item (wgmma N)
  static constexpr int kAcc = kN / 2;  // accumulators a thread holds per M tile
  static constexpr int kBlock = 64;    // rows per block (wgmma M of Sᵀ, K of Oᵀ)
  // The row order (above): 32-head items keep the rows at their stored 576 bytes with swizzled
  // chunks (two Q buffers of 36 KB leave room for four such buffers, not four of 592 bytes).
  static constexpr bool kSwizzled = kN == 32;
  // 32-head items: one buffer (not two) of the raw codes a consumer loads ahead of their widening
  // in each product, for the registers Oᵀ takes.
  static constexpr bool kLean = kN == 32;
  // 32-head items: a token's two items in one CTA (H > 32) share the ring's rows (PairOrder).
  static constexpr bool kShareRows = kN == 32;
  static constexpr int kStages = kScaled || kSwizzled ? 4 : 5;  // as many buffers as fit
  static constexpr int kRowChunks = Row::kBytes / 16;           // 36 | 41 chunks of 16 bytes a row
  // An odd number of chunks (see the row order): 592 | 656; swizzled 576.
  static constexpr int kRowStride = kScaled || kSwizzled ? Row::kBytes : Row::kBytes + 16;
  static constexpr int kStageBytes = kBlock * kRowStride;
  static constexpr int kGroups = kDimQk / 64;          // 9 column groups of 64 values (4 k16 steps)
  static constexpr int kCodeGroups = kScaled ? 8 : 9;  // those read as e4m3 codes
  static constexpr int kTileBytes = kHeads * 128;      // [kN][64] 16-bit
  static constexpr int kPtTiles = kScaled ? 4 : 1;     // Pᵀ tiles a group (one per scale tile)
  static_assert((kSwizzled ? kRowStride / 16 % 8 == 4 : kRowStride / 16 % 2 == 1) &&
                kRowStride >= Row::kBytes);

  static constexpr int kQBytes = kGroups * kTileBytes;  // one group's Q
  static constexpr int kQ = 0;                          // [2 groups]
  static constexpr int kPt = kQ + 2 * kQBytes;
  static constexpr int kRing = kPt + 2 * kPtTiles * kTileBytes;
  static constexpr int kBars = kRing + kStages * kStageBytes;
  static constexpr int kBarFull = kBars;                           // + 8 * stage
  static constexpr int kBarEmpty = kBars + 8 * kStages;            // + 8 * stage
  static constexpr int kBarQ = kBars + 16 * kStages;               // + 8 * group
  static constexpr int kWarpHeads = kBarQ + 16;                    // f32 [2][4][kN]
  static constexpr int kWarpScales = kWarpHeads + 4 * 2 * 4 * kN;  // f32 [2][4 warps][4 tiles]
  static constexpr int kQShift = kWarpScales + 4 * 2 * 4 * 4;      // i32 [2]
  static constexpr int kQAmax = kQShift + 16;                      // u32 [2][4]
  static constexpr int kTrueMax = kQAmax + 32;                     // f32 [2][kN] (kMaxInSmem)
  static constexpr int kSmemBytes = kTrueMax + 4 * 2 * kN;
  static_assert(kSmemBytes <= 227 * 1024, "exceeds sm_90 shared memory per block");
  static_assert(kPt % 1024 == 0 && kRing % 16 == 0 && kBars % 8 == 0);
  // Named barriers of group b's 128 threads: its head maxima and sums (1 + b), its Pᵀ (3 + b),
  // its |Q| maximum (5 + b, q_f16_shift).
  static constexpr int kSyncHeads = 1, kSyncPt = 3, kSyncQ = 5;
  // setmaxnreg's split: 32-head items hold Oᵀ in 128 registers a consumer thread.
  static constexpr int kConsumerRegs = kN == 32 ? 224 : Sm90Warps::kConsumerRegs;
  static constexpr int kProducerRegs = kN == 32 ? 56 : Sm90Warps::kProducerRegs;

  // Buffer row of M index m: bits 0 and 2 swapped (odd strides), m itself (swizzled).
  __device__ static int row_of(int m) {
    return kSwizzled ? m : (m & ~5) | ((m & 1) << 2) | ((m >> 2) & 1);
  }
  // Where chunk c of buffer row j sits in the row: c ^ ((j >> 1) & 3) swizzled, else c.
  __device__ static int chunk_of(int j, int c) { return kSwizzled ? c ^ ((j >> 1) & 3) : c; }
};

// The ring's order of a CTA's two work items' blocks (item i has n[i] blocks of 64 slots):
// alternating, item 0's block b at ring index 2b and item 1's at 2b + 1, while both have blocks;
// then the longer item's in order. Consumer group i takes item i's blocks. Shared rows (`shared`,
// set by pair_work<kHeads, true> only: the two items are one token's head groups): block b at ring
// index b for both groups (shared_index / shared_at), each buffer released by both.
struct PairOrder {
  int n[2];
  bool shared = false;
  __device__ __forceinline__ int both() const { return min(n[0], n[1]); }
  __device__ __forceinline__ int total() const { return n[0] + n[1]; }
  // Ring index of item `item`'s block b.
  __device__ __forceinline__ int index(int item, int b) const {
    return b < both() ? 2 * b + item : both() + b;
  }
  // The item and block at ring index i < total().
  __device__ __forceinline__ void at(int i, int& item, int& b) const {
    const int m = both();
    item = i < 2 * m ? i & 1 : (n[0] > n[1] ? 0 : 1);
    b = i < 2 * m ? i >> 1 : i - m;
  }
  // The same with shared rows where kShareRows (then a ring of n[0] blocks where `shared`).
  template <bool kShareRows>
  __device__ __forceinline__ int shared_total() const {
    return kShareRows && shared ? n[0] : total();
  }
  template <bool kShareRows>
  __device__ __forceinline__ int shared_index(int item, int b) const {
    return kShareRows && shared ? b : index(item, b);
  }
  template <bool kShareRows>
  __device__ __forceinline__ void shared_at(int i, int& item, int& b) const {
    if (kShareRows && shared) {
      item = 0, b = i;
    } else {
      at(i, item, b);
    }
  }
};

// Work items of kHeads heads (num_tokens · ceil(H / kHeads), cta_work's order) in pairs: CTA c
// takes items 2c and 2c + 1 (the second past the last item: none, 0 blocks).
struct PairWork {
  CtaWork item[2];
  bool has_second;
  PairOrder order;
  // Item g and its block count (g is 0 or 1, known at run time: selects, so
  // the arrays are not indexed and stay in registers).
  __device__ __forceinline__ const CtaWork& item_of(int g) const {
    return g == 0 ? item[0] : item[1];
  }
  __device__ __forceinline__ int blocks_of(int g) const { return g == 0 ? order.n[0] : order.n[1]; }
};
// kShareRows: two items of one token (H > kHeads) share the ring's rows (PairOrder::shared).
template <int kHeads, bool kShareRows = false>
__device__ __forceinline__ PairWork pair_work(const SparseMlaParams& p) {
  const unsigned num_items = unsigned(p.num_tokens) * unsigned((p.num_heads + kHeads - 1) / kHeads);
  PairWork w;
  w.has_second = 2 * blockIdx.x + 1 < num_items;
  w.item[0] = cta_work(p, kHeads, 2 * blockIdx.x);
  w.item[1] = cta_work(p, kHeads, w.has_second ? 2 * blockIdx.x + 1 : 2 * blockIdx.x);
  if (!w.has_second) w.item[1].num_slots = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) w.order.n[i] = w.item[i].num_blocks();
  if constexpr (kShareRows) w.order.shared = w.has_second && w.item[0].t == w.item[1].t;
  return w;
}

// Q of heads [head0, head0 + kN) as the Sᵀ B operand, scaled by 2^-shift (load_q_f16's rule: the
// largest finite |q| of the item lands in [2^14, 2^15)), columns in the permuted order: f16, but
// the 656-byte layout's rope tile bf16. Thread wtid of a consumer group's 128 takes heads
// wtid / 8 + 16 i (i < kN / 16) and values [8 (wtid % 8), + 8) of every column group; `sync` is the
// group's named barrier for the maximum. Writes shift to *q_shift and arrives on bar_q.
template <KvLayout kLayout, int kN>
__device__ __forceinline__ void load_q_permuted(const SparseMlaParams& p, int64_t t, int head0,
                                                uint32_t q_tiles, uint32_t* amax_scratch,
                                                int* q_shift, uint32_t bar_q, int sync, int wtid) {
  using F = FewHeadsFp8Config<kLayout, kN>;
  constexpr int kHeadSets = kN / 16;
  const int c8 = wtid % 8;
  bool ok[kHeadSets];
  const bf16_t* latent[kHeadSets];
  const bf16_t* rope[kHeadSets];
#pragma unroll
  for (int i = 0; i < kHeadSets; ++i) {
    const int head = head0 + wtid / 8 + 16 * i;
    ok[i] = head < p.num_heads;
    const int64_t hh = ok[i] ? head : 0;
    latent[i] = p.q_abs + t * p.q_abs_token_stride + hh * p.q_abs_head_stride + 8 * c8;
    rope[i] = p.q_pe + t * p.q_pe_token_stride + hh * p.q_pe_head_stride + 8 * c8;
  }
  // Values [8 c8, + 8) of column group u of head set i's head (read twice: for the maximum, then
  // to convert; the second read hits L1).
  const auto load = [&](int i, int u) {
    return ok[i] ? __ldg(reinterpret_cast<const uint4*>(u < F::kGroups - 1 ? latent[i] + 64 * u
                                                                           : rope[i]))
                 : make_uint4(0, 0, 0, 0);
  };
  uint32_t m2 = 0;
#pragma unroll
  for (int i = 0; i < kHeadSets; ++i)
#pragma unroll
    for (int u = 0; u < F::kGroups; ++u) fold_finite_max_bf16(m2, load(i, u));
  const int shift = q_f16_shift(m2, amax_scratch, q_shift, wtid, sync);
  const float down = __int_as_float((127 - shift) << 23);  // 2^-shift
#pragma unroll
  for (int hs = 0; hs < kHeadSets; ++hs)
#pragma unroll
    for (int u = 0; u < F::kGroups; ++u) {
      const int h = wtid / 8 + 16 * hs;  // the head's row of the tiles
      const uint4 v = load(hs, u);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
      const bool bf16_rope = F::kScaled && u == F::kGroups - 1;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t w = words[i];
        const float lo = __uint_as_float(w << 16) * down,
                    hi = __uint_as_float(w & 0xffff0000u) * down;
        // Codes: values 8 c8 + 2i, + 1 of a group are (q, s, e) = (c8 / 2, 2 (c8 % 2) + i / 2,
        // 2 (i % 2)): logical k = 16 s + 2q + 8 (i % 2). The 656-byte rope: chunk c8 = q + 4h, word
        // e = i: k = 16 (2h + i / 2) + 2q + 8 (i % 2).
        const int k = bf16_rope ? 16 * (2 * (c8 / 4) + i / 2) + 2 * (c8 % 4) + 8 * (i % 2)
                                : 16 * (2 * (c8 % 2) + i / 2) + 2 * (c8 / 2) + 8 * (i % 2);
        const uint32_t pair = bf16_rope ? pack_bf16x2(lo, hi) : pack_f16x2(lo, hi);
        asm volatile(
            "st.shared.u32 [%0], %1;\n" ::"r"(q_tiles + u * F::kTileBytes +
                                              sm90::swizzled_chunk(h, k / 8) + 2 * (k % 8)),
            "r"(pair)
            : "memory");
      }
    }
  sm90::fence_proxy_async_shared();
  sm90::mbarrier_arrive(bar_q);
}

// The pool index stored at slot `slot` of the token, unchecked (-1 past num_slots): a load whose
// value is first needed blocks later (checked_location then).
__device__ __forceinline__ int32_t slot_value(const CtaWork& work, int slot) {
  return slot < work.num_slots ? __ldg(work.slots + slot) : -1;
}
// A slot_value as the location it reads, negative where it reads nothing (negative or past the
// pool). The empty asm keeps the check here, at the value's use, instead of beside its load.
__device__ __forceinline__ int32_t checked_location(const SparseMlaParams& p, int32_t value) {
  asm volatile("" : "+r"(value));
  return value < p.num_locations ? value : -1;
}

// The producer warpgroup: every block's 64 rows of both items as stored into the ring, in
// PairOrder, from the CTA's start (each item's Q is its group's). Warp w copies rows
// [16w, 16w + 16), kRowChunks chunks of 16 bytes each: chunk f = 32 k + lane of its 16 rows at
// step k, so a warp's copies of one step are consecutive chunks of one or two rows (a few
// 128-byte lines, not one line per lane); lane r < 16 holds row 16w + r's location, loaded
// kSlotsAhead ring indices before its block's copies (the load's latency behind theirs).
template <KvLayout kLayout, int kN>
__device__ __forceinline__ void produce_raw_blocks(const SparseMlaParams& p, char* smem,
                                                   const PairWork& work, int wtid) {
  using F = FewHeadsFp8Config<kLayout, kN>;
  constexpr int kChunks = 16 * F::kRowChunks;  // a warp's chunks of one block
  constexpr int kSlotsAhead = 3;
  const int num_blocks = work.order.template shared_total<F::kShareRows>();
  if (num_blocks == 0) return;
  const uint32_t base = smem_addr(smem);
  const int warp = wtid / 32, lane = wtid % 32;
  // The slot value of this lane's row of the block at ring index i (-1 past the last).
  const auto row_slot = [&](int i) {
    if (i >= num_blocks) return -1;
    int item, b;
    work.order.template shared_at<F::kShareRows>(i, item, b);
    const int slot = b * F::kBlock + 16 * warp + lane % 16;
    // Two field selects, not item_of: a select of the whole item compiles to a longer loop here.
    const int num_slots = item == 0 ? work.item[0].num_slots : work.item[1].num_slots;
    const int32_t* slots = item == 0 ? work.item[0].slots : work.item[1].slots;
    return slot < num_slots ? __ldg(slots + slot) : -1;
  };
  int32_t ahead[kSlotsAhead];  // ahead[a]: this lane's row of ring index i + a
#pragma unroll
  for (int a = 0; a < kSlotsAhead; ++a) ahead[a] = row_slot(a);
#pragma unroll 1
  for (int i = 0; i < num_blocks; ++i) {
    const int stage = i % F::kStages;
    const int32_t loc = checked_location(p, ahead[0]);
#pragma unroll
    for (int a = 0; a + 1 < kSlotsAhead; ++a) ahead[a] = ahead[a + 1];
    ahead[kSlotsAhead - 1] = row_slot(i + kSlotsAhead);
    sm90::mbarrier_wait(base + F::kBarEmpty + 8 * stage, ((i / F::kStages) & 1) ^ 1);
    const uint32_t rows = base + F::kRing + stage * F::kStageBytes + 16 * warp * F::kRowStride;
    // kLean (a producer of 56 registers): the lane's chunk offsets derived in every block, not
    // held across the loop.
    int my_lane = lane;
    if constexpr (F::kLean) asm volatile("" : "+r"(my_lane));
#pragma unroll
    for (int k = 0; k < (kChunks + 31) / 32; ++k) {
      const int f = 32 * k + my_lane, r = f / F::kRowChunks, c = f - r * F::kRowChunks;
      const int32_t row_loc = __shfl_sync(0xffffffffu, loc, r % 16);
      if (kChunks % 32 == 0 || f < kChunks)
        cp_async_16(rows + r * F::kRowStride + 16 * F::chunk_of(r, c),
                    pool_row<kLayout>(p, row_loc) + 16 * c, row_loc >= 0);
    }
    sm90::cp_async_mbarrier_arrive(base + F::kBarFull + 8 * stage);
  }
  cp_async_wait<0>();
}

// The 656-byte layout's running scale of a tile, a power of two as f32 bits: the smallest above |x|
// (x finite), at least 2^-126 and at most 2^126 (so 1 / sigma is a normal float; a scale of up
// to FLT_MAX then makes a ratio below 4, P's f16 bound times 4).
__device__ __forceinline__ uint32_t pow2_above_bits(float x) {
  const uint32_t e = (__float_as_uint(x) >> 23) & 0xffu;
  return min(e + 1u, 253u) << 23;
}
// 1 / x for x = pow2_above_bits(...) (exact).
__device__ __forceinline__ float pow2_inverse(uint32_t bits) {
  return __uint_as_float((254u << 23) - bits);
}

// The keys-on-M kernels' start: thread 0 initializes a ring's kStages full / empty mbarriers
// (bar_full / bar_empty + 8 · stage) and kQBars for Q (bar_q + 8 · i), 128 arrivals each (the
// empty ones 256 where both consumer groups read every buffer: kShareRows and shared_rows());
// then the producer (warpgroup 2) lowers its registers to kProducerRegs, runs produce() and gets
// false, and the consumers raise theirs to kConsumerRegs and get true. Each derives the CTA's work
// after the reallocation (a value held across it is spilled).
template <int kStages, int kQBars, int kConsumerRegs = Sm90Warps::kConsumerRegs,
          int kProducerRegs = Sm90Warps::kProducerRegs, bool kShareRows = false, typename Produce,
          typename SharedRows>
__device__ __forceinline__ bool start_keys_on_m_cta(uint32_t bar_full, uint32_t bar_empty,
                                                    uint32_t bar_q, int& wg, int& wtid,
                                                    Produce&& produce, SharedRows&& shared_rows) {
  if (threadIdx.x == 0) {
    const uint32_t releases = kShareRows && shared_rows() ? 256 : 128;
    for (int s = 0; s < kStages; ++s) {
      sm90::mbarrier_init(bar_full + 8 * s, 128);
      sm90::mbarrier_init(bar_empty + 8 * s, releases);
    }
    for (int i = 0; i < kQBars; ++i) sm90::mbarrier_init(bar_q + 8 * i, 128);
    sm90::fence_barrier_init();
  }
  __syncthreads();
  wg = __shfl_sync(0xffffffffu, int(threadIdx.x / 128), 0);
  wtid = threadIdx.x % 128;
  static_assert(2 * 128 * kConsumerRegs + 128 * kProducerRegs <=
                Sm90Warps::kLaunchRegs * Sm90Warps::kThreads);
  if (wg == 2) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    produce();
    return false;
  }
  sm90::setmaxnreg_inc<kConsumerRegs>();
  return true;
}

template <KvLayout kLayout, int kN>
__global__ void __launch_bounds__(Sm90Warps::kThreads, 1)
    sparse_mla_sm90_few_heads_fp8_kernel(const __grid_constant__ SparseMlaParams p) {
  using F = FewHeadsFp8Config<kLayout, kN>;
  constexpr int kAcc = F::kAcc;
  constexpr sm90::Ab kAb = sm90::Ab::kF16;
  extern __shared__ __align__(1024) char smem[];
  const uint32_t base = smem_addr(smem);
  int wg, wtid;
  constexpr bool kShare = F::kShareRows;
  if (!start_keys_on_m_cta<F::kStages, 2, F::kConsumerRegs, F::kProducerRegs, kShare>(
          base + F::kBarFull, base + F::kBarEmpty, base + F::kBarQ, wg, wtid,
          [&] {
            const PairWork work = pair_work<kN, kShare>(p);
            produce_raw_blocks<kLayout, kN>(p, smem, work, wtid);
          },
          [&] { return pair_work<kN, kShare>(p).order.shared; }))
    return;
  const PairWork pair = pair_work<kN, kShare>(p);
  if (wg == 1 && !pair.has_second) return;

  // ---- consumers: group wg takes every block of item wg ---------------------------------------
  const CtaWork work = pair.item_of(wg);
  const int my_blocks = pair.blocks_of(wg);
  const int warp = wtid / 32, lane = wtid % 32, g = lane / 4, q = lane % 4;
  const uint32_t q_tiles = base + F::kQ + wg * F::kQBytes;
  const uint32_t pt_tiles = base + F::kPt + wg * F::kPtTiles * F::kTileBytes;
  float* warp_heads = reinterpret_cast<float*>(smem + F::kWarpHeads) + wg * 4 * kN;
  float* warp_scales = reinterpret_cast<float*>(smem + F::kWarpScales) + wg * 16;
  int* q_shift = reinterpret_cast<int*>(smem + F::kQShift) + wg;
  // fp8-raw: every stored value is code · k_scale, so k_scale multiplies S and O. 656-byte: the
  // tile scales enter Sᵀ per tile and Pᵀ per tile; O's tile t is kept in units of sigma[t] (bits).
  uint32_t sigma[4] = {1u << 23, 1u << 23, 1u << 23, 1u << 23};  // 2^-126: no scale read yet
  float scale_log2 = p.sm_scale * (F::kScaled ? 1.f : p.k_scale) * kLog2e;  // · 2^shift below
  // Sᵀ: this thread's rows (M indices 16w + g + 8r) in the buffer, and their chunk 4u + q (at
  // 4u + chunk_of(row, q): (row >> 1) & 3 is g / 2 for both rows).
  const int m_own[2] = {16 * warp + g, 16 * warp + g + 8};
  const uint32_t s_row[2] = {uint32_t(F::row_of(m_own[0]) * F::kRowStride),
                             uint32_t(F::row_of(m_own[1]) * F::kRowStride)};
  const uint32_t s_chunk = 16 * F::chunk_of(m_own[0], q);
  // Oᵀ: keys 2q, 2q + 1, 2q + 8, 2q + 9 of a k16 step, at this thread's dims (swizzled: the
  // chunk at chunk_of(row, dim_chunk), (row >> 1) & 3 being q for all four rows of every step).
  const int dim_chunk = 8 * warp + 4 * (g & 1) + g / 2;    // fp8-raw: dims [16 c, + 16)
  const int dim_word = (g & 3) + 16 * (g / 4) + 4 * warp;  // 656-byte: dims 128 t + [4 c', + 4)
  uint32_t v_off[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = F::row_of(2 * q + (i & 1) + 8 * (i >> 1));
    v_off[i] = uint32_t(row * F::kRowStride) +
               (F::kScaled ? 4 * dim_word : 16 * F::chunk_of(row, dim_chunk));
  }
  const uint64_t dq = sm90::smem_desc_sw128(q_tiles, 16, 1024);
  const uint64_t dp = sm90::smem_desc_sw128(pt_tiles, 16, 1024);

  float o[8][kAcc] = {};
  float s[kAcc];
  float row_scale[2][4];  // 656-byte: this thread's two Sᵀ rows' tile scales
  float* true_max = reinterpret_cast<float*>(smem + F::kTrueMax) + wg * kN;
  const bool max_owner = warp == 0 && g == 0;  // writes lse (write_heads)
  typename F::Softmax softmax;
  if constexpr (F::Softmax::kMaxInSmem) F::Softmax::init_true_max(true_max, max_owner, q);

  // Column group u of K as A fragments of its four k16 steps, from the raw 16-byte chunks of the
  // thread's two rows (codes 64u + 16q + [0, 16)).
  const auto widen_codes = [](const uint4(&raw)[2], uint32_t(&a)[4][4]) {
    const uint32_t w[2][4] = {{raw[0].x, raw[0].y, raw[0].z, raw[0].w},
                              {raw[1].x, raw[1].y, raw[1].z, raw[1].w}};
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      e4m3x4_to_f16x2x2(w[0][st], a[st][0], a[st][2]);
      e4m3x4_to_f16x2x2(w[1][st], a[st][1], a[st][3]);
    }
  };

  // Sᵀ = K · Qᵀ of the block in `buffer`, retired on return: column group u's codes loaded one
  // group ahead, widened into A fragment set u % 2 once the MMAs of group u - 2 have retired (a
  // set stays allocated until the wait that retires its MMAs: fence_operands). 656-byte: tile t's
  // two groups into acc[t], the rope (bf16, loaded as A) into s, and s += Σ_t scale_t · acc[t].
  const auto compute_s = [&](uint32_t buffer) {
    uint32_t as[2][4][4];
    uint4 raw[2][2];
    float acc[F::kScaled ? 4 : 1][kAcc];
#pragma unroll
    for (int r = 0; r < 2; ++r) raw[0][r] = sm90::ld_shared_u32x4(buffer + s_row[r] + s_chunk);
    const auto load_raw = [&](int u) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        raw[F::kLean ? 0 : u % 2][r] = sm90::ld_shared_u32x4(buffer + s_row[r] + s_chunk + 64 * u);
    };
#pragma unroll
    for (int u = 0; u < F::kGroups; ++u) {
      if (!F::kLean && u + 1 < F::kCodeGroups) load_raw(u + 1);
      uint32_t(&a)[4][4] = as[u % 2];
      if (u >= 2) {
        sm90::wgmma_wait<1>();
        sm90::fence_operands(a);
      }
      if (u < F::kCodeGroups) {
        widen_codes(raw[F::kLean ? 0 : u % 2], a);
        if (F::kLean && u + 1 < F::kCodeGroups) load_raw(u + 1);
      } else {
        // The 656-byte rope: word e of chunk q + 4h of row r is the pair of step 2h + e / 2 (a[r]
        // for even e, a[r + 2] for odd).
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint4 c =
                sm90::ld_shared_u32x4(buffer + s_row[r] + F::Row::kRopeOffset + 16 * (q + 4 * h));
            a[2 * h][r] = c.x;
            a[2 * h][r + 2] = c.y;
            a[2 * h + 1][r] = c.z;
            a[2 * h + 1][r + 2] = c.w;
          }
      }
      sm90::wgmma_fence();
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        const uint64_t b = dq + uint64_t((u * F::kTileBytes + 32 * st) >> 4);
        if constexpr (!F::kScaled)
          sm90::wgmma_m64nNk16_rs<kN, kAb>(s, a[st], b, u > 0 || st > 0);
        else if (u < F::kCodeGroups)
          sm90::wgmma_m64nNk16_rs<kN, kAb>(acc[u / 2], a[st], b, u % 2 > 0 || st > 0);
        else
          sm90::wgmma_m64nNk16_rs<kN, sm90::Ab::kBf16>(s, a[st], b, st > 0);
      }
      sm90::wgmma_commit();
    }
    sm90::wgmma_wait<0>();
    sm90::fence_operands(s);
    sm90::fence_operands(as[0]);
    sm90::fence_operands(as[1]);
    if constexpr (F::kScaled) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        sm90::fence_operands(acc[t]);
#pragma unroll
        for (int i = 0; i < kAcc; ++i) s[i] = fmaf(acc[t][i], row_scale[i / 2 % 2][t], s[i]);
      }
    }
  };

  // Oᵀ += Vᵀ · Pᵀ of the block in `buffer`, retired on return: per k16 step the four keys' codes
  // of this thread's dims (loaded a step ahead), tiles 0-3 then 4-7 each widened into a set once
  // the MMAs two batches back have retired. Releases the buffer once its last reads are issued.
  // (Retiring Oᵀ only in the next block's Sᵀ makes ptxas serialize every wgmma of the kernel.)
  const auto compute_o = [&](uint32_t buffer, uint32_t empty_bar) {
    uint32_t ao[2][4][4];
    // words[ks % 2][i][x]: key i's codes of dims 4x + [0, 4) of this thread's 16 at step ks
    // (fp8-raw: one chunk; 656-byte: the word of tile x).
    uint32_t words[2][4][4];
    const auto load_words = [&](int ks, uint32_t(&w)[4][4]) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t at = buffer + 16 * ks * F::kRowStride + v_off[i];
        if constexpr (F::kScaled) {
#pragma unroll
          for (int x = 0; x < 4; ++x)
            asm volatile("ld.shared.u32 %0, [%1];\n"
                         : "=r"(w[i][x])
                         : "r"(at + 128 * x)
                         : "memory");
        } else {
          const uint4 v = sm90::ld_shared_u32x4(at);
          w[i][0] = v.x, w[i][1] = v.y, w[i][2] = v.z, w[i][3] = v.w;
        }
      }
    };
    load_words(0, words[0]);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (F::kLean && ks > 0) load_words(ks, words[0]);
      if (!F::kLean && ks + 1 < 4) load_words(ks + 1, words[(ks + 1) % 2]);
      if (ks == (F::kLean ? 3 : 2)) sm90::mbarrier_arrive(empty_bar);
      const uint32_t(&w)[4][4] = words[F::kLean ? 0 : ks % 2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int batch = 2 * ks + half;
        uint32_t(&a)[4][4] = ao[batch % 2];
        if (batch >= 2) {
          sm90::wgmma_wait<1>();
          sm90::fence_operands(a);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int mt = 4 * half + i, word = mt / 2;
          const uint32_t sel = mt % 2 == 0 ? 0x5140u : 0x7362u;  // bytes 0, 1 or 2, 3 paired
          e4m3x4_to_f16x2x2(__byte_perm(w[0][word], w[1][word], sel), a[i][0], a[i][1]);
          e4m3x4_to_f16x2x2(__byte_perm(w[2][word], w[3][word], sel), a[i][2], a[i][3]);
        }
        sm90::wgmma_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int mt = 4 * half + i;
          const int pt = F::kScaled ? mt / 2 : 0;  // tile t's Pᵀ for M tiles 2t, 2t + 1
          sm90::wgmma_m64nNk16_rs<kN, kAb>(o[mt], a[i],
                                           dp + uint64_t((pt * F::kTileBytes + 32 * ks) >> 4), 1);
        }
        sm90::wgmma_commit();
      }
    }
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    sm90::fence_operands(ao[0]);
    sm90::fence_operands(ao[1]);
  };

  if (my_blocks > 0) {  // while the producer fills the ring
    load_q_permuted<kLayout, kN>(p, work.t, work.head0, q_tiles,
                                 reinterpret_cast<uint32_t*>(smem + F::kQAmax) + 4 * wg, q_shift,
                                 base + F::kBarQ + 8 * wg, F::kSyncQ + wg, wtid);
    sm90::mbarrier_wait(base + F::kBarQ + 8 * wg, 0);
    scale_log2 *= __int_as_float((127 + *q_shift) << 23);
  }
  // The slot values of this thread's two Sᵀ rows of block blk (whether they read a row): loaded
  // a block ahead (next), checked as their block starts.
  const auto row_slots = [&](int blk, int32_t(&v)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) v[r] = slot_value(work, blk * F::kBlock + F::row_of(m_own[r]));
  };
  int32_t next[2] = {-1, -1};
  if (my_blocks > 0) row_slots(0, next);

#pragma unroll 1
  for (int blk = 0; blk < my_blocks; ++blk) {
    const int i = pair.order.template shared_index<kShare>(wg, blk);  // its ring index
    const int stage = i % F::kStages;
    const uint32_t buffer = base + F::kRing + stage * F::kStageBytes;
    bool ok[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) ok[r] = checked_location(p, next[r]) >= 0;
    if (blk + 1 < my_blocks) row_slots(blk + 1, next);
    sm90::mbarrier_wait(base + F::kBarFull + 8 * stage, (i / F::kStages) & 1);
    // 656-byte: per tile, the largest finite |scale| of this thread's two rows.
    float scale_max[4] = {0.f, 0.f, 0.f, 0.f};
    if constexpr (F::kScaled)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint4 v = sm90::ld_shared_u32x4(buffer + s_row[r] + F::Row::kScalesOffset);
        const uint32_t bits[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          row_scale[r][t] = __uint_as_float(bits[t]);
          const float a = fabsf(row_scale[r][t]);
          scale_max[t] = a < INFINITY ? fmaxf(scale_max[t], a) : scale_max[t];  // not NaN, inf
        }
      }
    sm90::fence_operands(s);
    compute_s(buffer);

    softmax.publish_max(s, ok, warp_heads, warp, g, q);
    if constexpr (F::kScaled) {
      // The group's largest |scale| of each tile in the block: the thread's rows, lanes of other
      // rows (g), then the warps (through the softmax's barrier).
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int x = 4; x < 32; x *= 2)
          scale_max[t] = fmaxf(scale_max[t], __shfl_xor_sync(0xffffffffu, scale_max[t], x));
      if (lane == 0)
#pragma unroll
        for (int t = 0; t < 4; ++t) warp_scales[4 * warp + t] = scale_max[t];
    }
    sm90::named_barrier_sync(F::kSyncHeads + wg, 128);
    softmax.finish_block(s, o, warp_heads, scale_log2, q, true_max, max_owner);
    if constexpr (F::kScaled)
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        float block_max = warp_scales[t];
#pragma unroll
        for (int w = 1; w < 4; ++w) block_max = fmaxf(block_max, warp_scales[4 * w + t]);
        const uint32_t sigma_new = max(sigma[t], pow2_above_bits(block_max));
        if (sigma_new != sigma[t]) {  // uniform over the group
          const float down = __uint_as_float(sigma[t]) * pow2_inverse(sigma_new);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            o[2 * t][i] *= down;
            o[2 * t + 1][i] *= down;
          }
          sigma[t] = sigma_new;
        }
      }

    // ---- Pᵀ to shared memory: matrix mi = 2 j + r is M indices 16 w + 8 r .., heads 8 j .. --
    // 656-byte: tile t's Pᵀ times each key's scale_t / sigma[t].
    {
      const int mi = lane / 8, j = mi / 2, r = mi % 2;
      const uint32_t at = pt_tiles + sm90::swizzled_chunk(8 * j + lane % 8, 2 * warp + r);
      if constexpr (F::kScaled) {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const float inv = pow2_inverse(sigma[t]);
          const float r0 = row_scale[0][t] * inv, r1 = row_scale[1][t] * inv;
          sm90::stmatrix_x4_trans(at + t * F::kTileBytes, pack_f16x2(s[0] * r0, s[1] * r0),
                                  pack_f16x2(s[2] * r1, s[3] * r1),
                                  pack_f16x2(s[4] * r0, s[5] * r0),
                                  pack_f16x2(s[6] * r1, s[7] * r1));
        }
      } else {
        // Heads [16 i, + 16) from s[8 i, + 8) (j = 2 i + mi / 2).
#pragma unroll
        for (int i = 0; i < kN / 16; ++i)
          sm90::stmatrix_x4_trans(at + 16 * i * 128, pack_f16x2(s[8 * i], s[8 * i + 1]),
                                  pack_f16x2(s[8 * i + 2], s[8 * i + 3]),
                                  pack_f16x2(s[8 * i + 4], s[8 * i + 5]),
                                  pack_f16x2(s[8 * i + 6], s[8 * i + 7]));
      }
    }
    sm90::fence_proxy_async_shared();
    sm90::named_barrier_sync(F::kSyncPt + wg, 128);

    // ---- Oᵀ += Vᵀ · Pᵀ ----------------------------------------------------------------------
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) sm90::fence_operands(o[mt]);
    compute_o(buffer, base + F::kBarEmpty + 8 * stage);
  }

  // ---- epilogue: normalize, write ------------------------------------------------------------
  constexpr int kHi = F::Softmax::kHi;
  float total[kHi], factor[kHi], offset[kHi], maxima[kHi];
  if constexpr (F::kScaled)
#pragma unroll
    for (int mt = 0; mt < 8; ++mt)
#pragma unroll
      for (int i = 0; i < kAcc; ++i) o[mt][i] *= __uint_as_float(sigma[mt / 2]);
  const float value_scale = F::kScaled ? 1.f : p.k_scale;
  softmax.finish_alone(warp_heads, warp, g, q, F::kSyncHeads + wg, value_scale, total, factor,
                       offset, maxima, true_max);
  write_heads(p, work, warp, g, q, total, offset, maxima, [&](int hi, int64_t th) {
    // packed[mt]: the dims of (mt, r = 0, 1), value accumulator 4 (hi / 2) + 2 r + hi % 2 of mt.
    uint32_t packed[8];
#pragma unroll
    for (int mt = 0; mt < 8; ++mt) {
      float x[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 4 * (hi / 2) + 2 * r + hi % 2;
        x[r] = o[mt][i] * factor[hi];
      }
      packed[mt] = pack_bf16x2(x[0], x[1]);
    }
    bf16_t* out = p.o_lat + th * kDimLatent;
    if constexpr (F::kScaled) {
#pragma unroll
      for (int t = 0; t < 4; ++t)  // dims 128 t + [4 c', + 4)
        *reinterpret_cast<uint2*>(out + 128 * t + 4 * dim_word) =
            make_uint2(packed[2 * t], packed[2 * t + 1]);
    } else {  // dims [16 c, + 16)
      uint4* v = reinterpret_cast<uint4*>(out + 16 * dim_chunk);
      v[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      v[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
  });
}

// FP8 pools: work items of kN heads (one per token at H <= kN), two per CTA (pair_work).
template <KvLayout kLayout, int kN>
cudaError_t run_sparse_mla_sm90_few_heads_fp8(const SparseMlaParams& params, cudaStream_t stream) {
  using F = FewHeadsFp8Config<kLayout, kN>;
  if (params.num_tokens == 0 || params.num_heads == 0) return cudaSuccess;
  const int64_t num_items = params.num_tokens * ((params.num_heads + F::kHeads - 1) / F::kHeads);
  if (num_items > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;
  return launch_sm90_sparse<&sparse_mla_sm90_few_heads_fp8_kernel<kLayout, kN>>(
      params, (num_items + 1) / 2, F::kSmemBytes, stream);
}

}  // namespace dsakit::cuda::sparse_mla
