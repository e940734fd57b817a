// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void indexer_quantize_q(const CpuContext& /*ctx*/, const TensorView& /*idx_q*/, const TensorView& /*idx_w*/, const TensorView& /*q8*/, const TensorView& /*gate*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::indexer_quantize_q: not implemented yet");
}

void indexer_logits(const CpuContext& /*ctx*/, const IndexerArgs& /*args*/, int64_t /*row_begin*/, int64_t /*row_end*/, const TensorView& /*logits*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::indexer_logits: not implemented yet");
}

void indexer_topk(const CpuContext& /*ctx*/, const TensorView& /*idx_q*/, const TensorView& /*idx_w*/, const IndexerArgs& /*layout*/, int /*k*/, const TensorView& /*out*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::indexer_topk: not implemented yet");
}

}  // namespace dsakit::cpu
