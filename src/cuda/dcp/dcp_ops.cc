// The CUDA backend's context-parallelism ops (include/dsakit/backend.h): validation, then the
// kernels of dcp_kernels.cu on the backend's stream.
#include "dsakit/error.h"
#include "src/core/validate.h"
#include "src/cuda/common/check.h"
#include "src/cuda/cuda_backend.h"
#include "src/cuda/dcp/dcp_kernels.h"

namespace dsakit::cuda {

void CudaBackend::select_rows(const TensorView& src, const TensorView& rows,
                              const TensorView& dst) {
  activate();
  const HostIndexValues host_rows = host_index_values(rows);
  validate::select_rows(src, rows, dst, Device::kCuda, host_rows.data);
  const int64_t m = rows.shape[0];
  const SelectRowsParams p{src.data, rows.ptr<const int32_t>(),
                           dst.data, src.shape[0],
                           m,        m == 0 ? 0 : int64_t(dst.nbytes()) / m};
  DSAKIT_CUDA_CHECK(launch_select_rows(p, stream_));
}

void CudaBackend::merge_topk(const TensorView& scores, const TensorView& positions, int k,
                             const TensorView& out) {
  activate();
  validate::merge_topk(scores, positions, k, out, Device::kCuda);
  static_assert(cuda::kMergeTopkMaxCandidates == Backend::kMergeTopkMaxCandidates);
  const MergeTopkParams p{scores.ptr<const float>(),
                          positions.ptr<const int32_t>(),
                          out.ptr<int32_t>(),
                          scores.shape[1],
                          int(scores.shape[0]),
                          int(scores.shape[2]),
                          k};
  DSAKIT_CUDA_CHECK(launch_merge_topk(p, stream_));
}

}  // namespace dsakit::cuda
