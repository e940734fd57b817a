// Sparse MLA, head groups of 64, fp8raw pool rows.
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {
template cudaError_t run_sparse_mla<64, KvLayout::kFp8Raw>(const SparseMlaParams&, cudaStream_t);
}  // namespace dsakit::cuda::sparse_mla
