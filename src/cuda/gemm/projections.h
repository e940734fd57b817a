// MLA projections as per-head strided-batched GEMMs (batch = heads, fp32 accumulation) through
// cuBLASLt plans (gemm_plans.h), or cublasGemmStridedBatchedEx for a shape cuBLASLt has no
// algorithm for. Operands are bf16 or f32 (A and B share one type); outputs bf16 or f32.
//
// kv_b_proj W is row-major [H·(d_nope + d_v), d_c]. Head h's W_UK[h] [d_nope, d_c] is rows
// h·(d_nope+d_v) … + d_nope, W_UV[h] [d_v, d_c] the d_v rows after it; the head stride is
// (d_nope + d_v)·d_c elements.
//
// cuBLAS is column-major: a row-major [r, c] matrix with row stride ld is the column-major
// [c, r] matrix with leading dimension ld (its transpose). Each launcher states its mapping.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "src/cuda/gemm/gemm_plans.h"

namespace dsakit::cuda {

// Where a projection runs: the backend's plans, its cuBLAS handle (same stream) as the fallback.
struct GemmContext {
  GemmPlans* plans;
  cublasHandle_t cublas;
  cudaStream_t stream;
};

struct ProjectionDims {
  int64_t rows;  // T (query tokens) or N (kv rows)
  int heads;
  int d_nope;
  int d_v;
  int d_c;
};

// q_abs[t,h,:] = q_nope[t,h,:] · W_UK[h]:  q_nope [T, H, d_nope] -> q_abs [T, H, d_c].
cublasStatus_t gemm_absorb_q(const GemmContext& ctx, const ProjectionDims& dims,
                             cudaDataType operand_type, const void* q_nope, const void* w,
                             cudaDataType out_type, void* q_abs);

// out[r,h,:] = W_blk[h] · x[r,h,:] for a block of out_dim rows per head (W_UK: offset 0,
// out_dim d_nope; W_UV: offset d_nope, out_dim d_v; both at once: offset 0, out_dim
// d_nope + d_v). x is [rows, H, d_c] (x_head_stride d_c) or
// one [rows, d_c] vector shared by every head (x_head_stride 0); out is [rows, H, out_dim].
cublasStatus_t gemm_up_project(const GemmContext& ctx, const ProjectionDims& dims,
                               cudaDataType operand_type, const void* x, int64_t x_head_stride,
                               const void* w, int w_row_offset, int out_dim, cudaDataType out_type,
                               void* out);

// Rows of the FP8 up-projection's GEMMs come in multiples of this: cuBLASLt reads the codes'
// per-128 scales as [d_c / 128][rows] with rows a multiple of 4, and its FP8 GEMMs are asked for
// no dimension that is not a multiple of 16.
inline constexpr int kFp8GemmRows = 16;

// The K/V up-projection in FP8: out[r, :] = W · x[r, :] for rows r of x u8 (e4m3) [rows, d_c]
// (rows a multiple of kFp8GemmRows), every head's whole W block at once, with the block scales
// StridedGemm describes — w_scales W's [ceil(H·(d_nope + d_v) / 128)][d_c / 128], x_scales [d_c /
// 128][rows]; out bf16 [rows, H·(d_nope + d_v)]. CUBLAS_STATUS_NOT_SUPPORTED where cuBLASLt has no
// block-scaled FP8 GEMM (before sm_90, before CUDA 12.9).
cublasStatus_t gemm_up_project_fp8(const GemmContext& ctx, const ProjectionDims& dims,
                                   const void* x, const float* x_scales, const void* w,
                                   const float* w_scales, void* out);

// Elementwise dtype conversions for operand staging (bf16 -> f32 exact; f32 -> bf16 RNE).
cudaError_t launch_bf16_to_f32(const void* in, float* out, int64_t n, cudaStream_t stream);
cudaError_t launch_f32_to_bf16(const float* in, void* out, int64_t n, cudaStream_t stream);

}  // namespace dsakit::cuda
