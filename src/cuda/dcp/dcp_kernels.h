// Launchers of the context-parallelism kernels (docs/layer.md): row selection and the merge of
// the shards' top-k candidates. Plain parameter structs; every index read from device memory is
// bound-checked in the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda {

struct SelectRowsParams {
  const void* src;      // [n, row_bytes]
  const int32_t* rows;  // [m] rows of src; an entry outside [0, n) leaves its dst row unwritten
  void* dst;            // [m, row_bytes]: dst[i] = src[rows[i]]
  int64_t n;
  int64_t m;
  int64_t row_bytes;
};

// The most candidates a row of merge_topk may have (shards * c): its keys, padded to a power of
// two, fill 128 KiB of dynamic shared memory.
inline constexpr int kMergeTopkMaxCandidates = 16384;

struct MergeTopkParams {
  const float* scores;       // [shards, tokens, c]; none read of a row with <= k candidates
  const int32_t* positions;  // [shards, tokens, c]; < 0: no candidate. Distinct within a row.
  int32_t* out;              // [tokens, k] the k best positions ascending, -1 padded
  int64_t tokens;
  int shards;
  int c;  // shards * c in [1, kMergeTopkMaxCandidates]
  int k;  // >= 1
};

cudaError_t launch_select_rows(const SelectRowsParams& p, cudaStream_t stream);
cudaError_t launch_merge_topk(const MergeTopkParams& p, cudaStream_t stream);

}  // namespace dsakit::cuda
