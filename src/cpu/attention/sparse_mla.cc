// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void sparse_mla(const CpuContext& /*ctx*/, const SparseMlaArgs& /*args*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::sparse_mla: not implemented yet");
}

}  // namespace dsakit::cpu
