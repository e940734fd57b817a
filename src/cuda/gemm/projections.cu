#include "src/cuda/gemm/projections.h"

#include <algorithm>

#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {
namespace {

size_t type_size(cudaDataType type) {
  return type == CUDA_R_32F ? 4 : 2;
}

const void* offset(const void* p, int64_t elements, cudaDataType type) {
  return static_cast<const char*>(p) + elements * int64_t(type_size(type));
}

// Column-major C[m, n] (ldc, stride_c) = op(A)[m, k] · B[k, n], one product per head; cuBLAS
// where cuBLASLt has no plan (not for block-scaled FP8, which cuBLAS does not take).
cublasStatus_t run(const GemmContext& ctx, const StridedGemm& g, cudaDataType operand_type,
                   cudaDataType out_type) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  const cublasStatus_t lt = ctx.plans->run(g, operand_type, out_type, ctx.stream);
  if (lt != CUBLAS_STATUS_NOT_SUPPORTED || g.a_block_scales != nullptr) return lt;
  const float alpha = 1.0f, beta = 0.0f;
  return cublasGemmStridedBatchedEx(
      ctx.cublas, g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, g.m, g.n, g.k, &alpha,
      g.a, operand_type, int(g.lda), g.stride_a, g.b, operand_type, int(g.ldb), g.stride_b, &beta,
      g.c, out_type, int(g.ldc), g.stride_c, g.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

bool fits_int(int64_t v) {
  return v >= 0 && v <= INT32_MAX;
}

// The K/V up-projection as one GEMM (x [rows, d_c] shared by every head, each head's whole
// block of W): the heads' A blocks are consecutive (stride (d_nope + d_v)·d_c) and so are their C
// columns, so the batch over heads is Out^T [H·(d_nope + d_v), rows] = W · X^T [d_c, rows].
StridedGemm whole_up_projection(const ProjectionDims& d, const void* x, const void* w, void* out) {
  const int64_t m = int64_t(d.heads) * (d.d_nope + d.d_v);
  return {.m = int(m),
          .n = int(d.rows),
          .k = d.d_c,
          .transpose_a = true,
          .a = w,
          .lda = d.d_c,
          .stride_a = 0,
          .b = x,
          .ldb = d.d_c,
          .stride_b = 0,
          .c = out,
          .ldc = m,
          .stride_c = 0,
          .batch = 1};
}

}  // namespace

cublasStatus_t gemm_absorb_q(const GemmContext& ctx, const ProjectionDims& d,
                             cudaDataType operand_type, const void* q_nope, const void* w,
                             cudaDataType out_type, void* q_abs) {
  // Row-major per head: Q_abs[h] [T, d_c] = Q[h] [T, d_nope] · W_UK[h] [d_nope, d_c].
  // Column-major:       Q_abs[h]^T [d_c, T] = W_UK[h]^T [d_c, d_nope] · Q[h]^T [d_nope, T]
  //   A = W_UK[h] read as col-major [d_c, d_nope], lda = d_c, no transpose;
  //   B = q_nope + h·d_nope as col-major [d_nope, T], ldb = H·d_nope;
  //   C = q_abs + h·d_c as col-major [d_c, T], ldc = H·d_c.
  if (!fits_int(d.rows) || !fits_int(int64_t(d.heads) * d.d_c)) return CUBLAS_STATUS_INVALID_VALUE;
  const StridedGemm g{d.d_c,
                      int(d.rows),
                      d.d_nope,
                      false,
                      w,
                      d.d_c,
                      int64_t(d.d_nope + d.d_v) * d.d_c,
                      q_nope,
                      int64_t(d.heads) * d.d_nope,
                      d.d_nope,
                      q_abs,
                      int64_t(d.heads) * d.d_c,
                      d.d_c,
                      d.heads};
  return run(ctx, g, operand_type, out_type);
}

cublasStatus_t gemm_up_project(const GemmContext& ctx, const ProjectionDims& d,
                               cudaDataType operand_type, const void* x, int64_t x_head_stride,
                               const void* w, int w_row_offset, int out_dim, cudaDataType out_type,
                               void* out) {
  // Row-major per head: Out[h] [rows, out_dim] = X[h] [rows, d_c] · W_blk[h]^T [d_c, out_dim].
  // Column-major:       Out[h]^T [out_dim, rows] = W_blk[h] [out_dim, d_c] · X[h]^T [d_c, rows]
  //   A = W_blk[h] read as col-major [d_c, out_dim] (lda = d_c), transposed;
  //   B = x + h·x_head_stride as col-major [d_c, rows], ldb = row stride of x
  //       (H·d_c per-head input, d_c shared input);
  //   C = out + h·out_dim as col-major [out_dim, rows], ldc = H·out_dim.
  const int64_t x_row_stride = x_head_stride == 0 ? d.d_c : int64_t(d.heads) * d.d_c;
  if (!fits_int(d.rows) || !fits_int(x_row_stride) || !fits_int(int64_t(d.heads) * out_dim))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (x_head_stride == 0 && w_row_offset == 0 && out_dim == d.d_nope + d.d_v) {
    // One input shared by every head and each head's whole block of W: one GEMM. cuBLAS tiles
    // one tall product far better than H thin ones (H200, GLM-5 K/V of 2K positions: see
    // docs/perf.md).
    return run(ctx, whole_up_projection(d, x, w, out), operand_type, out_type);
  }
  const StridedGemm g{out_dim,
                      int(d.rows),
                      d.d_c,
                      true,
                      offset(w, int64_t(w_row_offset) * d.d_c, operand_type),
                      d.d_c,
                      int64_t(d.d_nope + d.d_v) * d.d_c,
                      x,
                      x_row_stride,
                      x_head_stride,
                      out,
                      int64_t(d.heads) * out_dim,
                      out_dim,
                      d.heads};
  return run(ctx, g, operand_type, out_type);
}

namespace {

constexpr int kCastThreads = 256;

__global__ void bf16_to_f32_kernel(const bf16_t* in, float* out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * kCastThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kCastThreads)
    out[i] = bf16_to_f32(in[i]);
}

__global__ void f32_to_bf16_kernel(const float* in, bf16_t* out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * kCastThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kCastThreads)
    out[i] = f32_to_bf16(in[i]);
}

