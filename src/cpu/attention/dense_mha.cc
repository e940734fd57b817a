// Dense causal MHA with a cached prefix on the CPU (docs/design.md#dense-mha), flash-style in fp32.
//
// Query t = cu_q[r] + i of request r sees the first n_t kv rows of its request (rows
// cu_kv[r] …): n_t = kv_visible[t] when given, else L_r - E_r + i + 1; with kv_mask, only those
// of them whose bit is set in row t (their logits become -inf before the softmax). q = [q_nope,
// q_pe] and k = [k_nope[h], k_pe] (k_pe shared by all heads) are never concatenated: the logits are
// two sgemms reading q and k in place with their head strides.
//
// One OpenMP task per (request, head, tile of kQueryTile queries). Per kv tile of kKvTile rows:
//   S = sm_scale · (q_nope·k_nope^T + q_pe·k_pe^T)          [rows, cols]
//   per row, over its visible columns only: running max m, running sum l, O *= exp(m_old - m)
//   O += P · V: one sgemm over the columns every row sees, an sgemv per row for its tail (with
//   kv_mask, an axpy per kept column instead)
// so neither S nor V of a row a query cannot see ever enters its output (NaN stays put).
// Finally o = O / l and lse = m + log(l); a query with no visible row gets o = 0, lse = +inf.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "src/cpu/gemm/blas.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

constexpr int64_t kQueryTile = 64;
constexpr int64_t kKvTile = 256;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct DenseTask {
  int32_t request;
  int32_t head;
  int32_t q_begin;  // first query of the tile, relative to the request
};

// Shapes and fp32 operands of one call; row strides in elements.
struct DenseProblem {
  int64_t heads, d_nope, d_rope, d_v;
  float sm_scale;
  const float* q_nope;  // [T, H, d_nope]
  const float* q_pe;    // [T, H, d_rope]
  const float* k_nope;  // [N, H, d_nope]
  const float* k_pe;    // [N, d_rope]
  const float* v;       // [N, H, d_v]
  const int32_t* cu_q;
  const int32_t* cu_kv;
  const int32_t* visible;  // [T] kv rows each query sees, within its request
  const uint32_t* mask;    // [T, mask_words] or nullptr: bit p of row t = kv row p is seen
  int64_t mask_words;
};

// Whether a kv_mask row (bits) keeps key `key` of its request.
inline bool keeps(const uint32_t* bits, int64_t key) {
  return (bits[key / 32] >> (key % 32)) & 1u;
}

struct DenseWorkspace {
  std::unique_ptr<float[]> s;    // [kQueryTile, kKvTile] logits, then probabilities
  std::unique_ptr<float[]> acc;  // [kQueryTile, d_v] unnormalized output
  std::unique_ptr<float[]> out;  // [d_v] one normalized output row
  std::vector<float> max, sum;   // [kQueryTile] running max and sum per row
};

// Attention of one (request, head, query tile) into o [T, H, d_v] and lse [T, H].
void attend_tile(const DenseProblem& pb, const DenseTask& task, DenseWorkspace& ws,
                 const TensorView& o, float* lse) {
  const int64_t h = task.head, heads = pb.heads;
  const int64_t t0 = pb.cu_q[task.request] + task.q_begin;
  const int64_t rows = std::min<int64_t>(kQueryTile, pb.cu_q[task.request + 1] - t0);
  const int64_t kv0 = pb.cu_kv[task.request];
  const int32_t* visible = pb.visible + t0;
  const int64_t n_max = *std::max_element(visible, visible + rows);

  const int64_t ldq_nope = heads * pb.d_nope, ldq_pe = heads * pb.d_rope, ldv = heads * pb.d_v;
  const float* q_nope = pb.q_nope + t0 * ldq_nope + h * pb.d_nope;
  const float* q_pe = pb.q_pe + t0 * ldq_pe + h * pb.d_rope;
  float* s = ws.s.get();
  float* acc = ws.acc.get();
  std::fill_n(acc, rows * pb.d_v, 0.0f);
  std::fill_n(ws.max.begin(), rows, -kInf);
  std::fill_n(ws.sum.begin(), rows, 0.0f);

  for (int64_t j0 = 0; j0 < n_max; j0 += kKvTile) {
    const int64_t cols = std::min(kKvTile, n_max - j0);
    const int64_t row0 = kv0 + j0;  // first kv row of the tile, in [N, …] tensors
    sgemm(/*trans_b=*/true, rows, cols, pb.d_nope, pb.sm_scale, q_nope, ldq_nope,
          pb.k_nope + row0 * ldq_nope + h * pb.d_nope, ldq_nope, 0.0f, s, kKvTile);
    sgemm(/*trans_b=*/true, rows, cols, pb.d_rope, pb.sm_scale, q_pe, ldq_pe,
          pb.k_pe + row0 * pb.d_rope, pb.d_rope, 1.0f, s, kKvTile);

    int64_t shared_cols = cols;  // columns every row of the tile sees
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t seen = std::clamp<int64_t>(visible[i] - j0, 0, cols);
      shared_cols = std::min(shared_cols, seen);
      if (seen == 0) continue;
      float* p = s + i * kKvTile;
      if (pb.mask) {
        const uint32_t* bits = pb.mask + (t0 + i) * pb.mask_words;
        int64_t kept = 0;
        for (int64_t j = 0; j < seen; ++j) {
          if (keeps(bits, j0 + j))
            ++kept;
          else
            p[j] = -kInf;
        }
        if (kept == 0) {  // the row sees none of this tile: zero probabilities, state unchanged
          std::fill_n(p, seen, 0.0f);
          continue;
        }
      }
      float tile_max = -kInf;
      for (int64_t j = 0; j < seen; ++j) tile_max = std::max(tile_max, p[j]);
      const float new_max = std::max(ws.max[i], tile_max);
      const float rescale = std::exp(ws.max[i] - new_max);
      float tile_sum = 0.0f;
      for (int64_t j = 0; j < seen; ++j) tile_sum += (p[j] = std::exp(p[j] - new_max));
      ws.sum[i] = ws.sum[i] * rescale + tile_sum;
      ws.max[i] = new_max;
      if (rescale != 1.0f)
        for (int64_t d = 0; d < pb.d_v; ++d) acc[i * pb.d_v + d] *= rescale;
    }
    const float* v_tile = pb.v + row0 * ldv + h * pb.d_v;
    if (pb.mask) {
      // P · V over the columns each row keeps only: a masked kv row, NaN or not, never enters.
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t seen = std::clamp<int64_t>(visible[i] - j0, 0, cols);
        const uint32_t* bits = pb.mask + (t0 + i) * pb.mask_words;
        for (int64_t j = 0; j < seen; ++j)
          if (keeps(bits, j0 + j))
            cblas_saxpy(int(pb.d_v), s[i * kKvTile + j], v_tile + j * ldv, 1, acc + i * pb.d_v, 1);
      }
      continue;
    }
    sgemm(/*trans_b=*/false, rows, pb.d_v, shared_cols, 1.0f, s, kKvTile, v_tile, ldv, 1.0f, acc,
          pb.d_v);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t seen = std::clamp<int64_t>(visible[i] - j0, 0, cols);
      if (seen <= shared_cols) continue;
      cblas_sgemv(CblasRowMajor, CblasTrans, int(seen - shared_cols), int(pb.d_v), 1.0f,
                  v_tile + shared_cols * ldv, int(ldv), s + i * kKvTile + shared_cols, 1, 1.0f,
                  acc + i * pb.d_v, 1);
    }
  }

  for (int64_t i = 0; i < rows; ++i) {
    const int64_t th = (t0 + i) * heads + h;
    float* out = ws.out.get();
    if (ws.sum[i] == 0.0f) {  // no visible kv row
      std::fill_n(out, pb.d_v, 0.0f);
      lse[th] = kInf;
    } else {
      const float inv_sum = 1.0f / ws.sum[i];
      for (int64_t d = 0; d < pb.d_v; ++d) out[d] = acc[i * pb.d_v + d] * inv_sum;
      lse[th] = ws.max[i] + std::log(ws.sum[i]);
    }
    store_f32(o, th * pb.d_v, pb.d_v, out);
  }
}

}  // namespace

