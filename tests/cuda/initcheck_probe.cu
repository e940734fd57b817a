// compute-sanitizer initcheck probe (not a unit test; tools/device-check.sh runs it): does
// initcheck see the writes of a cuBLAS GEMM? One strided-batched bf16 GEMM of absorb_q's shape
// (d_c 512 x 24 tokens x d_nope 128, 4 heads) writes C; a plain kernel then reads every element.
//   initcheck_probe memset   C is cudaMemset first: any report would be a probe bug
//   initcheck_probe plain    C only written by cuBLAS: a report means initcheck does not track
//                            cuBLAS's stores (a tool limitation, not a read of unwritten memory)
// Exits 0 when the GEMM result read back equals a host recomputation (so the data is written).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

__global__ void sum_kernel(const __nv_bfloat16* c, int n, float* out) {
  float s = 0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += __bfloat162float(c[i]);
  atomicAdd(out, s);
}

#define PROBE_CHECK(x)                                          \
  do {                                                          \
    if (!(x)) {                                                 \
      std::fprintf(stderr, "initcheck_probe: %s failed\n", #x); \
      return 3;                                                 \
    }                                                           \
  } while (0)

}  // namespace

int main(int argc, char** argv) {
  const bool memset_first = argc > 1 && !std::strcmp(argv[1], "memset");
  const int m = 512, n = 24, k = 128, heads = 4;
  std::vector<__nv_bfloat16> a(size_t(m) * k * heads), b(size_t(k) * n * heads);
  for (size_t i = 0; i < a.size(); ++i) a[i] = __float2bfloat16(float((i * 7) % 13) / 13 - 0.5f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = __float2bfloat16(float((i * 5) % 11) / 11 - 0.5f);
  __nv_bfloat16 *da, *db, *dc;
  float* dsum;
  const size_t c_elems = size_t(m) * n * heads;
  PROBE_CHECK(cudaMalloc(&da, a.size() * 2) == cudaSuccess);
  PROBE_CHECK(cudaMalloc(&db, b.size() * 2) == cudaSuccess);
  PROBE_CHECK(cudaMalloc(&dc, c_elems * 2) == cudaSuccess);
  PROBE_CHECK(cudaMalloc(&dsum, 4) == cudaSuccess);
  PROBE_CHECK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  PROBE_CHECK(cudaMemcpy(db, b.data(), b.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  PROBE_CHECK(cudaMemset(dsum, 0, 4) == cudaSuccess);
  if (memset_first) PROBE_CHECK(cudaMemset(dc, 0, c_elems * 2) == cudaSuccess);
  cublasHandle_t h;
  PROBE_CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  const float one = 1, zero = 0;
  PROBE_CHECK(cublasGemmStridedBatchedEx(
                  h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, da, CUDA_R_16BF, m, int64_t(m) * k,
                  db, CUDA_R_16BF, k, int64_t(k) * n, &zero, dc, CUDA_R_16BF, m, int64_t(m) * n,
                  heads, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
  sum_kernel<<<1, 256>>>(dc, int(c_elems), dsum);
  PROBE_CHECK(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<__nv_bfloat16> c(c_elems);
  PROBE_CHECK(cudaMemcpy(c.data(), dc, c_elems * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
  double max_err = 0;
  for (int hd = 0; hd < heads; ++hd)
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < m; ++i) {
        double ref = 0;
        for (int p = 0; p < k; ++p)
          ref += double(__bfloat162float(a[size_t(hd) * m * k + size_t(p) * m + i])) *
                 double(__bfloat162float(b[size_t(hd) * k * n + size_t(j) * k + p]));
        const double got = __bfloat162float(c[size_t(hd) * m * n + size_t(j) * m + i]);
        max_err = std::fmax(max_err, std::fabs(got - ref) / (1 + std::fabs(ref)));
      }
  cublasDestroy(h);
  std::printf("initcheck_probe %s: max rel error %.2e\n", memset_first ? "memset" : "plain",
              max_err);
  return max_err < 1e-2 ? 0 : 1;
}
