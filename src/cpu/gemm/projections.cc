// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void absorb_q(const CpuContext& /*ctx*/, const TensorView& /*q_nope*/, const TensorView& /*kv_b_proj*/, int /*d_v*/, const TensorView& /*q_abs*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::absorb_q: not implemented yet");
}

void up_proj_v(const CpuContext& /*ctx*/, const TensorView& /*o_lat*/, const TensorView& /*kv_b_proj*/, int /*d_nope*/, const TensorView& /*o*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::up_proj_v: not implemented yet");
}

void up_proj_kv(const CpuContext& /*ctx*/, const TensorView& /*c_kv*/, const TensorView& /*kv_b_proj*/, const TensorView& /*k_nope*/, const TensorView& /*v*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::up_proj_kv: not implemented yet");
}

}  // namespace dsakit::cpu
