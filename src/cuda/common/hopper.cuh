// Hopper (sm_90a) building blocks of the Hopper-native kernels (src/cuda/sm90/): mbarriers,
// named barriers, register reallocation, the async-proxy fence, cp.async completion on an
// mbarrier, TMA tile loads, stmatrix, and warpgroup MMA (wgmma, bf16, f16 and e4m3) with
// shared-memory matrix descriptors.
//
// wgmma conventions (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
//  * one warpgroup (4 consecutive warps, the first a multiple of 4) issues each instruction;
//  * the f32 accumulator of an m64nN tile: warp w of the group holds rows [16w, 16w + 16); lane
//    4g + q holds, for every 8-column block j, d[4j + 0, 1] = (row 16w + g, cols 8j + 2q, +1) and
//    d[4j + 2, 3] = (row 16w + g + 8, the same cols);
//  * an A operand from registers (k16) is the bf16 pairs of that layout for 16 columns:
//    a[0] = (row g, cols 2q, +1), a[1] = (row g + 8, ...), a[2] = (row g, 8 + 2q, +1),
//    a[3] = (row g + 8, 8 + 2q, +1), rows relative to the warp's 16;
//  * shared-memory operands use the 128-byte swizzle: a tile of rows of 64 bf16 (128 B), row r
//    at r * 128, its 16-byte chunk c at chunk c ^ (r % 8); tiles start 1024-byte aligned.
//    K-major (K contiguous, rows = M or N): SBO = 1024 (8-row groups), K steps of 16 add 32 B
//    to the start address (likewise K steps of 32 e4m3 codes, 32 B, in rows of 128 codes).
//    MN-major (MN contiguous, rows = K): LBO = the byte stride between
//    64-wide MN tiles, SBO = 1024 (8-row K groups), K steps of 16 add 2048 B.
//  * issue order: wgmma_fence() before the first MMA that reads registers written since,
//    wgmma_commit() after a batch, wgmma_wait<N>() until at most N batches are pending; and
//    fence_operands() on every accumulator around them, so the compiler neither reads nor
//    writes those registers while the tensor cores own them.
#pragma once

#include <cstdint>

#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda::sm90 {

// ---- mbarriers (shared memory, 8 bytes, 8-byte aligned) ------------------------------------
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}
// Makes initialized barriers visible to the other threads (then __syncthreads()).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed; the arrival counts
// against the barrier's expected count (noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Whether the phase of parity `phase` has completed (does not block).
__device__ __forceinline__ bool mbarrier_test_wait(uint32_t bar, uint32_t phase) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.test_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(phase)
      : "memory");
  return done != 0;
}
// Blocks until the phase of parity `phase` has completed. A fresh barrier is in phase 0, so a
// wait for parity 1 returns at once (producers start their "empty" waits there).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t phase) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(phase)
      : "memory");
}

// ---- thread-block clusters: a CTA's peers' shared memory and barriers ----------------------
// The rank of this CTA in its cluster.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// The shared::cluster address of shared-memory address `addr` (shared::cta) in CTA `rank` of the
// cluster. A CTA's window is contiguous: offsets from a mapped base carry over.
__device__ __forceinline__ uint32_t map_shared_to_rank(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
// One arrival on a barrier at shared::cluster address `bar` (a peer's). Pairs of CTAs use it
// as CUTLASS's cluster pipelines do: a consumer releases a peer's buffer it has finished reading
// (its wgmma reads complete before the arrival), and data reach a peer only through bulk copies
// completing on the peer's barrier; so the arrival is released, and every wait acquired, at CTA
// scope (at cluster scope the arrival costs a GPU-wide memory barrier and every wait an L1
// invalidation, docs/perf.md run R4).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// `bytes` (a multiple of 16) from this CTA's shared memory at `src` to shared::cluster address
// `dst` (a peer's), completing `bytes` of transactions on the barrier at shared::cluster address
// `bar` in the destination CTA. The copy reads `src` through the async proxy: writers fence
// (fence_proxy_async_shared) before it is issued.
__device__ __forceinline__ void bulk_copy_to_peer(uint32_t dst, uint32_t src, uint32_t bytes,
                                                  uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];\n" ::"r"(dst),
      "r"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// Every thread of every CTA of the cluster: arrive (release), then wait (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
}

