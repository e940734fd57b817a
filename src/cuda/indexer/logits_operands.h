// The operand types of the wgmma indexer-logits kernel (src/cuda/sm90/indexer/): a template
// argument of its instances (src/cuda/attention/instances.h). Plain C++, no CUDA headers.
#pragma once

namespace dsakit::cuda {

enum class LogitsOperands {
  kE4m3,  // the stored e4m3 codes on e4m3 wgmma (fp8 accumulation, ~1e-4 rel-L2 from fp32)
  kF16,   // the codes widened to f16 (exact), f16 wgmma with fp32 accumulation
};

}  // namespace dsakit::cuda
