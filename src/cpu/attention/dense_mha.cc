// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void dense_mha(const CpuContext& /*ctx*/, const DenseMhaArgs& /*args*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::dense_mha: not implemented yet");
}

}  // namespace dsakit::cpu
