// The compiled CUDA kernel instances (attention and indexer logits): the one table. Every other
// list derives from it:
//  * the instantiation files: src/cuda/CMakeLists.txt generates one .cu per row (one explicit
//    instantiation each, compiled in parallel) into the build tree;
//  * dispatch: src/cuda/attention/dispatch.h maps run-time values onto these template arguments;
//  * the planner's view: cuda_capabilities() (src/core/backend.cc) lists the dense head dims;
//  * `dsakit info` and every kUnsupported message (the *_supported() strings of dispatch.h).
// Plain preprocessor data with no includes, read by host code built without CUDA too. A new
// instance is one row here; CMake reads the rows as `X(<arguments>)`, one per line.
#pragma once

// Sparse MLA, mma.sync kernel (src/cuda/sm80/prefill/sparse_mla/):
// X(heads_per_cta, layout), layout a dsakit::KvLayout enumerator.
#define DSAKIT_SPARSE_MLA_SM80_INSTANCES(X) \
  X(16, kBf16)                              \
  X(16, kFp8Scaled)                         \
  X(16, kFp8Raw)                            \
  X(64, kBf16)                              \
  X(64, kFp8Scaled)                         \
  X(64, kFp8Raw)

// Sparse MLA, wgmma kernel (src/cuda/sm90/prefill/sparse_mla/), 64 heads per CTA: X(layout).
#define DSAKIT_SPARSE_MLA_SM90_INSTANCES(X) \
  X(kBf16)                                  \
  X(kFp8Scaled)                             \
  X(kFp8Raw)

// Sparse MLA, wgmma kernel with keys on M, two work items a CTA (few_heads_kernel.cuh):
// X(heads per work item, layout). On FP8 pools the codes widened in the consumers' registers
// (few_heads_fp8_kernel.cuh), by default up to 32 heads (sparse_mla_sm90_few_heads_by_default) in
// items of sparse_mla_sm90_few_heads_item(layout, H) heads, at any H when forced
// (DSAKIT_SPARSE_MLA_SM90_HEADS=16 or 32).
#define DSAKIT_SPARSE_MLA_SM90_FEW_HEADS_INSTANCES(X) \
  X(16, kBf16)                                        \
  X(16, kFp8Scaled)                                   \
  X(16, kFp8Raw)                                      \
  X(32, kFp8Raw)

// Dense MHA, mma.sync kernel (src/cuda/sm80/prefill/dense_mha/): X(d_nope, d_rope, d_v).
// (192, 64, 128) also runs GLM-5's (192, 64, 256) on short grids as two V column slices.
#define DSAKIT_DENSE_MHA_SM80_INSTANCES(X) \
  X(128, 64, 128)                          \
  X(192, 64, 128)                          \
  X(192, 64, 256)

// Dense MHA, wgmma + TMA kernel (src/cuda/sm90/prefill/dense_mha/): X(d_nope, d_rope, d_v).
#define DSAKIT_DENSE_MHA_SM90_INSTANCES(X) \
  X(128, 64, 128)                          \
  X(192, 64, 256)

// Indexer logits, wgmma kernel (src/cuda/sm90/indexer/): X(h_i, operands), operands a
// dsakit::cuda::LogitsOperands enumerator (kF16: codes widened to f16, fp32-exact; kE4m3: e4m3
// wgmma, fp8 accumulation).
#define DSAKIT_INDEXER_LOGITS_SM90_INSTANCES(X) \
  X(64, kF16)                                   \
  X(32, kF16)                                   \
  X(64, kE4m3)                                  \
  X(32, kE4m3)
