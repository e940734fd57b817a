// PLACEHOLDER: replaced by the real kernels; throws until then.
#include "dsakit/error.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {

void store_kv(const CpuContext& /*ctx*/, PagedKvPool& /*pool*/, const TensorView& /*locs*/, const TensorView& /*c_kv*/, const TensorView& /*k_pe*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::store_kv: not implemented yet");
}

void gather_kv(const CpuContext& /*ctx*/, const PagedKvPool& /*pool*/, const TensorView& /*locs*/, const TensorView& /*c_kv*/, const TensorView& /*k_pe*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::gather_kv: not implemented yet");
}

void store_index_keys(const CpuContext& /*ctx*/, IndexKeyPool& /*pool*/, const TensorView& /*locs*/, const TensorView& /*idx_k*/) {
  DSAKIT_FAIL(kUnsupported, "cpu::store_index_keys: not implemented yet");
}

}  // namespace dsakit::cpu