// One arrival that also expects `bytes` more of asynchronous (TMA) transactions this phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}

// Expects `bytes` more of asynchronous transactions this phase, without arriving: each thread
// that issues a copy counts its own bytes before issuing it.
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// ---- TMA (tensor maps built on the host: src/cuda/common/tma.h) -----------------------------
// One box of `tensor_map` at coordinates (c0 innermost, c1[, c2]) into shared memory at `dst`
// (aligned as the map's swizzle requires: 1024 bytes for 128-byte swizzle); completion
// counts its bytes on `bar`. Elements outside the tensor arrive as zeros and count too.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tensor_map, uint32_t bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(tensor_map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}

// ---- named barriers (ids 1..15; 0 is __syncthreads) -----------------------------------------
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- registers, proxies ------------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Orders this thread's generic-proxy shared-memory writes (st.shared, stmatrix) before later
// async-proxy reads (wgmma operands): each writer fences, then synchronizes with the reader.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- copies -------------------------------------------------------------------------------
// 16 bytes global -> shared through L2 with a 256-byte L2 prefetch; !valid zero-fills and
// reads nothing (src must still be a mapped address).
__device__ __forceinline__ void cp_async_16_prefetch(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 16 bytes global -> shared through L1 (hits lines prefetched there by prefetch_l1); !valid
// zero-fills and reads nothing.
__device__ __forceinline__ void cp_async_16_l1(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// 8 or 4 bytes global -> shared (through L1); !valid zero-fills. Addresses aligned to the size.
template <int kBytes>
__device__ __forceinline__ void cp_async_small(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8);
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src), "n"(kBytes),
               "r"(valid ? kBytes : 0)
               : "memory");
}
// 16 / 8 bytes of read-only global memory into registers, not kept in L1, with a 256-byte L2
// prefetch: for rows gathered once per CTA. !valid gives zeros and reads nothing. Addresses
// aligned to the size.
__device__ __forceinline__ uint4 ld_global_nc_u32x4(const void* src, bool valid) {
  uint4 v;
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
      "mov.u32 %0, 0;\nmov.u32 %1, 0;\nmov.u32 %2, 0;\nmov.u32 %3, 0;\n"
      "@p ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(src), "r"(int(valid)));
  return v;
}
__device__ __forceinline__ uint2 ld_global_nc_u32x2(const void* src, bool valid) {
  uint2 v;
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %3, 0;\nmov.u32 %0, 0;\nmov.u32 %1, 0;\n"
      "@p ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];\n}\n"
      : "=r"(v.x), "=r"(v.y)
      : "l"(src), "r"(int(valid)));
  return v;
}
// Brings the line holding `src` into L1 (no registers held while it is in flight).
__device__ __forceinline__ void prefetch_l1(const void* src) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(src));
}
__device__ __forceinline__ uint4 ld_shared_u32x4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_u32x4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
// Four 8x8 bf16 matrices from registers to shared memory: lane i gives the row address of
// row i % 8 of matrix i / 8; r[m] holds this lane's pair of matrix m (row lane / 4).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// The same with each matrix stored transposed (.trans): row i of the stored 8x8 matrix m is
// column i of the registers' matrix m, so a fragment of rows (lane / 4) lands as columns.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile(
      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
      "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
}

