// Warp-level building blocks of the mma.sync kernels (src/cuda/sm80/ attention, the tensor-core
// indexer logits): cp.async gathers into XOR-swizzled shared memory, ldmatrix fragment loads,
// bf16 mma.sync.m16n8k16 and e4m3 mma.sync.m16n8k32 with fp32 results, and quad reductions for
// the online softmax. The Hopper-native kernels (src/cuda/sm90/) use wgmma instead.
//
// Fragment conventions of mma.m16n8k16 (lane = 4 * g + q, g in [0, 8), q in [0, 4)):
//   A (16x16, row-major)  a[0]: (g, 2q..2q+1)  a[1]: (g+8, 2q..)
//                         a[2]: (g, 8+2q..)    a[3]: (g+8, 8+2q..)
//   B (16x8, k-major)     b[0]: (k = 2q..2q+1, n = g)  b[1]: (k = 8+2q.., n = g)
//   C (16x8, fp32)        c[0..1]: (row g, cols 2q, 2q+1)  c[2..3]: (row g+8, cols 2q, 2q+1)
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {

// ---- swizzled shared-memory tiles ------------------------------------------------------------
// A tile of rows of kChunks 16-byte chunks (8 bf16 each), kChunks a multiple of 8. Chunk c of
// row r lives at physical chunk r * kChunks + (c ^ (r & 7)): the 8 rows an ldmatrix reads at one
// logical chunk fall in 8 distinct bank groups, so loads and stores are conflict-free.
template <int kChunks>
struct SwizzledTile {
  static_assert(kChunks % 8 == 0, "swizzle permutes chunks within groups of 8");
  static constexpr int kRowBytes = kChunks * 16;

  __device__ __forceinline__ static uint32_t offset(int row, int chunk) {
    return uint32_t(row * kChunks + (chunk ^ (row & 7))) * 16u;
  }
};

// ---- ldmatrix --------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// A fragment of rows [row0, row0 + 16), k chunks {chunk0, chunk0 + 1} of a swizzled tile.
template <int kChunks>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], uint32_t tile, int row0, int chunk0,
                                            int lane) {
  const int row = row0 + (lane & 15);
  const int chunk = chunk0 + (lane >> 4);
  ldmatrix_x4(a, tile + SwizzledTile<kChunks>::offset(row, chunk));
}

// B fragments of S = A · X^T for two n-tiles: X rows [n0, n0 + 16) (the n dim), k chunks
// {chunk0, chunk0 + 1}. b[0..1]: n-tile n0, b[2..3]: n-tile n0 + 8.
template <int kChunks>
__device__ __forceinline__ void load_bt_frag_x2n(uint32_t (&b)[4], uint32_t tile, int n0,
                                                 int chunk0, int lane) {
  const int row = n0 + (lane & 7) + ((lane >> 4) << 3);
  const int chunk = chunk0 + ((lane >> 3) & 1);
  ldmatrix_x4(b, tile + SwizzledTile<kChunks>::offset(row, chunk));
}

// As above for one n-tile (rows [n0, n0 + 8)).
template <int kChunks>
__device__ __forceinline__ void load_bt_frag_x1n(uint32_t (&b)[2], uint32_t tile, int n0,
                                                 int chunk0, int lane) {
  const int row = n0 + (lane & 7);
  const int chunk = chunk0 + ((lane >> 3) & 1);
  ldmatrix_x2(b, tile + SwizzledTile<kChunks>::offset(row, chunk));
}

// B fragments of O = P · X for two n-tiles: X rows [k0, k0 + 16) (the k dim), columns chunks
// {chunk0, chunk0 + 1} (the n dim, 8 columns each). b[0..1]: n-tile chunk0, b[2..3]: chunk0 + 1.
template <int kChunks>
__device__ __forceinline__ void load_b_frag_x2n(uint32_t (&b)[4], uint32_t tile, int k0, int chunk0,
                                                int lane) {
  const int row = k0 + (lane & 7) + (((lane >> 3) & 1) << 3);
  const int chunk = chunk0 + (lane >> 4);
  ldmatrix_x4_trans(b, tile + SwizzledTile<kChunks>::offset(row, chunk));
}

// ---- mma -------------------------------------------------------------------------------------
// c += a · b for one 16x8x16 tile, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d = a · b for one 16x8x32 tile of e4m3 codes (sm_89+), fp32 result; the accumulator input is
// zero, so callers sum successive k-steps in fp32 on the CUDA cores. (Hopper's FP8 MMA keeps
// about 13 mantissa bits when it adds the accumulator input; summing outside keeps fp32.)
// The 8-bit fragments are the bf16 m16n8k16 fragments above read as bytes: a[0] holds row g,
// k bytes 4q..4q+3; a[1] row g+8; a[2] / a[3] the same rows at k bytes 16+4q..; b[0] holds
// k bytes 4q..4q+3 of column g, b[1] k bytes 16+4q... A k-step is therefore one pair of
// 16-byte chunks, and load_a_frag / load_bt_frag_* serve e4m3 tiles unchanged.
__device__ __forceinline__ void mma_e4m3_16832(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %10, %10, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// The running max used as the exp2 offset: a row that has seen no valid key yet keeps
// m = -inf, and exp2(-inf - 0) = 0 gives it zero weight instead of NaN.
__device__ __forceinline__ float softmax_offset(float m) {
  return m == -INFINITY ? 0.f : m;
}

}  // namespace dsakit::cuda
