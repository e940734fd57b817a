// Runtime value -> constexpr template argument, in one place. Each macro runs its body with a
// constexpr (or type alias) bound to the case; an unlisted value returns `on_error` from the
// enclosing function (launchers return cudaErrorInvalidValue; the backend validated first).
#pragma once

#include "dsakit/pool.h"

// DSAKIT_DISPATCH_KV_LAYOUT(layout, LAYOUT, on_error, body...): LAYOUT is a constexpr KvLayout.
#define DSAKIT_DISPATCH_KV_LAYOUT(layout, LAYOUT, on_error, ...)            \
  switch (layout) {                                                         \
    case ::dsakit::KvLayout::kBf16: {                                       \
      constexpr ::dsakit::KvLayout LAYOUT = ::dsakit::KvLayout::kBf16;      \
      __VA_ARGS__;                                                          \
    } break;                                                                \
    case ::dsakit::KvLayout::kFp8Scaled: {                                  \
      constexpr ::dsakit::KvLayout LAYOUT = ::dsakit::KvLayout::kFp8Scaled; \
      __VA_ARGS__;                                                          \
    } break;                                                                \
    case ::dsakit::KvLayout::kFp8Raw: {                                     \
      constexpr ::dsakit::KvLayout LAYOUT = ::dsakit::KvLayout::kFp8Raw;    \
      __VA_ARGS__;                                                          \
    } break;                                                                \
    default:                                                                \
      return on_error;                                                      \
  }

// DSAKIT_DISPATCH_OUT_TYPE(is_f32, OutT, body...): OutT is float or dsakit::bf16_t.
#define DSAKIT_DISPATCH_OUT_TYPE(is_f32, OutT, ...) \
  if (is_f32) {                                     \
    using OutT = float;                             \
    __VA_ARGS__;                                    \
  } else {                                          \
    using OutT = ::dsakit::bf16_t;                  \
    __VA_ARGS__;                                    \
  }
