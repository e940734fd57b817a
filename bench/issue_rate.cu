// The issue rate of single instructions on one SM: how many warp instructions of a kind an SM
// retires per clock when nothing else runs. The FP8 sparse kernels widen every code they read
// (`F2FP.F16.E4M3.UNPACK_B`, a pair of codes each, or by bits: e4m3_pair_by_bits' three
// integer instructions) beside their FMUL / PRMT / LOP3 work; these rates turn a kernel's SASS
// census per block into a floor (docs/perf.md).
//
// One CTA per SM (its dynamic shared memory keeps a second one off), 16 warps, each thread
// kChains independent chains advanced by a step kUnroll times an iteration (32 steps an
// iteration, kChains - 1 independent ones between two steps of a chain); a step is one
// instruction (the asm statements keep each exactly one PTX instruction on run-time operands:
// nothing to fold) or the bit widening's three dependent ones.
// Thread 0 reads the SM's clock64 after a barrier on each side of the loop.
#include <cuda_runtime.h>

#include <cstdint>
#include <iterator>
#include <vector>

#include "bench/issue_rate.h"

namespace dsakit::bench {
namespace {

constexpr int kThreads = 512, kChains = 8, kUnroll = 4;
constexpr size_t kSmemOneCta = 120 * 1024;  // over half of an SM's 228 KB: one CTA an SM

__device__ __forceinline__ uint32_t cvt_e4m3x2(uint32_t x) {
  uint32_t y;
  asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(y) : "h"(uint16_t(x)));
  return y;
}
__device__ __forceinline__ uint32_t lop3_xor(uint32_t x, uint32_t k1, uint32_t k2) {
  uint32_t y;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(y) : "r"(x), "r"(k1), "r"(k2));
  return y;
}
// The widening by bits (perf.md, run AM1): byte j of a and of b, e4m3 codes, as one f16 pair of
// value code · 2^-8 — a sign-replicating PRMT (bit 3 of a selector nibble; __byte_perm has no
// such bit), a shift (IMAD.SHL) and a mask (LOP3).
__device__ __forceinline__ uint32_t e4m3_pair_by_bits(uint32_t a, uint32_t b, int j) {
  const uint32_t sel =
      uint32_t(j) | (uint32_t(j | 8) << 4) | (uint32_t(4 + j) << 8) | (uint32_t((4 + j) | 8) << 12);
  uint32_t t;
  asm volatile("prmt.b32 %0, %1, %2, %3;" : "=r"(t) : "r"(a), "r"(b), "r"(sel));
  return (t << 7) & 0xbf80bf80u;
}

__device__ __forceinline__ uint32_t fmul(uint32_t x, uint32_t k1) {
  uint32_t y;
  asm volatile(
      "{ .reg .f32 a, b; mov.b32 a, %1; mov.b32 b, %2; mul.rn.f32 a, a, b; mov.b32 %0, a; }"
      : "=r"(y)
      : "r"(x), "r"(k1));
  return y;
}
__device__ __forceinline__ uint32_t hfma2(uint32_t x, uint32_t k1, uint32_t k2) {
  uint32_t y;
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k1), "r"(k2));
  return y;
}
// A run-time multiplier: a chain of constant shifts would fold into one.
__device__ __forceinline__ uint32_t imad(uint32_t x, uint32_t k1, uint32_t k2) {
  uint32_t y;
  asm volatile("mad.lo.u32 %0, %1, %2, %3;" : "=r"(y) : "r"(x), "r"(k1), "r"(k2));
  return y;
}
__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t k1) {
  uint32_t y;
  asm volatile("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(y) : "r"(x), "r"(k1));
  return y;
}

// One step of chain `chain` (the interleaved ops: the even chains the first op, the odd the
// second).
template <IssueOp kOp>
__device__ __forceinline__ uint32_t step(uint32_t x, uint32_t k1, uint32_t k2, int chain) {
  const bool even = chain % 2 == 0;
  switch (kOp) {
    case IssueOp::kCvtE4m3:
      return cvt_e4m3x2(x);
    case IssueOp::kFmul:
      return fmul(x, k1);
    case IssueOp::kHfma2:
      return hfma2(x, k1, k2);
    case IssueOp::kPrmt:
      return prmt(x, k1);
    case IssueOp::kLop3:
      return lop3_xor(x, k1, k2);
    case IssueOp::kCvtLop3:
      return even ? cvt_e4m3x2(x) : lop3_xor(x, k1, k2);
    case IssueOp::kImad:
      return imad(x, k1, k2);
    case IssueOp::kBits:
      return e4m3_pair_by_bits(x, k1, chain % 4);
    case IssueOp::kCvtBits:
      return even ? cvt_e4m3x2(x) : e4m3_pair_by_bits(x, k1, chain % 4);
  }
  return x;
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

// The kernel and the name of each IssueOp, in the enum's order.
using IssueRateKernel = void (*)(uint32_t, uint32_t, int, uint32_t*, long long*);
struct IssueOpEntry {
  IssueRateKernel kernel;
  const char* name;
  double instructions;  // a step's, on average over the chains
};
constexpr IssueOpEntry kEntries[] = {
    {issue_rate_kernel<IssueOp::kCvtE4m3>, "cvt e4m3x2->f16x2 (F2FP)", 1},
    {issue_rate_kernel<IssueOp::kFmul>, "FMUL", 1},
    {issue_rate_kernel<IssueOp::kHfma2>, "HFMA2", 1},
    {issue_rate_kernel<IssueOp::kPrmt>, "PRMT", 1},
    {issue_rate_kernel<IssueOp::kLop3>, "LOP3", 1},
    {issue_rate_kernel<IssueOp::kCvtLop3>, "F2FP + LOP3, half each", 1},
    {issue_rate_kernel<IssueOp::kImad>, "IMAD", 1},
    {issue_rate_kernel<IssueOp::kBits>, "e4m3 pair by bits (3 instr)", 3},
    {issue_rate_kernel<IssueOp::kCvtBits>, "F2FP + by bits, half each", 2},
};
static_assert(std::size(kEntries) == std::size(kIssueOps));

cudaError_t launch(IssueOp op, int num_sms, int iters, uint32_t* sink, long long* cycles,
                   cudaStream_t stream) {
  const IssueRateKernel kernel = kEntries[int(op)].kernel;
  const cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemOneCta));
  if (err != cudaSuccess) return err;
  kernel<<<num_sms, kThreads, kSmemOneCta, stream>>>(0x3c003c01u, 0x00013c00u, iters, sink, cycles);
  return cudaGetLastError();
}

}  // namespace

const char* issue_op_name(IssueOp op) {
  return kEntries[int(op)].name;
}
double issue_op_instructions(IssueOp op) {
  return kEntries[int(op)].instructions;
}

cudaError_t measure_issue_rate(IssueOp op, int num_sms, std::vector<double>& per_sm,
                               cudaStream_t stream) {
  per_sm.clear();
  constexpr int kIters = 4096;  // 16 warps x 4096 x 32 steps: ~2M warp steps an SM
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
  const double instructions =
      double(kThreads / 32) * kIters * kUnroll * kChains * kEntries[int(op)].instructions;
  for (long long c : host) per_sm.push_back(c > 0 ? instructions / double(c) : 0.0);
  return cudaSuccess;
}

}  // namespace dsakit::bench
