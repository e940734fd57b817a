// Run-time (h_i, operands) -> the compiled instances of the wgmma logits kernel (instances.h).
#include "src/cuda/attention/dispatch.h"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {

bool indexer_logits_sm90_supported(const IndexerLogitsParams& p, LogitsOperands ops) {
  return indexer_sm90::indexer_logits_sm90_accepts(p) &&
         attention::dispatch_indexer_logits_sm90(p.h_i, ops, [](auto, auto) {});
}

cudaError_t launch_indexer_logits_sm90(const IndexerLogitsParams& p, LogitsOperands ops,
                                       int key_splits, int sms, cudaStream_t stream) {
  cudaError_t status = cudaErrorInvalidConfiguration;
  attention::dispatch_indexer_logits_sm90(p.h_i, ops, [&](auto heads, auto operands) {
    status =
        indexer_sm90::run_indexer_logits_sm90<decltype(heads)::value, decltype(operands)::value>(
            p, key_splits, sms, stream);
  });
  return status;
}

}  // namespace dsakit::cuda
