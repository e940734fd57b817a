// Launcher of merge_partials (docs/layer.md, context parallelism; split-KV): W partial attention
// results merged by lse.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda {

struct MergePartialsParams {
  const float* o_parts;    // [parts, rows, d], rows = T * H
  const float* lse_parts;  // [parts, rows] natural log; +inf = the part saw no valid key
  void* o;                 // [rows, d] f32 if o_f32 else bf16
  float* lse;              // [rows]
  bool o_f32;
  int64_t rows;
  int parts;
  int d;
};

cudaError_t launch_merge_partials(const MergePartialsParams& p, cudaStream_t stream);

}  // namespace dsakit::cuda
