// Sparse MLA, head groups of 16, fp8 pool rows.
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {
template cudaError_t run_sparse_mla<16, KvLayout::kFp8Scaled>(const SparseMlaParams&, cudaStream_t);
}  // namespace dsakit::cuda::sparse_mla
