// Entry points of the CUDA attention kernels (sm_90a). The CUDA backend validates the arguments
// (src/core/validate.h) and calls these with device views; they choose the compiled instance,
// launch on `stream` and return without synchronizing.
//
// Throw Error(kUnsupported) naming required vs supported features when no instance matches
// (dtype, head dims, head count, pool layout), and Error(kBackend) on a CUDA error.
#pragma once

#include <functional>

#include <cuda_runtime.h>

#include "dsakit/backend.h"

namespace dsakit {

// Which attention kernel runs: the mma.sync one (src/cuda/sm80/), the wgmma one
// (src/cuda/sm90/), or kAuto: sparse_mla_kernel_for() / dense_mha_kernel_for() choose per call.
enum class AttentionKernel { kAuto, kMmaSync, kWgmma };

// Whether the wgmma kernel computes this pool's function: its producer widens each fp8 value to
// bf16(code · scale), which is exact for bf16 and fp8-raw pools (raw codes; k_scale multiplies S
// and O) and for 656-byte pools whose tile scales are powers of two (ScalePolicy::kPow2); amax
// scales would round each value once, so those pools are refused (the mma.sync kernel applies
// their scales in fp32).
bool sparse_mla_wgmma_reads(const KvPoolDesc& desc);

// The kernel kAuto runs for a pool (measured on the H200 at every head count, docs/perf.md): the
// wgmma kernel where it has an instance (instances.h) and reads the pool exactly, else mma.sync.
AttentionKernel sparse_mla_kernel_for(const KvPoolDesc& desc);

// Sparse MLA (docs/design.md, "Sparse MLA"), prefill and decode: q_abs / q_pe / o_lat bf16, d_c
// 512, d_rope 64, H in [1, 128], any top-k, pool layouts bf16 | fp8 | fp8-raw read by location.
// `kernel` other than kAuto forces that kernel (kUnsupported where it has no instance). The
// wgmma kernel's heads per CTA: `sm90_heads` 0 chooses by H and layout (keys on M, where it has
// an instance, for H <= 16, on FP8 pools for H <= 32, in items of
// sparse_mla_sm90_few_heads_item(layout, H) heads; else 64), 64, 32 or 16 forces one (16:
// kUnsupported for H > 16 on bf16 pools, FP8 pools it takes in items of 16 heads; 32: fp8-raw
// pools only, any H in items of 32 heads).
void cuda_sparse_mla(const SparseMlaArgs& args, cudaStream_t stream,
                     AttentionKernel kernel = AttentionKernel::kAuto, int sm90_heads = 0);

// Whether the wgmma dense kernel can run these arguments: an instance for the head dims
// (instances.h) and operands TMA can address (16-byte aligned bases and row / head strides).
bool dense_mha_wgmma_reads(const DenseMhaArgs& args);

// The kernel kAuto runs: the wgmma one wherever it can (dense_mha_wgmma_reads), else mma.sync.
AttentionKernel dense_mha_kernel_for(const DenseMhaArgs& args);

// Dense MHA prefill (docs/design.md, "Dense MHA"): bf16, (d_nope, d_rope, d_v) in {(128, 64, 128),
// (192, 64, 128), (192, 64, 256)}, varlen causal with prefix; the tile schedule comes from
// cu_q_host / cu_kv_host. Grids of few waves on the device's `sm_count` SMs split long tiles' kv
// blocks over several CTAs where the schedule's cost model says it pays, and merge the partial
// results (merge_partials). `scratch(bytes)` returns
// stream-ordered device memory that stays valid until the call returns (the backend's arena: no
// allocation once warm), for a long tile schedule and the split partials. `kernel` other than
// kAuto forces that kernel (kUnsupported where it cannot run these arguments). `head_group` > 0
// sets the wgmma kernel's grid order (heads per group, capped at H; the output is the same bits
// for every value), 0 chooses it: all heads on grids of few waves, else by the K / V bytes
// (dense_head_group). `split_short_tiles`: the
// wgmma kernel's tiles of <= 64 rows split their kv blocks between its two consumer groups
// (docs/kernels.md); off, the first group takes them all.
void cuda_dense_mha(const DenseMhaArgs& args, int sm_count, cudaStream_t stream,
                    const std::function<void*(size_t)>& scratch,
                    AttentionKernel kernel = AttentionKernel::kAuto, int head_group = 0,
                    bool split_short_tiles = true);
// Upper bound of the bytes cuda_dense_mha takes from `scratch` for these shapes.
int64_t cuda_dense_mha_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope, int d_v,
                                     int sm_count);

}  // namespace dsakit
