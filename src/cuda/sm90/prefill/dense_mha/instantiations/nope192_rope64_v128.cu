// Dense MHA, d_nope 192, d_rope 64, d_v 128 (GLM-5 heads as two V column slices).
#include "src/cuda/sm90/prefill/dense_mha/dense_mha_kernel.cuh"

namespace dsakit::cuda::dense_mha {
template cudaError_t run_dense_mha<192, 64, 128>(const DenseMhaParams&, cudaStream_t);
}  // namespace dsakit::cuda::dense_mha
