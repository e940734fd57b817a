// The (d_nope, d_rope, d_v) the dense MHA kernel is instantiated for
// (src/cuda/sm90/prefill/dense_mha/instantiations/*.cu): one list for the kernel dispatch
// (dispatch_dense_dims), the planner's capability table (cuda_capabilities, which must work in
// builds without CUDA, hence no CUDA includes here) and the messages that name the choices.
#pragma once

#include <array>
#include <string>

// X(d_nope, d_rope, d_v) for each instance: DeepSeek-V3.2, GLM-5.
#define DSAKIT_DENSE_MHA_DIMS(X) X(128, 64, 128) X(192, 64, 256)

namespace dsakit::cuda {

#define DSAKIT_DENSE_DIMS_ENTRY(n, r, v) std::array<int, 3>{n, r, v},
inline constexpr std::array kDenseMhaDims = {DSAKIT_DENSE_MHA_DIMS(DSAKIT_DENSE_DIMS_ENTRY)};
#undef DSAKIT_DENSE_DIMS_ENTRY

// "(128, 64, 128), (192, 64, 256)"
inline std::string dense_mha_dims_str() {
  std::string s;
  for (const auto& d : kDenseMhaDims)
    s += (s.empty() ? "(" : ", (") + std::to_string(d[0]) + ", " + std::to_string(d[1]) + ", " +
         std::to_string(d[2]) + ")";
  return s;
}

}  // namespace dsakit::cuda