unsigned cast_blocks(int64_t n) {
  return unsigned(std::min<int64_t>(ceil_div(n, kCastThreads), 65536));
}

}  // namespace

cudaError_t launch_bf16_to_f32(const void* in, float* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bf16_to_f32_kernel<<<cast_blocks(n), kCastThreads, 0, stream>>>(static_cast<const bf16_t*>(in),
                                                                  out, n);
  return cudaGetLastError();
}

cudaError_t launch_f32_to_bf16(const float* in, void* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  f32_to_bf16_kernel<<<cast_blocks(n), kCastThreads, 0, stream>>>(in, static_cast<bf16_t*>(out), n);
  return cudaGetLastError();
}

cublasStatus_t gemm_up_project_fp8(const GemmContext& ctx, const ProjectionDims& d, const void* x,
                                   const float* x_scales, const void* w, const float* w_scales,
                                   void* out) {
  // gemm_up_project's one-GEMM form, with W's 128 x 128 block scales on A and X's per-128
  // scales on B.
  if (!fits_int(d.rows) || !fits_int(int64_t(d.heads) * (d.d_nope + d.d_v)) ||
      d.rows % kFp8GemmRows != 0)
    return CUBLAS_STATUS_INVALID_VALUE;
  StridedGemm g = whole_up_projection(d, x, w, out);
  g.a_block_scales = w_scales;
  g.b_k_scales = x_scales;
  return run(ctx, g, CUDA_R_8F_E4M3, CUDA_R_16BF);
}

}  // namespace dsakit::cuda