void dense_mha(const CpuContext& ctx, const DenseMhaArgs& args) {
  const int64_t tokens = args.q_nope.shape[0];
  const int num_requests = args.num_requests;
  if (tokens == 0) return;

  // Visible kv rows per query; kv_visible is clamped to [0, L_r] so no read leaves the request.
  std::vector<int32_t> visible(static_cast<size_t>(tokens));
  std::vector<DenseTask> tasks;
  const int32_t heads = int32_t(args.q_nope.shape[1]);
  for (int r = 0; r < num_requests; ++r) {
    const int32_t extend = args.cu_q_host[r + 1] - args.cu_q_host[r];
    const int32_t kv_len = args.cu_kv_host[r + 1] - args.cu_kv_host[r];
    for (int32_t i = 0; i < extend; ++i) {
      const int64_t t = args.cu_q_host[r] + i;
      visible[size_t(t)] = args.kv_visible_host ? std::clamp(args.kv_visible_host[t], 0, kv_len)
                                                : kv_len - extend + i + 1;
    }
    if (extend == 0) continue;
    // Later tiles see more rows: list them first so dynamic scheduling ends balanced.
    for (int32_t q_begin = (extend - 1) / kQueryTile * kQueryTile; q_begin >= 0;
         q_begin -= kQueryTile)
      for (int32_t h = 0; h < heads; ++h) tasks.push_back({r, h, q_begin});
  }

  const F32Operand q_nope(args.q_nope, ctx.threads), q_pe(args.q_pe, ctx.threads);
  const F32Operand k_nope(args.k_nope, ctx.threads), k_pe(args.k_pe, ctx.threads);
  const F32Operand v(args.v, ctx.threads);
  const DenseProblem pb{
      .heads = heads,
      .d_nope = args.q_nope.shape[2],
      .d_rope = args.q_pe.shape[2],
      .d_v = args.v.shape[2],
      .sm_scale = float(args.sm_scale),
      .q_nope = q_nope.data(),
      .q_pe = q_pe.data(),
      .k_nope = k_nope.data(),
      .k_pe = k_pe.data(),
      .v = v.data(),
      .cu_q = args.cu_q_host,
      .cu_kv = args.cu_kv_host,
      .visible = visible.data(),
      .mask = args.kv_mask.ndim != 0 ? args.kv_mask.ptr<const uint32_t>() : nullptr,
      .mask_words = args.kv_mask.ndim != 0 ? args.kv_mask.shape[1] : 0};
  float* lse = args.lse.ptr<float>();
  ScopedBlasThreads blas_threads(1);

#pragma omp parallel num_threads(ctx.threads)
  {
    DenseWorkspace ws{alloc_f32(kQueryTile * kKvTile), alloc_f32(kQueryTile * pb.d_v),
                      alloc_f32(pb.d_v), std::vector<float>(kQueryTile),
                      std::vector<float>(kQueryTile)};
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i) attend_tile(pb, tasks[i], ws, args.o, lse);
  }
}

}  // namespace dsakit::cpu
