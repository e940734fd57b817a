// Run-time values -> compile-time template arguments for the attention kernels (the pool
// layout goes through DSAKIT_DISPATCH_KV_LAYOUT of src/cuda/common/dispatch.h). Each dispatcher
// calls f with std::integral_constant arguments for a compiled combination and returns false
// (calling nothing) for any other; the caller turns false into Error(kUnsupported).
#pragma once

#include <type_traits>

#include "dsakit/pool.h"
#include "src/cuda/attention/dense_dims.h"

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

// Dense MHA (d_nope, d_rope, d_v): the instances listed in dense_dims.h.
template <typename F>
bool dispatch_dense_dims(int d_nope, int d_rope, int d_v, F&& f) {
#define DSAKIT_DENSE_DIMS_CASE(n, r, v)                                   \
  if (d_nope == n && d_rope == r && d_v == v) {                           \
    f(std::integral_constant<int, n>{}, std::integral_constant<int, r>{}, \
      std::integral_constant<int, v>{});                                  \
    return true;                                                          \
  }
  DSAKIT_DENSE_MHA_DIMS(DSAKIT_DENSE_DIMS_CASE)
#undef DSAKIT_DENSE_DIMS_CASE
  return false;
}

}  // namespace dsakit::cuda::attention
