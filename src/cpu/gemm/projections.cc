// Projections through kv_b_proj (docs/design.md#sparse-mla, #dense-mha) as per-head fp32 GEMMs.
//
// kv_b_proj is bf16 [H * (d_nope + d_v), d_c]: head h owns the row block starting at
// h * (d_nope + d_v), whose first d_nope rows are W_UK[h] [d_nope, d_c] and next d_v rows are
// W_UV[h] [d_v, d_c]. It is converted to fp32 once per call (no cache across calls).
#include "dsakit/error.h"
#include "src/cpu/gemm/blas.h"
#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

// C_h[m, n] = A_h[m, k] · op(B_h) for h in [0, heads); head h's operands start at a fixed
// element offset per head (a_head, b_head, c_head) and keep the row strides lda, ldb, ldc.
struct PerHeadGemm {
  int64_t heads = 0, m = 0, n = 0, k = 0;
  bool trans_b = false;
  const float* a = nullptr;
  int64_t lda = 0, a_head = 0;
  const float* b = nullptr;
  int64_t ldb = 0, b_head = 0;
  float* c = nullptr;
  int64_t ldc = 0, c_head = 0;
};

// One single-threaded sgemm per (head, block of rows of A and C), spread over ctx.threads.
void run_per_head(const CpuContext& ctx, const PerHeadGemm& g) {
  constexpr int64_t kRowBlock = 128;
  const int64_t row_blocks = (g.m + kRowBlock - 1) / kRowBlock;
  const int64_t tasks = g.heads * row_blocks;
  ScopedBlasThreads blas_threads(1);
#pragma omp parallel for num_threads(ctx.threads) schedule(dynamic, 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t h = task / row_blocks;
    const int64_t row0 = (task % row_blocks) * kRowBlock;
    const int64_t rows = std::min(kRowBlock, g.m - row0);
    sgemm(g.trans_b, rows, g.n, g.k, 1.0f, g.a + h * g.a_head + row0 * g.lda, g.lda,
          g.b + h * g.b_head, g.ldb, 0.0f, g.c + h * g.c_head + row0 * g.ldc, g.ldc);
  }
}

}  // namespace

// q_abs[t, h, :] = q_nope[t, h, :] · W_UK[h]   ([d_nope] x [d_nope, d_c] -> [d_c]).
void absorb_q(const CpuContext& ctx, const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
              const TensorView& q_abs) {
  const int64_t tokens = q_nope.shape[0], heads = q_nope.shape[1], d_nope = q_nope.shape[2];
  const int64_t d_c = kv_b_proj.shape[1];
  if (tokens == 0) return;
  const F32Operand w(kv_b_proj, ctx.threads);
  const F32Operand q(q_nope, ctx.threads);
  const F32Result out(q_abs);
  const PerHeadGemm g{.heads = heads,
                      .m = tokens,
                      .n = d_c,
                      .k = d_nope,
                      .trans_b = false,
                      .a = q.data(),
                      .lda = heads * d_nope,
                      .a_head = d_nope,
                      .b = w.data(),
                      .ldb = d_c,
                      .b_head = (d_nope + d_v) * d_c,
                      .c = out.data(),
                      .ldc = heads * d_c,
                      .c_head = d_c};
  run_per_head(ctx, g);
  out.commit(ctx.threads);
}

// o[t, h, :] = W_UV[h] · o_lat[t, h, :]   ([d_v, d_c] x [d_c] -> [d_v]).
void up_proj_v(const CpuContext& ctx, const TensorView& o_lat, const TensorView& kv_b_proj,
               int d_nope, const TensorView& o) {
  const int64_t tokens = o_lat.shape[0], heads = o_lat.shape[1], d_c = o_lat.shape[2];
  const int64_t d_v = o.shape[2];
  if (tokens == 0) return;
  const F32Operand w(kv_b_proj, ctx.threads);
  const F32Operand lat(o_lat, ctx.threads);
  const F32Result out(o);
  const PerHeadGemm g{.heads = heads,
                      .m = tokens,
                      .n = d_v,
                      .k = d_c,
                      .trans_b = true,
                      .a = lat.data(),
                      .lda = heads * d_c,
                      .a_head = d_c,
                      .b = w.data() + d_nope * d_c,
                      .ldb = d_c,
                      .b_head = (d_nope + d_v) * d_c,
                      .c = out.data(),
                      .ldc = heads * d_v,
                      .c_head = d_v};
  run_per_head(ctx, g);
  out.commit(ctx.threads);
}

// k_nope[n, h, :] = W_UK[h] · c_kv[n, :], v[n, h, :] = W_UV[h] · c_kv[n, :].
void up_proj_kv(const CpuContext& ctx, const TensorView& c_kv, const TensorView& kv_b_proj,
                const TensorView& k_nope, const TensorView& v) {
  const int64_t rows = c_kv.shape[0], d_c = c_kv.shape[1];
  const int64_t heads = k_nope.shape[1], d_nope = k_nope.shape[2], d_v = v.shape[2];
  if (rows == 0) return;
  const F32Operand w(kv_b_proj, ctx.threads);
  const F32Operand latent(c_kv, ctx.threads);
  const int64_t head_rows = d_nope + d_v;
  // Both outputs share A = c_kv (no per-head offset) and differ in the W rows they read.
  const auto project = [&](const TensorView& dst, int64_t w_row0, int64_t width) {
    const F32Result out(dst);
    const PerHeadGemm g{.heads = heads,
                        .m = rows,
                        .n = width,
                        .k = d_c,
                        .trans_b = true,
                        .a = latent.data(),
                        .lda = d_c,
                        .a_head = 0,
                        .b = w.data() + w_row0 * d_c,
                        .ldb = d_c,
                        .b_head = head_rows * d_c,
                        .c = out.data(),
                        .ldc = heads * width,
                        .c_head = width};
    run_per_head(ctx, g);
    out.commit(ctx.threads);
  };
  project(k_nope, 0, d_nope);
  project(v, d_nope, d_v);
}

// The FP8 form: the pool rows gathered into f32 (e4m3(code) · scale rounded to f32, as gather_kv
// computes it) and W decoded to f32 (e4m3(code) · block scale), then the f32 GEMMs above.
void up_proj_kv_fp8(const CpuContext& ctx, const PagedKvPool& pool, const TensorView& locs,
                    const Fp8BlockWeights& w, const TensorView& k_nope, const TensorView& v,
                    const TensorView& k_pe) {
  const int64_t rows = locs.shape[0], d_c = pool.desc().d_c;
  const Tensor latent = Tensor::host(DType::kF32, {rows, d_c});
  gather_kv(ctx, pool, locs, latent, k_pe);
  const int64_t w_rows = w.codes.shape[0];
  const Tensor weights = Tensor::host(DType::kF32, {w_rows, d_c});
  parallel_chunks(w_rows, ctx.threads, [&](int64_t begin, int64_t n) {
    decode_fp8_block_rows(w.codes.ptr<const uint8_t>(), w.scales.ptr<const float>(), d_c, begin,
                          begin + n, weights.ptr<float>());
  });
  up_proj_kv(ctx, latent, weights, k_nope, v);
}

}  // namespace dsakit::cpu
