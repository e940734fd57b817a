// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void topk(const CpuContext& /*ctx*/, const TensorView& /*logits*/, const TensorView& /*ctx_len*/, int /*k*/, const TensorView& /*out*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::topk: not implemented yet");
}

}  // namespace dsakit::cpu
