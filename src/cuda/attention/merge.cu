// merge_partials: for each row (token, head), over the parts w with lse_w != +inf:
//   lse = m + log Σ_w exp(lse_w − m),  m = max_w lse_w;   o = Σ_w exp(lse_w − lse) · o_w.
// No valid part: o = 0, lse = +inf. A NaN lse_w makes the row NaN. Every valid part at -inf
// (zero mass): o = 0, lse = -inf. One 128-thread block per row; every thread computes the
// (cheap) part weights itself, then owns values d = tid, tid + 128, …; fixed summation order.
// Parts are f32 or bf16 (read as the f32 of the same value).
#include <cmath>

#include "src/cuda/attention/merge_kernels.h"
#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {
namespace {

constexpr int kThreads = 128;

template <typename PartT>
__global__ void __launch_bounds__(kThreads) merge_partials_kernel(const MergePartialsParams p) {
  const PartT* o_parts = static_cast<const PartT*>(p.o_parts);
  const int64_t row = blockIdx.x;
  float m = -INFINITY;
  bool any_valid = false, any_nan = false;
  for (int w = 0; w < p.parts; ++w) {
    const float l = p.lse_parts[w * p.rows + row];
    if (l == INFINITY) continue;
    any_valid = true;
    any_nan = any_nan || isnan(l);
    m = fmaxf(m, l);
  }
  float lse;
  if (!any_valid) {
    lse = INFINITY;
  } else if (any_nan) {
    lse = NAN;
  } else if (m == -INFINITY) {
    lse = -INFINITY;
  } else {
    float sum = 0.0f;
    for (int w = 0; w < p.parts; ++w) {
      const float l = p.lse_parts[w * p.rows + row];
      if (l != INFINITY) sum += expf(l - m);
    }
    lse = m + logf(sum);
  }
  const bool nan_row = isnan(lse);
  const bool weighted = any_valid && !nan_row && lse != -INFINITY;
  for (int e = threadIdx.x; e < p.d; e += kThreads) {
    float acc = nan_row ? NAN : 0.0f;
    if (weighted) {
      for (int w = 0; w < p.parts; ++w) {
        const float l = p.lse_parts[w * p.rows + row];
        if (l == INFINITY) continue;
        acc = fmaf(expf(l - lse), to_float(o_parts[(w * p.rows + row) * p.d + e]), acc);
      }
    }
    const int64_t out = row * p.d + e;
    if (p.o_f32) {
      static_cast<float*>(p.o)[out] = acc;
    } else {
      static_cast<bf16_t*>(p.o)[out] = f32_to_bf16(acc);
    }
  }
  if (threadIdx.x == 0) p.lse[row] = lse;
}

}  // namespace

cudaError_t launch_merge_partials(const MergePartialsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if (p.rows > INT32_MAX || p.parts < 1 || p.d < 0) return cudaErrorInvalidValue;
  if (p.o_parts_bf16)
    merge_partials_kernel<bf16_t><<<unsigned(p.rows), kThreads, 0, stream>>>(p);
  else
    merge_partials_kernel<float><<<unsigned(p.rows), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
