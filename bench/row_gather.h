// Launcher of the row-gather microbenchmark (bench/row_gather.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::bench {

struct RowGatherParams {
  const uint8_t* pool;         // [num_locations, row_bytes]
  const int32_t* indices;      // [T, topk] pool locations; < 0 or >= num_locations: skipped
  const int32_t* topk_length;  // [T] or nullptr
  int64_t num_tokens;          // T
  int64_t num_locations;
  int row_bytes;  // a pool layout's: 1152, 656 or 576
  int topk;
  int ctas_per_token;  // the kernel's CTAs per token (head groups), each gathering all
};

cudaError_t launch_row_gather(const RowGatherParams& p, cudaStream_t stream);

}  // namespace dsakit::bench
