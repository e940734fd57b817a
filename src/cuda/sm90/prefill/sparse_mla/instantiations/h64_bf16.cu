// Sparse MLA, head groups of 64, bf16 pool rows.
#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {
template cudaError_t run_sparse_mla<64, KvLayout::kBf16>(const SparseMlaParams&, cudaStream_t);
}  // namespace dsakit::cuda::sparse_mla
