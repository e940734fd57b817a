// The online softmax of the keys-on-M sparse kernels (few_heads_kernel.cuh,
// few_heads_fp8_kernel.cuh): a consumer group of 128 threads over a work item's kN heads (16, or
// 32 on fp8-raw pools), with Sᵀ and Oᵀ in the m64nkN accumulator layout (thread g = lane / 4,
// q = lane % 4 of warp w):
//   s[4j + 2r + c]      = Sᵀ[row 16w + g + 8r][head 8j + 2q + c]      j < kN / 8, r, c in {0, 1}
//   o[mt][4j + 2r + c]  = Oᵀ[a row of tile mt][head 8j + 2q + c]     mt < 8
// so a thread holds kN / 4 heads, hi = 2j + c. Each consumer group takes a work item of its own
// and finishes alone (finish_alone).
#pragma once

#include "src/cuda/sm90/prefill/sparse_mla/sparse_mla_kernel.cuh"

namespace dsakit::cuda::sparse_mla {

template <int kN = 16>
struct FewHeadsSoftmax {
  static_assert(kN == 16 || kN == 32);
  static constexpr int kHeads = kN;
  static constexpr int kHi = kN / 4;   // heads a thread holds
  static constexpr int kAcc = kN / 2;  // accumulators a thread holds per M tile
  // At 32 heads the exact maxima live in shared memory (the caller's true_max, f32 [kN]), each
  // head's kept by the one thread that writes its lse (warp 0, g == 0: `owner`), not in every
  // thread's registers.
  static constexpr bool kMaxInSmem = kN > 16;
  // Per head hi of this thread: the exponent offset (as in the 64-head kernel: moves only when a
  // block's max passes it by more than kRescaleSlack), the running sum of this thread's rows, the
  // exact max of this group's blocks (unused where kMaxInSmem). Sized for 32 heads; a 16-head
  // group uses the first four.
  float m[8] = {-1e30f, -1e30f, -1e30f, -1e30f, -1e30f, -1e30f, -1e30f, -1e30f};
  float l[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float m_true[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                     -INFINITY, -INFINITY, -INFINITY, -INFINITY};

  // kMaxInSmem, before the first block: the owner's heads of true_max to -inf.
  __device__ static void init_true_max(float* true_max, bool owner, int q) {
    static_assert(kMaxInSmem);
#pragma unroll
    for (int hi = 0; hi < kHi; ++hi)
      if (owner) true_max[head_of(hi, q)] = -INFINITY;
  }

  __device__ static int head_of(int hi, int q) {
    return 8 * (hi / 2) + 2 * q + hi % 2;
  }

  // One block: rows r with !ok[r] masked to -inf; the block's per-head max over the group
  // (warp_heads: f32 [4 warps][16], named barrier `sync` of the group's 128 threads); O and l
  // rescaled where the offset moves; s turned into P = exp2(s · scale_log2 − m) (S stays
  // unscaled: the scale folds into the exponent).
  __device__ __forceinline__ void block(float (&s)[kAcc], float (&o)[8][kAcc], const bool (&ok)[2],
                                        float* warp_heads, int sync, float scale_log2, int warp,
                                        int g, int q) {
    publish_max(s, ok, warp_heads, warp, g, q);
    sm90::named_barrier_sync(sync, 128);
    finish_block(s, o, warp_heads, scale_log2, q);
  }

  // block() before its barrier: the masking and this warp's per-head maxima into warp_heads.
  __device__ __forceinline__ void publish_max(float (&s)[kAcc], const bool (&ok)[2],
                                              float* warp_heads, int warp, int g, int q) const {
#pragma unroll
    for (int hi = 0; hi < kHi; ++hi) {
      const int j = hi / 2, c = hi % 2;
#pragma unroll
      for (int r = 0; r < 2; ++r) s[4 * j + 2 * r + c] = ok[r] ? s[4 * j + 2 * r + c] : -INFINITY;
      float x = fmaxf(s[4 * j + c], s[4 * j + 2 + c]);
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
      x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
      if (g == 0) warp_heads[warp * kHeads + head_of(hi, q)] = x;
    }
  }

  // block() after its barrier: the group's maxima, the rescale, P.
  __device__ __forceinline__ void finish_block(float (&s)[kAcc], float (&o)[8][kAcc],
                                               const float* warp_heads, float scale_log2, int q,
                                               float* true_max = nullptr, bool owner = false) {
    float m_new[kHi];
    bool moved = false;
#pragma unroll
    for (int hi = 0; hi < kHi; ++hi) {
      const int head = head_of(hi, q);
      float x = warp_heads[head];
#pragma unroll
      for (int w = 1; w < 4; ++w) x = fmaxf(x, warp_heads[w * kHeads + head]);
      const float block_max = x * scale_log2;
      if constexpr (kMaxInSmem) {
        if (owner) true_max[head] = fmaxf(true_max[head], block_max);
      } else {
        m_true[hi] = fmaxf(m_true[hi], block_max);
      }
      // false for NaN and for -inf
      m_new[hi] = block_max > m[hi] + Sm90Config::kRescaleSlack ? block_max : m[hi];
      moved |= m_new[hi] != m[hi];
    }
    if (moved) {
#pragma unroll
      for (int hi = 0; hi < kHi; ++hi) {
        const float alpha = exp2_approx(m[hi] - m_new[hi]);
        l[hi] *= alpha;
#pragma unroll
        for (int mt = 0; mt < 8; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) o[mt][4 * (hi / 2) + 2 * r + hi % 2] *= alpha;
      }
    }
#pragma unroll
    for (int hi = 0; hi < kHi; ++hi) {
      m[hi] = m_new[hi];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float& x = s[4 * (hi / 2) + 2 * r + hi % 2];
        x = exp2_approx(fmaf(x, scale_log2, -m_new[hi]));
        l[hi] += x;
      }
    }
  }