// ---- wgmma --------------------------------------------------------------------------------
// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a 128-byte-swizzled tile (rows of
// 128 bytes, chunk c of row r at c ^ (r % 8)): where the copies that fill a wgmma operand write.
__device__ __forceinline__ uint32_t swizzled_chunk(int row, int chunk) {
  return uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Descriptor of a 128-byte-swizzled shared-memory operand starting at `addr` (see the file
// comment for LBO / SBO); bits: start >> 4 [0, 14), LBO >> 4 [16, 30), SBO >> 4 [32, 46),
// layout 1 = 128B swizzle [62, 64).
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((addr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// A fragments read by an in-flight wgmma: fenced after its wait so they stay allocated.
template <int kM, int kN>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[kM][kN]) {
#pragma unroll
  for (int i = 0; i < kM; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
}

// The 16-bit operand types of the wgmma wrappers that take either (A and B alike): bf16, or f16
// (the FP8 raw pool's codes widen to f16 exactly in one instruction per pair).
enum class Ab { kBf16, kF16 };

// clang-format off
// Expands the asm statement macro M(ab) with the operand type name of the enclosing wrapper's
// kAb.
#define DSAKIT_WGMMA_FOR_AB(M) \
  if constexpr (kAb == Ab::kF16) M("f16"); else M("bf16")

// The 32 accumulator operands d[0], …, d[31] of an m64n64 wgmma, as inline-asm constraints.
#define DSAKIT_WGMMA_F32X32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), \
  "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), \
  "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), \
  "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d[64 x 16] (+)= A[64 x 16] · B[16 x 16], A and B (bf16, or f16: kAb) from shared memory
// (descriptors); kTransA / kTransB: A / B is MN-major (M / N contiguous). scale_d == 0
// overwrites d.
template <int kTransA, int kTransB, Ab kAb>
__device__ __forceinline__ void wgmma_m64n16k16_ss(float (&d)[8], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
#define DSAKIT_WGMMA_M64N16K16_SS(ab) \
  asm volatile( \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n16k16.f32." ab "." ab " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12;\n}\n" \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
  : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB))
  DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N16K16_SS);
#undef DSAKIT_WGMMA_M64N16K16_SS
}

// d[64 x kN] (+)= A[64 x 16] · B[16 x kN] for kN = 16 or 32, A from registers (the m64nkN
// accumulator layout of 16-bit pairs, bf16 or f16: kAb), B from shared memory, K-major.
// scale_d == 0 overwrites d.
template <int kN, Ab kAb>
__device__ __forceinline__ void wgmma_m64nNk16_rs(float (&d)[kN / 2], const uint32_t (&a)[4],
                                                 uint64_t desc_b, int scale_d) {
  static_assert(kN == 16 || kN == 32, "wgmma_m64nNk16_rs: N = 16 or 32");
#define DSAKIT_WGMMA_M64N16K16_RS(ab) \
  asm volatile( \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n16k16.f32." ab "." ab " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n" \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
#define DSAKIT_WGMMA_M64N32K16_RS(ab) \
  asm volatile( \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n32k16.f32." ab "." ab " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, " \
  "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n" \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
    "+f"(d[15]) \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
  if constexpr (kN == 16) {
    DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N16K16_RS);
  } else {
    DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N32K16_RS);
  }
#undef DSAKIT_WGMMA_M64N16K16_RS
#undef DSAKIT_WGMMA_M64N32K16_RS
}

// d[64 x 64] (+)= A[64 x 16] · B[16 x 64], A and B (bf16, or f16: kAb) from shared memory
// (descriptors); kTransB: B is MN-major (N contiguous). scale_d == 0 overwrites d.
template <int kTransB, Ab kAb = Ab::kBf16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
#define DSAKIT_WGMMA_M64N64K16_SS(ab) \
  asm volatile( \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n64k16.f32." ab "." ab " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, %35;\n}\n" \
  : DSAKIT_WGMMA_F32X32(d) \
  : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB))
  DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N64K16_SS);
#undef DSAKIT_WGMMA_M64N64K16_SS
}

// d[64 x 80] (+)= A[64 x 16] · B[16 x 80], A and B from shared memory (descriptors); kTransB: B
// is MN-major (N contiguous). scale_d == 0 overwrites d.
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, %43;\n}\n"
      : DSAKIT_WGMMA_F32X32(d),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB));
}

// The 64 accumulator operands d[o], …, d[o + 63] of an m64n128 wgmma (o = 0) or half of an
// m64n256 one, as inline-asm constraints.
#define DSAKIT_WGMMA_F32X64_AT(d, o) \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), \
  "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), \
  "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), \
  "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), \
  "+f"(d[o + 16]), "+f"(d[o + 17]), "+f"(d[o + 18]), "+f"(d[o + 19]), \
  "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), \
  "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), \
  "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]), "+f"(d[o + 31]), \
  "+f"(d[o + 32]), "+f"(d[o + 33]), "+f"(d[o + 34]), "+f"(d[o + 35]), \
  "+f"(d[o + 36]), "+f"(d[o + 37]), "+f"(d[o + 38]), "+f"(d[o + 39]), \
  "+f"(d[o + 40]), "+f"(d[o + 41]), "+f"(d[o + 42]), "+f"(d[o + 43]), \
  "+f"(d[o + 44]), "+f"(d[o + 45]), "+f"(d[o + 46]), "+f"(d[o + 47]), \
  "+f"(d[o + 48]), "+f"(d[o + 49]), "+f"(d[o + 50]), "+f"(d[o + 51]), \
  "+f"(d[o + 52]), "+f"(d[o + 53]), "+f"(d[o + 54]), "+f"(d[o + 55]), \
  "+f"(d[o + 56]), "+f"(d[o + 57]), "+f"(d[o + 58]), "+f"(d[o + 59]), \
  "+f"(d[o + 60]), "+f"(d[o + 61]), "+f"(d[o + 62]), "+f"(d[o + 63])
