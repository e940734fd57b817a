// Run-time h_i -> the compiled instances of the wgmma logits kernel (instances.h).
#include "src/cuda/attention/dispatch.h"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {

bool indexer_logits_sm90_supported(const IndexerLogitsParams& p) {
  return indexer_sm90::indexer_logits_sm90_accepts(p) &&
         attention::dispatch_indexer_logits_sm90(p.h_i, [](auto) {});
}

cudaError_t launch_indexer_logits_sm90(const IndexerLogitsParams& p, int key_splits, int sms,
                                       cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidConfiguration;
  attention::dispatch_indexer_logits_sm90(p.h_i, [&](auto heads) {
    status =
        indexer_sm90::run_indexer_logits_sm90<decltype(heads)::value>(p, key_splits, sms, stream);
  });
  return status;
}

}  // namespace dsakit::cuda