  // A group that takes every block of its work item: its per-head sums over its 128 threads
  // (warp_heads, barrier `sync_heads`; the group's last barrier before it ordered every read of
  // the maxima there). Per head hi: total = the sum, offset = m, factor = what O is scaled by
  // (value_scale / total; 0 where no slot was valid: total == 0 exactly then, the max slot
  // contributing 1; NaN propagates), maxima = the group's exact max (m_true, uniform over the
  // group; kMaxInSmem: true_max's, in the owner only).
  __device__ __forceinline__ void finish_alone(float* warp_heads, int warp, int g, int q,
                                               int sync_heads, float value_scale,
                                               float (&total)[kHi], float (&factor)[kHi],
                                               float (&offset)[kHi], float (&maxima)[kHi],
                                               const float* true_max = nullptr) const {
    sum_heads(warp_heads, warp, g, q, sync_heads);
#pragma unroll
    for (int hi = 0; hi < kHi; ++hi) {
      const float x = group_sum(warp_heads, head_of(hi, q));
      total[hi] = x;
      offset[hi] = m[hi];
      factor[hi] = x == 0.f ? 0.f : value_scale / x;
      if constexpr (kMaxInSmem)
        maxima[hi] = warp == 0 && g == 0 ? true_max[head_of(hi, q)] : -INFINITY;
      else
        maxima[hi] = m_true[hi];
    }
  }

 private:
  // Each warp's per-head sums of l into warp_heads (f32 [4 warps][kN]), then barrier `sync_heads`
  // of the group's 128 threads.
  __device__ __forceinline__ void sum_heads(float* warp_heads, int warp, int g, int q,
                                            int sync_heads) const {
#pragma unroll
    for (int hi = 0; hi < kHi; ++hi) {
      float x = l[hi];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      if (g == 0) warp_heads[warp * kHeads + head_of(hi, q)] = x;
    }
    sm90::named_barrier_sync(sync_heads, 128);
  }
  // After sum_heads: head's sum over the group's four warps.
  __device__ static float group_sum(const float* warp_heads, int head) {
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) x += warp_heads[w * kHeads + head];
    return x;
  }
};

// A group's output: for each head hi of this thread below H, store(hi, th) writes its o_lat row
// th = t · H + head; warp 0's lanes 0-3 (g = 0) also write lse (natural log; +inf where no slot
// was valid) and max_logits (if asked), from total / offset / maxima (finish_alone's).
template <int kHi, typename Store>
__device__ __forceinline__ void write_heads(const SparseMlaParams& p, const CtaWork& work, int warp,
                                            int g, int q, const float (&total)[kHi],
                                            const float (&offset)[kHi], const float (&maxima)[kHi],
                                            Store&& store) {
#pragma unroll
  for (int hi = 0; hi < kHi; ++hi) {
    const int head = work.head0 + FewHeadsSoftmax<>::head_of(hi, q);
    if (head >= p.num_heads) continue;
    const int64_t th = work.t * p.num_heads + head;
    store(hi, th);
    if (warp != 0 || g != 0) continue;
    p.lse[th] = total[hi] == 0.f ? INFINITY : (offset[hi] + log2f(total[hi])) * kLn2;
    if (p.max_logits != nullptr)
      p.max_logits[th] = total[hi] == 0.f ? -INFINITY : maxima[hi] * kLn2;
  }
}

}  // namespace dsakit::cuda::sparse_mla