#define DSAKIT_WGMMA_F32X128(d) DSAKIT_WGMMA_F32X64_AT(d, 0), DSAKIT_WGMMA_F32X64_AT(d, 64)

// d[64 x 128] (+)= A[64 x 16] · B[16 x 128], A and B (bf16, or f16: kAb) from shared memory
// (descriptors); kTransB: B is MN-major (N contiguous). scale_d == 0 overwrites d.
template <int kTransB, Ab kAb = Ab::kBf16>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
#define DSAKIT_WGMMA_M64N128K16_SS(ab) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." ab "." ab " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, %67;\n}\n" \
      : DSAKIT_WGMMA_F32X64_AT(d, 0) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB))
  DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N128K16_SS);
#undef DSAKIT_WGMMA_M64N128K16_SS
}

// d[64 x 128] (+)= A[64 x 16] · B[16 x 128], A from registers (the m64n16 accumulator layout of
// bf16 pairs), B from shared memory; kTransB: B is MN-major. scale_d == 0 overwrites d.
template <int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                  uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
      : DSAKIT_WGMMA_F32X64_AT(d, 0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
}

// d[64 x 256] (+)= A[64 x 16] · B[16 x 256], A and B (bf16, or f16: kAb) from shared memory
// (descriptors); kTransB: B is MN-major (N contiguous). scale_d == 0 overwrites d.
template <int kTransB, Ab kAb = Ab::kBf16>
__device__ __forceinline__ void wgmma_m64n256k16_ss(float (&d)[128], uint64_t desc_a, uint64_t desc_b,
                                                  int scale_d) {
#define DSAKIT_WGMMA_M64N256K16_SS(ab) \
  asm volatile( \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." ab "." ab " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, %131;\n}\n" \
  : DSAKIT_WGMMA_F32X128(d) \
  : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB))
  DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N256K16_SS);
#undef DSAKIT_WGMMA_M64N256K16_SS
}

// d[64 x 256] (+)= A[64 x 16] · B[16 x 256], A from registers (a: the m64n16 accumulator layout
// of 16-bit pairs, bf16 or f16: kAb), B from shared memory; kTransB: B is MN-major. scale_d == 0
// overwrites d.
template <int kTransB, Ab kAb = Ab::kBf16>
__device__ __forceinline__ void wgmma_m64n256k16_rs(float (&d)[128], const uint32_t (&a)[4],
                                                  uint64_t desc_b, int scale_d) {
#define DSAKIT_WGMMA_M64N256K16_RS(ab) \
  asm volatile( \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n" \
  "wgmma.mma_async.sync.aligned.m64n256k16.f32." ab "." ab " " \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n" \
  : DSAKIT_WGMMA_F32X128(d) \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB))
  DSAKIT_WGMMA_FOR_AB(DSAKIT_WGMMA_M64N256K16_RS);
#undef DSAKIT_WGMMA_M64N256K16_RS
}

// d[64 x 128] (+)= A[64 x 32] · B[32 x 128] on e4m3 codes (fp32 accumulate), A and B from shared
// memory, both K-major. scale_d == 0 overwrites d.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3_ss(float (&d)[64], uint64_t desc_a,
                                                        uint64_t desc_b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
      : DSAKIT_WGMMA_F32X64_AT(d, 0)
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// clang-format on

#undef DSAKIT_WGMMA_F32X128
#undef DSAKIT_WGMMA_F32X32
#undef DSAKIT_WGMMA_F32X64_AT

}  // namespace dsakit::cuda::sm90
