// Column-major strided-batched GEMMs through cuBLASLt, C = op(A) · B per batch entry, fp32
// accumulation (CUBLAS_COMPUTE_32F; A and B of one type, bf16 or f32, or e4m3 with block scales;
// C bf16 or f32), with each shape's plan (matmul descriptor, layouts, algorithm) built once and
// kept.
//
// The algorithm: cuBLASLt's heuristic candidates without split-K (their sums run over k in one
// order, as the heuristic's first choice does). A single GEMM of at least kTuneMinFlop is timed
// once per size class (n rounded up to a power of two, the rest of the shape exact) over those
// candidates and takes the fastest; the others take the heuristic's first choice. While the
// stream is capturing a graph nothing is timed (the heuristic's first choice runs, and the shape
// is planned again after the capture). Calls from several threads take turns (one lock over the
// cache and the enqueue: a plan's descriptors are shared).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>

namespace dsakit::cuda {

struct StridedGemm {
  int m, n, k;
  bool transpose_a;
  const void* a;
  int64_t lda, stride_a;
  const void* b;
  int64_t ldb, stride_b;
  void* c;
  int64_t ldc, stride_c;
  int batch;
  // e4m3 operands (operand type CUDA_R_8F_E4M3, transposed A, batch 1) with DeepSeek-style
  // block scales (cuBLASLt's, sm_90): A's one f32 per 128 x 128 block, row-major [ceil(m / 128)]
  // [k / 128] (k / 128 a multiple of 4), and B's one per 128 values of k, k-block-major
  // [k / 128][n] (n a multiple of 4; up_proj_kv_fp8 keeps it a multiple of 16). Null for the
  // other types.
  const float* a_block_scales = nullptr;
  const float* b_k_scales = nullptr;
};

class GemmPlans {
 public:
  // GEMMs of at least this many FLOP (2 m n k, batch 1) are timed per size class.
  static constexpr double kTuneMinFlop = 2e9;
  static constexpr int kCandidates = 8;  // heuristic candidates asked for

  GemmPlans(void* workspace, size_t workspace_bytes);  // workspace: device memory it may use
  ~GemmPlans();
  GemmPlans(const GemmPlans&) = delete;
  GemmPlans& operator=(const GemmPlans&) = delete;

  // CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt offers no algorithm for the shape (or could not be
  // initialized): the caller runs it another way.
  cublasStatus_t run(const StridedGemm& g, cudaDataType operand_type, cudaDataType out_type,
                     cudaStream_t stream);

 private:
  // The shape without pointers: m, n, k, transpose_a, lda, stride_a, ldb, stride_b, ldc,
  // stride_c, batch, operand type, output type.
  using Key = std::array<int64_t, 13>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  cublasStatus_t make_plan(const Key& key, const StridedGemm& g, cudaDataType operand_type,
                           cudaDataType out_type, cudaStream_t stream, Plan& plan, bool& keep);
  static void destroy(Plan& p);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  std::mutex mutex_;
  std::map<Key, Plan> plans_;                  // exact shapes, at most kMaxPlans
  std::map<Key, cublasLtMatmulAlgo_t> timed_;  // size classes (n rounded up) timed so far
  static constexpr size_t kMaxPlans = 256;
};

}  // namespace dsakit::cuda
