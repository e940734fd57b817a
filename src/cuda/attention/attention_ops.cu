// Entry points of the CUDA attention kernels: feature checks, parameter packing, instance
// dispatch, the dense tile schedule, and CUDA errors turned into dsakit::Error.
#include "src/cuda/attention/attention_ops.h"

#include <algorithm>
#include <string>
#include <vector>

#include "dsakit/error.h"
#include "src/cuda/attention/dense_mha_params.h"
#include "src/cuda/attention/dense_mha_schedule.h"
#include "src/cuda/attention/dispatch.h"
#include "src/cuda/attention/merge_kernels.h"
#include "src/cuda/attention/sparse_mla_params.h"
#include "src/cuda/common/dispatch.h"

namespace dsakit {
namespace {

using cuda::attention::dispatch_dense_mha_sm80;
using cuda::attention::dispatch_dense_mha_sm90;
using cuda::dense_mha::build_dense_schedule;
using cuda::dense_mha::DenseSchedule;

void check_cuda(cudaError_t err, const char* what) {
  DSAKIT_CHECK(err == cudaSuccess, kBackend, what, ": ", cudaGetErrorName(err), " (",
               cudaGetErrorString(err), ")");
}

void require_bf16(const TensorView& t, const char* op, const char* name) {
  DSAKIT_CHECK(t.dtype == DType::kBF16, kUnsupported, op, ": ", name, " requires dtype ",
               to_string(t.dtype), "; the CUDA kernels support bf16");
}

template <typename T>
const T* data_or_null(const TensorView& t) {
  return t.ndim == 0 ? nullptr : t.ptr<const T>();
}

// Row size the sparse MLA kernel assumes for a pool layout (d_c 512, d_rope 64).
int kernel_pool_row_bytes(KvLayout layout) {
  int bytes = 0;
  cuda::dispatch_kv_layout(
      layout, [&](auto l) { bytes = cuda::sparse_mla::PoolRow<decltype(l)::value>::kBytes; });
  return bytes;
}

}  // namespace

bool sparse_mla_wgmma_reads(const KvPoolDesc& desc) {
  return desc.layout != KvLayout::kFp8Scaled || desc.scale_policy == ScalePolicy::kPow2;
}

AttentionKernel sparse_mla_kernel_for(const KvPoolDesc& desc) {
  const bool compiled = cuda::attention::dispatch_sparse_mla_sm90(desc.layout, [](auto) {});
  return compiled && sparse_mla_wgmma_reads(desc) ? AttentionKernel::kWgmma
                                                  : AttentionKernel::kMmaSync;
}

void cuda_sparse_mla(const SparseMlaArgs& a, cudaStream_t stream, AttentionKernel kernel,
                     int sm90_heads) {
  constexpr const char* kOp = "cuda sparse_mla";
  using namespace cuda::sparse_mla;
  require_bf16(a.q_abs, kOp, "q_abs");
  require_bf16(a.q_pe, kOp, "q_pe");
  require_bf16(a.o_lat, kOp, "o_lat");
  const KvPoolDesc& desc = a.kv->desc();
  DSAKIT_CHECK(desc.d_c == kDimLatent && desc.d_rope == kDimRope, kUnsupported, kOp,
               ": requires (d_c, d_rope) = (", desc.d_c, ", ", desc.d_rope,
               "); the CUDA kernels support (512, 64)");
  const int64_t num_tokens = a.q_abs.shape[0];
  const int64_t num_heads = a.q_abs.shape[1];
  DSAKIT_CHECK(num_heads >= 1 && num_heads <= 128, kUnsupported, kOp, ": requires ", num_heads,
               " heads; the CUDA kernels support 1..128");
  const int64_t topk = a.indices.shape[1];
  DSAKIT_CHECK(topk <= INT32_MAX, kUnsupported, kOp, ": top-k ", topk, " exceeds int32");

  SparseMlaParams params{};
  params.q_abs = a.q_abs.ptr<const bf16_t>();
  params.q_pe = a.q_pe.ptr<const bf16_t>();
  params.kv_pool = a.kv->storage().ptr<const uint8_t>();
  params.indices = a.indices.ptr<const int32_t>();
  params.topk_length = data_or_null<int32_t>(a.topk_length);
  params.o_lat = a.o_lat.ptr<bf16_t>();
  params.lse = a.lse.ptr<float>();
  params.max_logits = a.max_logits.ndim ? a.max_logits.ptr<float>() : nullptr;
  params.q_abs_token_stride = a.q_abs.stride[0];
  params.q_abs_head_stride = a.q_abs.stride[1];
  params.q_pe_token_stride = a.q_pe.stride[0];
  params.q_pe_head_stride = a.q_pe.stride[1];
  params.num_tokens = num_tokens;
  params.num_locations = desc.num_locations();
  params.num_heads = int(num_heads);
  params.topk = int(topk);
  params.sm_scale = float(a.sm_scale);
  params.k_scale = desc.k_scale;

  DSAKIT_CHECK(desc.bytes_per_token() == kernel_pool_row_bytes(desc.layout), kInternal, kOp,
               ": pool rows of ", desc.bytes_per_token(), " B, the kernel reads ",
               kernel_pool_row_bytes(desc.layout), " B for layout ", to_string(desc.layout));
  if (kernel == AttentionKernel::kAuto) kernel = sparse_mla_kernel_for(desc);
  cudaError_t status = cudaSuccess;
  if (kernel == AttentionKernel::kWgmma) {
    DSAKIT_CHECK(sparse_mla_wgmma_reads(desc), kUnsupported, kOp,
                 ": the wgmma kernel reads 656-byte fp8 pools with pow2 scales only (it widens "
                 "code x scale to bf16, exact for powers of two); this pool's scale policy is ",
                 to_string(desc.scale_policy), ": use the mma.sync kernel (sm80)");
    DSAKIT_CHECK(sm90_heads == 0 || sm90_heads == 16 || sm90_heads == 32 || sm90_heads == 64,
                 kInvalidArgument, kOp, ": wgmma heads per CTA ", sm90_heads,
                 "; expected 0 (by H), 16, 32 or 64");
    const auto few_heads = [&](auto heads, auto layout) {
      status = run_sparse_mla_sm90_few_heads<decltype(heads)::value, decltype(layout)::value>(
          params, stream);
    };
    bool found = false;
    const bool forced_few = sm90_heads == 16 || sm90_heads == 32;
    if (forced_few ? cuda::attention::sparse_mla_sm90_few_heads_take(desc.layout, num_heads)
                   : sm90_heads != 64 && cuda::attention::sparse_mla_sm90_few_heads_by_default(
                                             desc.layout, num_heads))
      found = cuda::attention::dispatch_sparse_mla_sm90_few_heads(
          forced_few ? sm90_heads
                     : cuda::attention::sparse_mla_sm90_few_heads_item(desc.layout, num_heads),
          desc.layout, few_heads);
    DSAKIT_CHECK(found || !forced_few, kUnsupported, kOp, ": no keys-on-M wgmma instance with ",
                 sm90_heads, "-head items for ", num_heads, " heads + a ", to_string(desc.layout),
                 " pool; compiled: ", cuda::attention::sparse_mla_sm90_supported());
    if (!found)
      found = cuda::attention::dispatch_sparse_mla_sm90(desc.layout, [&](auto layout) {
        status = run_sparse_mla_sm90<decltype(layout)::value>(params, stream);
      });
    DSAKIT_CHECK(found, kUnsupported, kOp, ": no wgmma instance for a ", to_string(desc.layout),
                 " pool; compiled: ", cuda::attention::sparse_mla_sm90_supported());
  } else {
    const int heads_per_cta = cuda::attention::sparse_mla_heads_per_cta(int(num_heads));
    const bool found = cuda::attention::dispatch_sparse_mla_sm80(
        heads_per_cta, desc.layout, [&](auto heads, auto layout) {
          status = run_sparse_mla<decltype(heads)::value, decltype(layout)::value>(params, stream);
        });
    DSAKIT_CHECK(found, kUnsupported, kOp, ": no mma.sync instance for ", heads_per_cta,
                 " heads/CTA + a ", to_string(desc.layout),
                 " pool; compiled: ", cuda::attention::sparse_mla_sm80_supported());
  }
  check_cuda(status, "cuda sparse_mla launch");
}

bool dense_mha_wgmma_reads(const DenseMhaArgs& a) {
  const int d_nope = int(a.q_nope.shape[2]), d_rope = int(a.q_pe.shape[2]), d_v = int(a.v.shape[2]);
  if (!cuda::attention::dispatch_dense_mha_sm90(d_nope, d_rope, d_v, [](auto, auto, auto) {}))
    return false;
  const auto aligned = [](const TensorView& t) {
    return reinterpret_cast<uintptr_t>(t.data) % 16 == 0;
  };
  // Row and head strides in elements: TMA steps in multiples of 16 bytes.
  const bool strides_ok = a.k_nope.stride[0] % 8 == 0 && a.k_nope.stride[1] % 8 == 0 &&
                          a.v.stride[0] % 8 == 0 && a.v.stride[1] % 8 == 0;
  return strides_ok && aligned(a.q_nope) && aligned(a.q_pe) && aligned(a.k_nope) &&
         aligned(a.k_pe) && aligned(a.v);
}

AttentionKernel dense_mha_kernel_for(const DenseMhaArgs& a) {
  return dense_mha_wgmma_reads(a) ? AttentionKernel::kWgmma : AttentionKernel::kMmaSync;
}

void cuda_dense_mha(const DenseMhaArgs& a, int sm_count, cudaStream_t stream,
                    const std::function<void*(size_t)>& scratch, AttentionKernel kernel,
                    int head_group, bool split_short_tiles) {
  constexpr const char* kOp = "cuda dense_mha";
  using namespace cuda::dense_mha;
  require_bf16(a.q_nope, kOp, "q_nope");
  require_bf16(a.q_pe, kOp, "q_pe");
  require_bf16(a.k_nope, kOp, "k_nope");
  require_bf16(a.k_pe, kOp, "k_pe");
  require_bf16(a.v, kOp, "v");
  require_bf16(a.o, kOp, "o");
  const int64_t num_heads = a.q_nope.shape[1];
  const int d_nope = int(a.q_nope.shape[2]), d_rope = int(a.q_pe.shape[2]), d_v = int(a.v.shape[2]);
  const int64_t num_kv = a.k_nope.shape[0];
  DSAKIT_CHECK(a.kv_visible.ndim == 0, kUnsupported, kOp,
               ": per-query visible counts (kv_visible, used by the DCP simulation) are not "
               "supported by the CUDA kernel; supported: the causal default");
  DSAKIT_CHECK(num_kv <= INT32_MAX, kUnsupported, kOp, ": ", num_kv,
               " kv rows; the CUDA kernel supports up to 2^31 - 1");

  // The requested head dims need a kernel; none -> kUnsupported before any allocation.
  if (kernel == AttentionKernel::kAuto) kernel = dense_mha_kernel_for(a);
  const bool wgmma = kernel == AttentionKernel::kWgmma;
  if (wgmma) {
    DSAKIT_CHECK(dense_mha_wgmma_reads(a), kUnsupported, kOp,
                 ": the wgmma kernel requires (d_nope, d_rope, d_v) in ",
                 cuda::attention::dense_mha_sm90_supported(),
                 " and 16-byte aligned operands with row / head strides in multiples of 8 "
                 "elements; got (",
                 d_nope, ", ", d_rope, ", ", d_v, "): use the mma.sync kernel (sm80)");
  } else {
    DSAKIT_CHECK(a.kv_mask.ndim == 0, kUnsupported, kOp,
                 ": a per-(query, key) mask (kv_mask) needs the wgmma kernel (sm_90, head dims "
                 "in ",
                 cuda::attention::dense_mha_sm90_supported(),
                 ", TMA-addressable operands); the mma.sync kernel (sm80) takes none");
    DSAKIT_CHECK(dispatch_dense_mha_sm80(d_nope, d_rope, d_v, [](auto, auto, auto) {}),
                 kUnsupported, kOp, ": requires (d_nope, d_rope, d_v) = (", d_nope, ", ", d_rope,
                 ", ", d_v, "); the CUDA kernels support ",
                 cuda::attention::dense_mha_sm80_supported());
  }
  if (num_heads == 0 || a.num_requests == 0 || a.cu_q_host[a.num_requests] == 0) return;

  // Split-KV partials (f32 o + lse per row and slot) stay within their budget, which the
  // backend reports in dense_mha_scratch_bytes.
  const DenseSchedule schedule = build_dense_schedule(
      a.cu_q_host, a.cu_kv_host, a.num_requests, num_heads, sm_count, 4 * int64_t(d_v + 1),
      dense_partials_budget_bytes(num_kv, num_heads, d_nope, d_v),
      wgmma ? dense_sm90_shape(d_v) : kDenseSm80Shape);
  const std::vector<DenseTile>& tiles = schedule.tiles;
  // mma.sync: a grid that leaves SMs idle with d_v = 256 (GLM-5) runs two CTAs per (tile,
  // head), 128 V columns each (the d_v = 128 instance): both compute S, each does half the P·V
  // work and loads half of V, and together they fill twice as many SMs.
  const int v_slices = !wgmma && d_v == 256 && int64_t(tiles.size()) * num_heads < sm_count ? 2 : 1;
  cudaError_t (*launch)(const DenseMhaParams&, cudaStream_t) = nullptr;
  if (wgmma) {
    dispatch_dense_mha_sm90(d_nope, d_rope, d_v, [&](auto nope, auto rope, auto v) {
      launch =
          &run_dense_mha_sm90<decltype(nope)::value, decltype(rope)::value, decltype(v)::value>;
    });
  } else {
    dispatch_dense_mha_sm80(d_nope, d_rope, d_v / v_slices, [&](auto nope, auto rope, auto v) {
      launch = &run_dense_mha<decltype(nope)::value, decltype(rope)::value, decltype(v)::value>;
    });
  }
  DSAKIT_CHECK(launch != nullptr, kInternal, kOp, ": no instance for d_v slices of ",
               d_v / v_slices);
  const int64_t num_tokens = a.q_nope.shape[0];
  DenseMhaParams params{};
  params.q_nope = a.q_nope.ptr<const bf16_t>();
  params.q_pe = a.q_pe.ptr<const bf16_t>();
  params.k_nope = a.k_nope.ptr<const bf16_t>();
  params.k_pe = a.k_pe.ptr<const bf16_t>();
  params.v = a.v.ptr<const bf16_t>();
  // Contiguous [N, H, d] tensors or the halves of one [N, H, d_nope + d_v] buffer (validated).
  params.k_row_stride = a.k_nope.stride[0];
  params.k_head_stride = a.k_nope.stride[1];
  params.v_row_stride = a.v.stride[0];
  params.v_head_stride = a.v.stride[1];
  params.o = a.o.ptr<bf16_t>();
  params.lse = a.lse.ptr<float>();
  params.rows = num_tokens * num_heads;
  params.num_kv = num_kv;
  params.num_tiles = int(tiles.size());
  params.num_heads = int(num_heads);
  params.head_group = head_group > 0       ? int(std::min<int64_t>(head_group, num_heads))
                      : schedule.few_waves ? int(num_heads)
                                           : dense_head_group(num_kv, num_heads, d_nope, d_v);
  params.v_slices = v_slices;
  params.d_v_total = d_v;
  params.split_short_tiles = split_short_tiles ? 1 : 0;
  if (a.kv_mask.ndim != 0) {  // [T, W] i32 rows, contiguous (validated)
    params.kv_mask = static_cast<const uint32_t*>(a.kv_mask.data);
    params.kv_mask_words = a.kv_mask.shape[1];
  }
  params.sm_scale = float(a.sm_scale);
  if (schedule.parts > 1) {
    // One block: o slots [parts, T, H, d_v], then lse slots [parts, T, H] (f32).
    const size_t o_slots = size_t(schedule.parts * params.rows * d_v);
    params.o_parts =
        static_cast<float*>(scratch((o_slots + size_t(schedule.parts * params.rows)) * 4));
    params.lse_parts = params.o_parts + o_slots;
  }

  // A short schedule travels in the launch's parameters; a long one with the stream (scratch
  // from the caller's stream-ordered arena, copy, launch).
  cudaError_t status = cudaSuccess;
  if (tiles.size() <= size_t(kDenseInlineTiles)) {
    std::copy(tiles.begin(), tiles.end(), params.inline_tiles);
    params.tiles = nullptr;
  } else {
    // The copy's host source lives for this call only: a graph replay would read it after.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capture), "cuda dense_mha: cudaStreamIsCapturing");
    DSAKIT_CHECK(capture == cudaStreamCaptureStatusNone, kUnsupported, kOp, ": a schedule of ",
                 tiles.size(), " tiles (more than the ", kDenseInlineTiles,
                 " its launch parameters carry) cannot be captured into a CUDA graph; run this "
                 "batch outside the capture or capture fewer query tiles");
    const size_t bytes = tiles.size() * sizeof(DenseTile);
    auto* device_tiles = static_cast<DenseTile*>(scratch(bytes));
    status = cudaMemcpyAsync(device_tiles, tiles.data(), bytes, cudaMemcpyHostToDevice, stream);
    params.tiles = device_tiles;
  }
  if (status == cudaSuccess) status = launch(params, stream);
  if (status == cudaSuccess && schedule.parts > 1) {
    cuda::MergePartialsParams merge{params.o_parts, params.lse_parts, a.o.data, params.lse, false,
                                    params.rows,    schedule.parts,   d_v,      false};
    cuda::dense_mha::set_merge_rows(schedule, merge);
    status = cuda::launch_merge_partials(merge, stream);
  }
  check_cuda(status, "cuda dense_mha launch");
}

int64_t cuda_dense_mha_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope, int d_v,
                                     int sm_count) {
  return cuda::dense_mha::dense_scratch_bytes(num_kv, num_heads, d_nope, d_v, sm_count);
}

}  // namespace dsakit
