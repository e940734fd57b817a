// Sparse MLA prefill on the CPU (docs/design.md#sparse-mla): absorbed attention of every head over
// each token's selected pool locations, reading the paged pool in any of its layouts.
//
// One OpenMP task per token t. Its valid slots' pool rows are dequantized once (by the pool's
// own gather kernel, the one row decoder of the CPU backend) into fp32 buffers shared by all H
// heads, c [n_valid, d_c] and r [n_valid, d_rope]; then
//   s[H, n_valid]     = sm_scale · (q_abs[t] · c^T + q_pe[t] · r^T)    (two sgemms)
//   p                 = row softmax of s, fp32, max subtracted
//   o_lat[t] [H, d_c] = p · c                                          (sgemm)
//   lse[t, h]         = max_h + log(Σ exp(s - max_h))                  (natural log)
//   max_logits[t, h]  = max_h                                          (when requested)
// Slots with an index < 0 or >= num_locations are skipped before any pool access; an index that
// repeats counts once per slot. A token with no valid slot gets o_lat = 0, lse = +inf and
// max_logits = -inf. q_abs / q_pe may be strided views (unit stride in the last dim).
// Every buffer row a token reads was written for that token, so NaN stays within its token.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/cpu/gemm/blas.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

// Per-thread buffers, sized for the largest token.
struct SparseMlaWorkspace {
  std::vector<int32_t> locs;        // [k]          valid locations of one token
  std::unique_ptr<float[]> c;       // [k, d_c]     dequantized c_kv of those locations
  std::unique_ptr<float[]> r;       // [k, d_rope]  their k_pe
  std::unique_ptr<float[]> q_abs;   // [H, d_c]     one token's q_abs (when not f32 already)
  std::unique_ptr<float[]> q_pe;    // [H, d_rope]  one token's q_pe (when not f32 already)
  std::unique_ptr<float[]> scores;  // [H, k]       logits, then probabilities
  std::unique_ptr<float[]> o;       // [H, d_c]     output when o_lat is bf16
};

// Token t's heads of a bf16 | f32 query view [T, H, width] (unit stride in the last dim) as fp32
// [H, width]: in place when it is a contiguous f32 block, else gathered into `staging`.
const float* heads_f32(const TensorView& q, int64_t t, float* staging) {
  const int64_t heads = q.shape[1], width = q.shape[2];
  const int64_t base = t * q.stride[0];
  if (q.dtype == DType::kF32 && q.stride[1] == width) return q.ptr<const float>() + base;
  for (int64_t h = 0; h < heads; ++h)
    load_f32(q, base + h * q.stride[1], width, staging + h * width);
  return staging;
}

}  // namespace

void sparse_mla(const CpuContext& ctx, const SparseMlaArgs& args) {
  const PagedKvPool& pool = *args.kv;
  const int64_t tokens = args.q_abs.shape[0], heads = args.q_abs.shape[1];
  const int64_t k = args.indices.shape[1];
  const int64_t d_c = pool.desc().d_c, d_rope = pool.desc().d_rope;
  const int64_t num_locations = pool.desc().num_locations();
  const int32_t* indices = args.indices.ptr<const int32_t>();
  const int32_t* topk_length =
      args.topk_length.ndim ? args.topk_length.ptr<const int32_t>() : nullptr;
  const float sm_scale = float(args.sm_scale);
  const bool o_is_f32 = args.o_lat.dtype == DType::kF32;
  float* lse = args.lse.ptr<float>();
  float* max_logits = args.max_logits.ndim ? args.max_logits.ptr<float>() : nullptr;
  const CpuContext serial{.threads = 1};  // kernels called from inside the token loop
  ScopedBlasThreads blas_threads(1);

#pragma omp parallel num_threads(ctx.threads)
  {
    SparseMlaWorkspace ws{std::vector<int32_t>(static_cast<size_t>(k)),
                          alloc_f32(k * d_c),
                          alloc_f32(k * d_rope),
                          alloc_f32(heads * d_c),
                          alloc_f32(heads * d_rope),
                          alloc_f32(heads * k),
                          alloc_f32(heads * d_c)};
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t th0 = t * heads;  // flat (token, head) index of head 0
      const int64_t slots = topk_length ? std::clamp<int64_t>(topk_length[t], 0, k) : k;
      int64_t n = 0;
      for (int64_t j = 0; j < slots; ++j) {
        const int32_t loc = indices[t * k + j];
        if (loc >= 0 && loc < num_locations) ws.locs[size_t(n++)] = loc;
      }
      float* o = o_is_f32 ? args.o_lat.ptr<float>() + th0 * d_c : ws.o.get();
      if (n == 0) {
        std::fill_n(o, heads * d_c, 0.0f);
        std::fill_n(lse + th0, heads, std::numeric_limits<float>::infinity());
        if (max_logits)
          std::fill_n(max_logits + th0, heads, -std::numeric_limits<float>::infinity());
      } else {
        gather_kv(serial, pool, make_view(ws.locs.data(), DType::kI32, Device::kCpu, {n}),
                  make_view(ws.c.get(), DType::kF32, Device::kCpu, {n, d_c}),
                  make_view(ws.r.get(), DType::kF32, Device::kCpu, {n, d_rope}));
        const float* q_abs = heads_f32(args.q_abs, t, ws.q_abs.get());
        const float* q_pe = heads_f32(args.q_pe, t, ws.q_pe.get());
        float* s = ws.scores.get();
        sgemm(/*trans_b=*/true, heads, n, d_c, sm_scale, q_abs, d_c, ws.c.get(), d_c, 0.0f, s, n);
        sgemm(/*trans_b=*/true, heads, n, d_rope, sm_scale, q_pe, d_rope, ws.r.get(), d_rope, 1.0f,
              s, n);
        for (int64_t h = 0; h < heads; ++h) {
          float* p = s + h * n;
          float max = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) max = std::max(max, p[j]);
          float sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) sum += (p[j] = std::exp(p[j] - max));
          const float inv_sum = 1.0f / sum;
          for (int64_t j = 0; j < n; ++j) p[j] *= inv_sum;
          lse[th0 + h] = max + std::log(sum);
          if (max_logits) max_logits[th0 + h] = max;
        }
        sgemm(/*trans_b=*/false, heads, d_c, n, 1.0f, s, n, ws.c.get(), d_c, 0.0f, o, d_c);
      }
      if (!o_is_f32) store_f32(args.o_lat, th0 * d_c, heads * d_c, o);
    }
  }
}

}  // namespace dsakit::cpu
