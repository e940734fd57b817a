#include "src/cuda/gemm/gemm_plans.h"

#include <bit>
#include <vector>

namespace dsakit::cuda {
namespace {

#define DSAKIT_LT_TRY(call)                                                       \
  do {                                                                            \
    if (const cublasStatus_t s_ = (call); s_ != CUBLAS_STATUS_SUCCESS) return s_; \
  } while (0)

int32_t config_attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  int32_t v = -1;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return -1;
  return v;
}

// One order of the k sums: no split-K, no reduction.
bool single_pass(const cublasLtMatmulAlgo_t& algo) {
  return config_attr(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1 &&
         config_attr(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) == CUBLASLT_REDUCTION_SCHEME_NONE;
}

// The block-scale modes and this call's scale pointers (a kept plan's descriptor gets each call's).
cublasStatus_t set_block_scales(cublasLtMatmulDesc_t op, const StridedGemm& g) {
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  const int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  DSAKIT_LT_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode,
                                               sizeof(a_mode)));
  DSAKIT_LT_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode,
                                               sizeof(b_mode)));
  DSAKIT_LT_TRY(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                               &g.a_block_scales, sizeof(g.a_block_scales)));
  return cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &g.b_k_scales,
                                        sizeof(g.b_k_scales));
}

}  // namespace

GemmPlans::GemmPlans(void* workspace, size_t workspace_bytes)
    : workspace_(workspace), workspace_bytes_(workspace_bytes) {
  if (cublasLtCreate(&handle_) != CUBLAS_STATUS_SUCCESS) handle_ = nullptr;
}

GemmPlans::~GemmPlans() {
  for (auto& [key, plan] : plans_) destroy(plan);
  if (handle_) cublasLtDestroy(handle_);
}

