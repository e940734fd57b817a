// Run-time value -> compile-time template argument. Each dispatcher calls f with a
// std::integral_constant for a known value and returns false, calling nothing, for any other:
// launchers turn false into cudaErrorInvalidValue, the backend's ops into Error(kUnsupported).
// The attention kernels' instance dispatchers (src/cuda/attention/dispatch.h) follow the same
// convention.
#pragma once

#include <type_traits>

#include "dsakit/formats.h"

namespace dsakit::cuda {

template <KvLayout kLayout>
using KvLayoutConstant = std::integral_constant<KvLayout, kLayout>;

template <typename F>
bool dispatch_kv_layout(KvLayout layout, F&& f) {
  switch (layout) {
    case KvLayout::kBf16:
      f(KvLayoutConstant<KvLayout::kBf16>{});
      return true;
    case KvLayout::kFp8Scaled:
      f(KvLayoutConstant<KvLayout::kFp8Scaled>{});
      return true;
    case KvLayout::kFp8Raw:
      f(KvLayoutConstant<KvLayout::kFp8Raw>{});
      return true;
  }
  return false;
}

}  // namespace dsakit::cuda
