// Run-time values -> the compiled attention kernel instances of src/cuda/attention/instances.h.
// Each dispatcher calls f with std::integral_constant arguments for a row of the table and
// returns false, calling nothing, for any other (src/cuda/common/dispatch.h's convention); the
// *_supported() strings name the rows for kUnsupported messages and `dsakit info`. Free of CUDA
// headers: cuda_capabilities() (src/core/backend.cc, built without CUDA too) reads it.
#pragma once

#include <string>
#include <type_traits>

#include "dsakit/pool.h"
#include "src/cuda/attention/instances.h"
#include "src/cuda/indexer/logits_operands.h"

namespace dsakit::cuda::attention {

// Sparse MLA (mma.sync) head groups: 16 heads per CTA for H <= 16 (TP shards), else 64 (a
// masked tail for H not a multiple of 64).
inline int sparse_mla_heads_per_cta(int num_heads) {
  return num_heads <= 16 ? 16 : 64;
}

// One row of a sparse table of (heads, layout) rows: (heads, layout) -> f(integral constants).
#define DSAKIT_X_SPARSE_MLA_HEADS(kHeads, kLayout)            \
  if (heads == kHeads && layout == KvLayout::kLayout) {       \
    f(std::integral_constant<int, kHeads>{},                  \
      std::integral_constant<KvLayout, KvLayout::kLayout>{}); \
    return true;                                              \
  }

template <typename F>
bool dispatch_sparse_mla_sm80(int heads, KvLayout layout, F&& f) {  // heads per CTA
  DSAKIT_SPARSE_MLA_SM80_INSTANCES(DSAKIT_X_SPARSE_MLA_HEADS)
  return false;
}

// One row of a wgmma sparse table: layout -> f(integral constant).
#define DSAKIT_X_SPARSE_MLA_SM90(kLayout)                     \
  if (layout == KvLayout::kLayout) {                          \
    f(std::integral_constant<KvLayout, KvLayout::kLayout>{}); \
    return true;                                              \
  }

template <typename F>
bool dispatch_sparse_mla_sm90(KvLayout layout, F&& f) {
  DSAKIT_SPARSE_MLA_SM90_INSTANCES(DSAKIT_X_SPARSE_MLA_SM90)
  return false;
}

// The keys-on-M wgmma kernel: its work item on bf16 pools (the largest H it runs there), and
// the largest H it runs by default on FP8 pools (against the 64-head kernel, docs/perf.md run
// AA4: ahead at 32 heads on both FP8 layouts, far behind at 64), up to which the layer reads
// fp8-raw pools without a bf16 copy (Capabilities::sparse_reads_fp8_raw_heads, run AL1).
inline constexpr int kSparseMlaSm90FewHeads = 16;
inline constexpr int kSparseMlaSm90FewHeadsFp8 = 32;
// Whether the keys-on-M kernel runs H heads on this layout when forced (16-head items): the FP8
// ones take any H (few_heads_fp8_kernel.cuh), the bf16 one H <= 16.
inline bool sparse_mla_sm90_few_heads_take(KvLayout layout, int64_t num_heads) {
  return num_heads <= kSparseMlaSm90FewHeads || layout != KvLayout::kBf16;
}
// Whether it runs H heads on this layout by default (else the 64-head kernel does).
inline bool sparse_mla_sm90_few_heads_by_default(KvLayout layout, int64_t num_heads) {
  return num_heads <=
         (layout == KvLayout::kBf16 ? kSparseMlaSm90FewHeads : kSparseMlaSm90FewHeadsFp8);
}
// The keys-on-M rows: (heads per work item, layout).
template <typename F>
bool dispatch_sparse_mla_sm90_few_heads(int heads, KvLayout layout, F&& f) {
  DSAKIT_SPARSE_MLA_SM90_FEW_HEADS_INSTANCES(DSAKIT_X_SPARSE_MLA_HEADS)
  return false;
}
#undef DSAKIT_X_SPARSE_MLA_SM90
#undef DSAKIT_X_SPARSE_MLA_HEADS

// Its work item by default: 32 heads for fp8-raw pools past 16 heads where that row is compiled
// (1.31-1.33x the 16-head items at 32 heads, docs/perf.md run AK2), else 16.
inline int sparse_mla_sm90_few_heads_item(KvLayout layout, int64_t num_heads) {
  return layout == KvLayout::kFp8Raw && num_heads > 16 &&
                 dispatch_sparse_mla_sm90_few_heads(32, layout, [](auto, auto) {})
             ? 32
             : 16;
}

// One dense MHA row: (d_nope, d_rope, d_v) -> f(integral constants).
#define DSAKIT_X_DENSE_MHA(kNope, kRope, kV)                                      \
  if (d_nope == kNope && d_rope == kRope && d_v == kV) {                          \
    f(std::integral_constant<int, kNope>{}, std::integral_constant<int, kRope>{}, \
      std::integral_constant<int, kV>{});                                         \
    return true;                                                                  \
  }

template <typename F>
bool dispatch_dense_mha_sm80(int d_nope, int d_rope, int d_v, F&& f) {
  DSAKIT_DENSE_MHA_SM80_INSTANCES(DSAKIT_X_DENSE_MHA)
  return false;
}

template <typename F>
bool dispatch_dense_mha_sm90(int d_nope, int d_rope, int d_v, F&& f) {
  DSAKIT_DENSE_MHA_SM90_INSTANCES(DSAKIT_X_DENSE_MHA)
  return false;
}

template <typename F>
bool dispatch_indexer_logits_sm90(int h_i, LogitsOperands ops, F&& f) {
#define DSAKIT_X(kHeads, kOps)                                         \
  if (h_i == kHeads && ops == LogitsOperands::kOps) {                  \
    f(std::integral_constant<int, kHeads>{},                           \
      std::integral_constant<LogitsOperands, LogitsOperands::kOps>{}); \
    return true;                                                       \
  }
  DSAKIT_INDEXER_LOGITS_SM90_INSTANCES(DSAKIT_X)
#undef DSAKIT_X
  return false;
}

// The table's rows as text: "16 heads/CTA + bf16 pool, ..." and "(128, 64, 128), ...".
inline std::string sparse_mla_sm80_supported() {
  std::string rows;
#define DSAKIT_X(kHeads, kLayout)                                           \
  rows += std::string(rows.empty() ? "" : ", ") + #kHeads " heads/CTA + " + \
          to_string(KvLayout::kLayout) + " pool";
  DSAKIT_SPARSE_MLA_SM80_INSTANCES(DSAKIT_X)
#undef DSAKIT_X
  return rows;
}

inline std::string sparse_mla_sm90_supported() {
  std::string rows;
#define DSAKIT_X(kLayout)                                             \
  rows += std::string(rows.empty() ? "" : ", ") + "64 heads/CTA + " + \
          to_string(KvLayout::kLayout) + " pool";
  DSAKIT_SPARSE_MLA_SM90_INSTANCES(DSAKIT_X)
#undef DSAKIT_X
#define DSAKIT_X(kHeads, kLayout)                                                          \
  rows += std::string(rows.empty() ? "" : ", ") + "keys on M, " #kHeads "-head items + " + \
          to_string(KvLayout::kLayout) + " pool";
  DSAKIT_SPARSE_MLA_SM90_FEW_HEADS_INSTANCES(DSAKIT_X)
#undef DSAKIT_X
  return rows;
}

inline std::string indexer_logits_sm90_supported() {
  std::string rows;
#define DSAKIT_X(kHeads, kOps)                                       \
  rows += std::string(rows.empty() ? "" : ", ") + #kHeads " heads" + \
          (LogitsOperands::kOps == LogitsOperands::kF16 ? " (f16)" : " (e4m3)");
  DSAKIT_INDEXER_LOGITS_SM90_INSTANCES(DSAKIT_X)
#undef DSAKIT_X
  return rows;
}

#define DSAKIT_X_DENSE_MHA_ROW(kNope, kRope, kV) \
  rows += std::string(rows.empty() ? "" : ", ") + "(" #kNope ", " #kRope ", " #kV ")";
inline std::string dense_mha_sm80_supported() {
  std::string rows;
  DSAKIT_DENSE_MHA_SM80_INSTANCES(DSAKIT_X_DENSE_MHA_ROW)
  return rows;
}
inline std::string dense_mha_sm90_supported() {
  std::string rows;
  DSAKIT_DENSE_MHA_SM90_INSTANCES(DSAKIT_X_DENSE_MHA_ROW)
  return rows;
}
#undef DSAKIT_X_DENSE_MHA_ROW

#undef DSAKIT_X_DENSE_MHA

}  // namespace dsakit::cuda::attention