void GemmPlans::destroy(Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

cublasStatus_t GemmPlans::make_plan(const Key& key, const StridedGemm& g, cudaDataType operand_type,
                                    cudaDataType out_type, cudaStream_t stream, Plan& plan,
                                    bool& keep) {
  keep = true;
  DSAKIT_LT_TRY(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = g.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
  DSAKIT_LT_TRY(
      cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  DSAKIT_LT_TRY(
      cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (g.a_block_scales != nullptr) DSAKIT_LT_TRY(set_block_scales(plan.op, g));
  // A as stored: column-major [k, m] when transposed, else [m, k].
  DSAKIT_LT_TRY(cublasLtMatrixLayoutCreate(&plan.a, operand_type, g.transpose_a ? g.k : g.m,
                                           g.transpose_a ? g.m : g.k, g.lda));
  DSAKIT_LT_TRY(cublasLtMatrixLayoutCreate(&plan.b, operand_type, g.k, g.n, g.ldb));
  DSAKIT_LT_TRY(cublasLtMatrixLayoutCreate(&plan.c, out_type, g.m, g.n, g.ldc));
  if (g.batch > 1) {
    const int32_t count = g.batch;
    const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {
        {plan.a, g.stride_a}, {plan.b, g.stride_b}, {plan.c, g.stride_c}};
    for (const auto& [layout, stride] : strided) {
      DSAKIT_LT_TRY(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                     &count, sizeof(count)));
      DSAKIT_LT_TRY(cublasLtMatrixLayoutSetAttribute(
          layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  }
  // Split-K partial sums, where the heuristic wants them, reduced in fp32 (never in C's type).
  cublasLtMatmulPreference_t pref = nullptr;
  DSAKIT_LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                  &reduction, sizeof(reduction));
  if (status == CUBLAS_STATUS_SUCCESS)
    status = cublasLtMatmulAlgoGetHeuristic(handle_, plan.op, plan.a, plan.b, plan.c, plan.c, pref,
                                            kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS) return status;
  if (found < 1) return CUBLAS_STATUS_NOT_SUPPORTED;
  plan.algo = results[0].algo;

  // Timed choice: a single GEMM large enough to matter, whose first candidate sums in one pass;
  // only candidates that do as well.
  std::vector<cublasLtMatmulAlgo_t> candidates;
  for (int i = 0; i < found; ++i)
    if (single_pass(results[i].algo)) candidates.push_back(results[i].algo);
  const double flop = 2.0 * g.m * double(g.n) * g.k;
  if (g.batch != 1 || flop < kTuneMinFlop || candidates.size() < 2 || !single_pass(results[0].algo))
    return CUBLAS_STATUS_SUCCESS;
  Key size_class = key;
  size_class[1] = int64_t(std::bit_ceil(uint64_t(g.n)));
  if (const auto it = timed_.find(size_class); it != timed_.end()) {
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(handle_, plan.op, plan.a, plan.b, plan.c, plan.c, &it->second,
                                &check) == CUBLAS_STATUS_SUCCESS) {
      plan.algo = it->second;
      return CUBLAS_STATUS_SUCCESS;
    }
  }
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    keep = false;  // planned again, and timed, after the capture
    return CUBLAS_STATUS_SUCCESS;
  }
  // Each candidate once to warm up, then three runs between two events, on the call's operands
  // (each writes the same C; the chosen one runs after).
  cudaEvent_t start = nullptr, stop = nullptr;
  if (cudaEventCreate(&start) != cudaSuccess || cudaEventCreate(&stop) != cudaSuccess) {
    if (start) cudaEventDestroy(start);
    return CUBLAS_STATUS_SUCCESS;  // untimed: the heuristic's first choice
  }
  const float alpha = 1.0f, beta = 0.0f;
  float best_ms = 0;
  bool timed_any = false;
  for (const cublasLtMatmulAlgo_t& algo : candidates) {
    const auto launch = [&] {
      return cublasLtMatmul(handle_, plan.op, &alpha, g.a, plan.a, g.b, plan.b, &beta, g.c, plan.c,
                            g.c, plan.c, &algo, workspace_, workspace_bytes_, stream);
    };
    if (launch() != CUBLAS_STATUS_SUCCESS) continue;
    cudaEventRecord(start, stream);
    bool ok = true;
    for (int r = 0; r < 3 && ok; ++r) ok = launch() == CUBLAS_STATUS_SUCCESS;
    cudaEventRecord(stop, stream);
    float ms = 0;
    if (!ok || cudaEventSynchronize(stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, start, stop) != cudaSuccess)
      continue;
    if (!timed_any || ms < best_ms) best_ms = ms, plan.algo = algo, timed_any = true;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (timed_any) timed_.emplace(size_class, plan.algo);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t GemmPlans::run(const StridedGemm& g, cudaDataType operand_type,
                              cudaDataType out_type, cudaStream_t stream) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return CUBLAS_STATUS_SUCCESS;
  if (handle_ == nullptr) return CUBLAS_STATUS_NOT_SUPPORTED;  // no cuBLASLt: the caller's cuBLAS
  const bool scaled = g.a_block_scales != nullptr || g.b_k_scales != nullptr;
  if (scaled != (operand_type == CUDA_R_8F_E4M3) ||
      (scaled &&
       (g.a_block_scales == nullptr || g.b_k_scales == nullptr || !g.transpose_a || g.batch != 1)))
    return CUBLAS_STATUS_INVALID_VALUE;
  const Key key{g.m,        g.n,   g.k,        g.transpose_a, g.lda,        g.stride_a, g.ldb,
                g.stride_b, g.ldc, g.stride_c, g.batch,       operand_type, out_type};
  std::lock_guard<std::mutex> lock(mutex_);
  Plan* plan = nullptr;
  Plan unkept;
  if (const auto it = plans_.find(key); it != plans_.end()) {
    plan = &it->second;
  } else {
    bool keep = true;
    const cublasStatus_t status = make_plan(key, g, operand_type, out_type, stream, unkept, keep);
    if (status != CUBLAS_STATUS_SUCCESS) {
      destroy(unkept);
      return status;
    }
    if (keep) {
      if (plans_.size() >= kMaxPlans) {
        for (auto& [k, p] : plans_) destroy(p);
        plans_.clear();
      }
      plan = &plans_.emplace(key, unkept).first->second;
      unkept = Plan{};
    } else {
      plan = &unkept;
    }
  }
  if (scaled) {
    if (const cublasStatus_t status = set_block_scales(plan->op, g);
        status != CUBLAS_STATUS_SUCCESS) {
      destroy(unkept);
      return status;
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status =
      cublasLtMatmul(handle_, plan->op, &alpha, g.a, plan->a, g.b, plan->b, &beta, g.c, plan->c,
                     g.c, plan->c, &plan->algo, workspace_, workspace_bytes_, stream);
  destroy(unkept);
  return status;
}

}  // namespace dsakit::cuda

#undef DSAKIT_LT_TRY
