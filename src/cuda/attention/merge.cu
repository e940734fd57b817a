// merge_partials: for each row (token, head), over the parts w with lse_w != +inf:
//   lse = m + log Σ_w exp(lse_w − m),  m = max_w lse_w;   o = Σ_w exp(lse_w − lse) · o_w.
// No valid part: o = 0, lse = +inf. A NaN lse_w makes the row NaN. Every valid part at -inf
// (zero mass): o = 0, lse = -inf. One warp per row, kRowsPerCta rows per CTA: every lane computes
// the (cheap) part weights itself from the parts' lse (one broadcast load each), then owns values
// in runs of four, d = 4 (lane + 32 i), by 16-byte (f32) / 8-byte (bf16) loads and stores when
// every row starts 4-value aligned (kVec4), else values d = lane + 32 i. Each value sums its parts
// in the order w = 0, 1, …: fixed summation order, the same arithmetic on both paths.
// Parts are f32 or bf16 (read as the f32 of the same value). With segments (dense split-KV, only
// the long tiles split) a warp's row is found by a binary search of the segments' merged_begin.
#include <cmath>

#include "src/cuda/attention/merge_kernels.h"
#include "src/cuda/common/device_utils.cuh"

namespace dsakit::cuda {
namespace {

constexpr int kRowsPerCta = 8, kThreads = 32 * kRowsPerCta;

struct RowWeights {
  float lse;
  bool nan_row;   // o = NaN
  bool weighted;  // o = Σ_w exp(lse_w − lse) · o_w; else o = 0 (or NaN)
};

__device__ __forceinline__ RowWeights row_weights(const MergePartialsParams& p, int64_t row,
                                                  int parts) {
  float m = -INFINITY;
  bool any_valid = false, any_nan = false;
  for (int w = 0; w < parts; ++w) {
    const float l = p.lse_parts[w * p.rows + row];
    if (l == INFINITY) continue;
    any_valid = true;
    any_nan = any_nan || isnan(l);
    m = fmaxf(m, l);
  }
  RowWeights r;
  if (!any_valid) {
    r.lse = INFINITY;
  } else if (any_nan) {
    r.lse = NAN;
  } else if (m == -INFINITY) {
    r.lse = -INFINITY;
  } else {
    float sum = 0.0f;
    for (int w = 0; w < parts; ++w) {
      const float l = p.lse_parts[w * p.rows + row];
      if (l != INFINITY) sum += expf(l - m);
    }
    r.lse = m + logf(sum);
  }
  r.nan_row = isnan(r.lse);
  r.weighted = any_valid && !r.nan_row && r.lse != -INFINITY;
  return r;
}

__device__ __forceinline__ void load4(const float* src, float (&v)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(src);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void load4(const bf16_t* src, float (&v)[4]) {
  load_bf16x4_aligned(src, v);  // kVec4: every run of four starts 8-byte aligned
}

// Output values [out, out + 4) (16-byte aligned f32 / 8-byte aligned bf16).
__device__ __forceinline__ void store4(const MergePartialsParams& p, int64_t out,
                                       const float (&v)[4]) {
  if (p.o_f32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p.o) + out) =
        make_float4(v[0], v[1], v[2], v[3]);
  } else {
    uint32_t b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = f32_to_bf16(v[j]).bits;
    *reinterpret_cast<uint2*>(static_cast<bf16_t*>(p.o) + out) =
        make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
  }
}

template <typename PartT, bool kVec4>
__global__ void __launch_bounds__(kThreads)
    merge_partials_kernel(const __grid_constant__ MergePartialsParams p) {
  const PartT* o_parts = static_cast<const PartT*>(p.o_parts);
  const int lane = threadIdx.x % 32;
  int64_t row = 0;
  int parts = 0;
  if (!merged_row(p, int64_t(blockIdx.x) * kRowsPerCta + threadIdx.x / 32, row, parts)) return;
  const RowWeights rw = row_weights(p, row, parts);
  constexpr int kRun = kVec4 ? 4 : 1;  // values per lane per step
  for (int e = kRun * lane; e < p.d; e += 32 * kRun) {
    float acc[kRun];
#pragma unroll
    for (int j = 0; j < kRun; ++j) acc[j] = rw.nan_row ? NAN : 0.0f;
    if (rw.weighted) {
      for (int w = 0; w < parts; ++w) {
        const float l = p.lse_parts[w * p.rows + row];
        if (l == INFINITY) continue;
        const float weight = expf(l - rw.lse);
        const PartT* src = o_parts + (w * p.rows + row) * p.d + e;
        float v[4];
        if constexpr (kVec4) {
          load4(src, v);
        } else {
          v[0] = to_float(*src);
        }
#pragma unroll
        for (int j = 0; j < kRun; ++j) acc[j] = fmaf(weight, v[j], acc[j]);
      }
    }
    const int64_t out = row * p.d + e;
    if constexpr (kVec4) {
      store4(p, out, acc);
    } else if (p.o_f32) {
      static_cast<float*>(p.o)[out] = acc[0];
    } else {
      static_cast<bf16_t*>(p.o)[out] = f32_to_bf16(acc[0]);
    }
  }
  if (lane == 0) p.lse[row] = rw.lse;
}

bool aligned(const void* ptr, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <typename PartT>
cudaError_t launch(const MergePartialsParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_segments == 0 ? p.rows : p.merged_rows;
  const unsigned ctas = unsigned((rows + kRowsPerCta - 1) / kRowsPerCta);
  const bool vec4 =
      p.d % 4 == 0 && aligned(p.o_parts, 4 * sizeof(PartT)) && aligned(p.o, p.o_f32 ? 16 : 8);
  if (vec4)
    merge_partials_kernel<PartT, true><<<ctas, kThreads, 0, stream>>>(p);
  else
    merge_partials_kernel<PartT, false><<<ctas, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_merge_partials(const MergePartialsParams& p, cudaStream_t stream) {
  if (p.rows == 0 || (p.num_segments > 0 && p.merged_rows == 0)) return cudaSuccess;
  if (p.rows > INT32_MAX || p.parts < 1 || p.d < 0 || p.num_segments < 0 ||
      p.num_segments > kMergeMaxSegments || p.merged_rows < 0)
    return cudaErrorInvalidValue;
  return p.o_parts_bf16 ? launch<bf16_t>(p, stream) : launch<float>(p, stream);
}

}  // namespace dsakit::cuda
