// Launcher of merge_partials (docs/layer.md, context parallelism; split-KV): W partial attention
// results merged by lse.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda {

struct MergePartialsParams {
  const void* o_parts;     // [parts, rows, d], rows = T * H; bf16 if o_parts_bf16 else f32
  const float* lse_parts;  // [parts, rows] natural log; +inf = the part saw no valid key
  void* o;                 // [rows, d] f32 if o_f32 else bf16
  float* lse;              // [rows]
  bool o_f32;
  int64_t rows;
  int parts;
  int d;
  bool o_parts_bf16;  // bf16 parts are widened exactly: they merge as f32 parts of those values
};

cudaError_t launch_merge_partials(const MergePartialsParams& p, cudaStream_t stream);

}  // namespace dsakit::cuda
