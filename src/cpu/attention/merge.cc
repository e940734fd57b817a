// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void merge_partials(const CpuContext& /*ctx*/, const TensorView& /*o_parts*/, const TensorView& /*lse_parts*/, const TensorView& /*o*/, const TensorView& /*lse*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::merge_partials: not implemented yet");
}

}  // namespace dsakit::cpu
