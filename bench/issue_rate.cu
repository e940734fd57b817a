// The issue rate of single instructions on one SM: how many warp instructions of a kind an SM
// retires per clock when nothing else runs. The FP8 sparse kernels widen every code they read
// (`F2FP.F16.E4M3.UNPACK_B`, a pair of codes each) beside their FMUL / PRMT / LOP3 work; these
// rates turn a kernel's SASS census per block into a floor (docs/perf.md).
//
// One CTA per SM (its dynamic shared memory keeps a second one off), 16 warps, each thread
// kChains independent chains advanced by the instruction kUnroll times an iteration (32
// instructions an iteration, kChains - 1 independent ones between two steps of a chain); the asm
// statements keep each as exactly one PTX instruction on run-time operands (nothing to fold).
// Thread 0 reads the SM's clock64 after a barrier on each side of the loop.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bench/issue_rate.h"

namespace dsakit::bench {
namespace {

constexpr int kThreads = 512, kChains = 8, kUnroll = 4;
constexpr size_t kSmemOneCta = 120 * 1024;  // over half of an SM's 228 KB: one CTA an SM

template <IssueOp kOp>
__device__ __forceinline__ uint32_t step(uint32_t x, uint32_t k1, uint32_t k2, int chain) {
  uint32_t y;
  if constexpr (kOp == IssueOp::kCvtE4m3 || kOp == IssueOp::kCvtLop3) {
    if (kOp == IssueOp::kCvtE4m3 || chain % 2 == 0) {
      asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(y) : "h"(uint16_t(x)));
      return y;
    }
    asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(y) : "r"(x), "r"(k1), "r"(k2));
  } else if constexpr (kOp == IssueOp::kFmul) {
    asm volatile(
        "{ .reg .f32 a, b; mov.b32 a, %1; mov.b32 b, %2; mul.rn.f32 a, a, b; "
        "mov.b32 %0, a; }"
        : "=r"(y)
        : "r"(x), "r"(k1));
  } else if constexpr (kOp == IssueOp::kHfma2) {
    asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k1), "r"(k2));
  } else if constexpr (kOp == IssueOp::kPrmt) {
    asm volatile("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(y) : "r"(x), "r"(k1));
  } else {
    asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(y) : "r"(x), "r"(k1), "r"(k2));
  }
  return y;
}

// cycles[blockIdx.x]: the SM's clocks for iters iterations of all 16 warps. sink is written only
// when the chains end on a value nobody chose (never, in practice): it keeps them live.
template <IssueOp kOp>
__global__ void __launch_bounds__(kThreads, 1)
    issue_rate_kernel(uint32_t k1, uint32_t k2, int iters, uint32_t* sink, long long* cycles) {
  uint32_t x[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) x[c] = k1 * (threadIdx.x + 1) + 0x9e3779b9u * c;
  __syncthreads();
  const long long t0 = clock64();
#pragma unroll 1
  for (int i = 0; i < iters; ++i)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int c = 0; c < kChains; ++c) x[c] = step<kOp>(x[c], k1, k2, c);
  __syncthreads();
  const long long t1 = clock64();
  uint32_t acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc ^= x[c];
  if (acc == k2) sink[blockIdx.x * kThreads + threadIdx.x] = acc;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <IssueOp kOp>
cudaError_t run(int num_sms, int iters, uint32_t* sink, long long* cycles, cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(
      issue_rate_kernel<kOp>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemOneCta));
  if (err != cudaSuccess) return err;
  issue_rate_kernel<kOp>
      <<<num_sms, kThreads, kSmemOneCta, stream>>>(0x3c003c01u, 0x00013c00u, iters, sink, cycles);
  return cudaGetLastError();
}

cudaError_t launch(IssueOp op, int num_sms, int iters, uint32_t* sink, long long* cycles,
                   cudaStream_t stream) {
  switch (op) {
    case IssueOp::kCvtE4m3:
      return run<IssueOp::kCvtE4m3>(num_sms, iters, sink, cycles, stream);
    case IssueOp::kFmul:
      return run<IssueOp::kFmul>(num_sms, iters, sink, cycles, stream);
    case IssueOp::kHfma2:
      return run<IssueOp::kHfma2>(num_sms, iters, sink, cycles, stream);
    case IssueOp::kPrmt:
      return run<IssueOp::kPrmt>(num_sms, iters, sink, cycles, stream);
    case IssueOp::kLop3:
      return run<IssueOp::kLop3>(num_sms, iters, sink, cycles, stream);
    case IssueOp::kCvtLop3:
      return run<IssueOp::kCvtLop3>(num_sms, iters, sink, cycles, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

const char* issue_op_name(IssueOp op) {
  switch (op) {
    case IssueOp::kCvtE4m3:
      return "cvt e4m3x2->f16x2 (F2FP)";
    case IssueOp::kFmul:
      return "FMUL";
    case IssueOp::kHfma2:
      return "HFMA2";
    case IssueOp::kPrmt:
      return "PRMT";
    case IssueOp::kLop3:
      return "LOP3";
    case IssueOp::kCvtLop3:
      return "F2FP + LOP3, half each";
  }
  return "?";
}

cudaError_t measure_issue_rate(IssueOp op, int num_sms, std::vector<double>& per_sm,
                               cudaStream_t stream) {
  per_sm.clear();
  constexpr int kIters = 4096;  // 16 warps x 4096 x 32 instructions: ~2M warp instructions an SM
  uint32_t* sink = nullptr;
  long long* cycles = nullptr;
  cudaError_t err = cudaMalloc(&sink, size_t(num_sms) * kThreads * sizeof(uint32_t));
  if (err == cudaSuccess) err = cudaMalloc(&cycles, size_t(num_sms) * sizeof(long long));
  // A short warm-up launch, then the timed one.
  if (err == cudaSuccess) err = launch(op, num_sms, 64, sink, cycles, stream);
  if (err == cudaSuccess) err = launch(op, num_sms, kIters, sink, cycles, stream);
  std::vector<long long> host(num_sms > 0 ? num_sms : 0);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(host.data(), cycles, host.size() * sizeof(long long),
                          cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaFree(sink);
  cudaFree(cycles);
  if (err != cudaSuccess) return err;
  const double instructions = double(kThreads / 32) * kIters * kUnroll * kChains;
  for (long long c : host) per_sm.push_back(c > 0 ? instructions / double(c) : 0.0);
  return cudaSuccess;
}

}  // namespace dsakit::bench
