// Run-time values -> compile-time template arguments for the attention kernels (the pool
// layout goes through DSAKIT_DISPATCH_KV_LAYOUT of src/cuda/common/dispatch.h). Each dispatcher
// calls f with std::integral_constant arguments for a compiled combination and returns false
// (calling nothing) for any other; the caller turns false into Error(kUnsupported).
#pragma once

#include <type_traits>

#include "dsakit/pool.h"

namespace dsakit::cuda::attention {

// Sparse MLA head groups: 16 heads per CTA for H <= 16 (TP shards), else 64 (masked tail).
inline int sparse_mla_heads_per_cta(int num_heads) {
  return num_heads <= 16 ? 16 : 64;
}

template <typename F>
bool dispatch_heads_per_cta(int heads_per_cta, F&& f) {
  switch (heads_per_cta) {
    case 16:
      f(std::integral_constant<int, 16>{});
      return true;
    case 64:
      f(std::integral_constant<int, 64>{});
      return true;
    default:
      return false;
  }
}

// Dense MHA (d_nope, d_rope, d_v): DeepSeek-V3.2 (128, 64, 128) and GLM-5 (192, 64, 256); the
// (192, 64, 128) instance also runs GLM-5's short grids as two V column slices per head.
inline constexpr const char* kDenseMhaSupportedDims =
    "(128, 64, 128), (192, 64, 128), (192, 64, 256)";

template <typename F>
bool dispatch_dense_dims(int d_nope, int d_rope, int d_v, F&& f) {
  if (d_nope == 128 && d_rope == 64 && d_v == 128) {
    f(std::integral_constant<int, 128>{}, std::integral_constant<int, 64>{},
      std::integral_constant<int, 128>{});
    return true;
  }
  if (d_nope == 192 && d_rope == 64 && d_v == 128) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 64>{},
      std::integral_constant<int, 128>{});
    return true;
  }
  if (d_nope == 192 && d_rope == 64 && d_v == 256) {
    f(std::integral_constant<int, 192>{}, std::integral_constant<int, 64>{},
      std::integral_constant<int, 256>{});
    return true;
  }
  return false;
}

}  // namespace dsakit::cuda::attention
