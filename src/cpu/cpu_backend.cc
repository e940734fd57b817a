// The CPU backend: validates each op's arguments (src/core/validate.h), then runs the CPU
// kernel (src/cpu/kernels.h). Host memory only.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "src/core/validate.h"
#include "src/cpu/gemm/blas.h"
#include "src/cpu/kernels.h"

namespace dsakit {
namespace {

const int32_t* host_i32(const TensorView& t) {
  return t.ptr<const int32_t>();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) {
    ctx_.threads = threads > 0 ? threads : omp_get_max_threads();
    caps_.device = Device::kCpu;
    caps_.device_name = "cpu (" + std::to_string(ctx_.threads) + " threads)";
    caps_.sm_arch = 0;
    caps_.dense_mha = true;
    caps_.fp8_up_proj = true;
    caps_.dense_kv_visible = true;
    caps_.dense_kv_mask = true;
    caps_.intermediate_dtype = DType::kF32;
  }

  const Capabilities& capabilities() const override { return caps_; }
  std::unique_ptr<Backend> make_peer() const override {
    return std::make_unique<CpuBackend>(ctx_.threads);
  }

  Tensor empty(DType dtype, const std::vector<int64_t>& shape) override {
    return Tensor::host(dtype, shape);
  }

  void copy(const TensorView& dst, const TensorView& src) override {
    DSAKIT_CHECK_ARG(dst.device == Device::kCpu && src.device == Device::kCpu,
                     "cpu backend copy: both tensors must be host tensors");
    DSAKIT_CHECK_ARG(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: dst ",
                     to_string(dst.dtype), dst.shape_str(), " vs src ", to_string(src.dtype),
                     src.shape_str());
    DSAKIT_CHECK_ARG(dst.is_contiguous() && src.is_contiguous(),
                     "copy: tensors must be contiguous");
    if (dst.nbytes()) std::memmove(dst.data, src.data, dst.nbytes());
  }

  void fill_bytes(const TensorView& dst, uint8_t byte) override {
    DSAKIT_CHECK_ARG(dst.device == Device::kCpu && dst.is_contiguous(),
                     "fill_bytes: expected a contiguous host tensor");
    if (dst.nbytes()) std::memset(dst.data, byte, dst.nbytes());
  }

  void poison(const TensorView& dst) override {
    DSAKIT_CHECK_ARG(dst.device == Device::kCpu && dst.is_contiguous(),
                     "poison: expected a contiguous host tensor");
    const int64_t n = dst.numel();
    switch (dst.dtype) {
      case DType::kF32:
        std::fill_n(dst.ptr<float>(), n, std::numeric_limits<float>::quiet_NaN());
        break;
      case DType::kF64:
        std::fill_n(dst.ptr<double>(), n, std::numeric_limits<double>::quiet_NaN());
        break;
      case DType::kBF16:
        std::fill_n(dst.ptr<bf16_t>(), n, bf16_t{0x7FC0});
        break;
      default:
        fill_bytes(dst, 0xFF);
        break;
    }
  }

  void synchronize() override {}

  Ceilings measure_ceilings() override {
    Ceilings c;
    const int threads = ctx_.threads;
    const int64_t bytes = int64_t(256) << 20;
    std::unique_ptr<char[]> src(new char[size_t(bytes)]), dst(new char[size_t(bytes)]);
    std::memset(src.get(), 0x5A, size_t(bytes));
    std::memset(dst.get(), 0, size_t(bytes));
    // Best of `runs` wall times, each by time_ms.
    auto best_ms = [&](int runs, const std::function<void()>& fn) {
      double best = 1e300;
      for (int i = 0; i < runs; ++i) best = std::min(best, time_ms(fn));
      return best;
    };
    const double copy_ms = best_ms(5, [&] {
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int i = 0; i < 64; ++i)
        std::memcpy(dst.get() + i * (bytes / 64), src.get() + i * (bytes / 64), size_t(bytes / 64));
    });
    c.copy_gbs = 2.0 * double(bytes) / (copy_ms * 1e-3) / 1e9;
    const int n = 2048;
    std::vector<float> a(size_t(n) * n, 0.5f), b(size_t(n) * n, 0.25f), o(size_t(n) * n);
    cpu::ScopedBlasThreads blas(threads);
    const double gemm_ms = best_ms(
        3, [&] { cpu::sgemm(false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, o.data(), n); });
    c.gemm_tflops = 2.0 * n * double(n) * n / (gemm_ms * 1e-3) / 1e12;
    c.gemm = "OpenBLAS sgemm 2048^3, " + std::to_string(threads) + " threads";
    return c;
  }

  void store_kv(PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                const TensorView& k_pe) override {
    validate::store_kv(pool, locs, c_kv, k_pe, Device::kCpu, host_i32(locs));
    cpu::store_kv(ctx_, pool, locs, c_kv, k_pe);
  }
  void gather_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                 const TensorView& k_pe) override {
    validate::gather_kv(pool, locs, c_kv, k_pe, Device::kCpu, host_i32(locs));
    cpu::gather_kv(ctx_, pool, locs, c_kv, k_pe);
  }
  void store_index_keys(IndexKeyPool& pool, const TensorView& locs,
                        const TensorView& idx_k) override {
    validate::store_index_keys(pool, locs, idx_k, Device::kCpu, host_i32(locs));
    cpu::store_index_keys(ctx_, pool, locs, idx_k);
  }

  void indexer_quantize_q(const TensorView& idx_q, const TensorView& idx_w, const TensorView& q8,
                          const TensorView& gate) override {
    validate::indexer_quantize_q(idx_q, idx_w, q8, gate, Device::kCpu);
    cpu::indexer_quantize_q(ctx_, idx_q, idx_w, q8, gate);
  }
  void indexer_logits(const IndexerArgs& a, int64_t row_begin, int64_t row_end,
                      const TensorView& logits, const IndexerLogitsOptions& options) override {
    validate::indexer_args(a, Device::kCpu, host_i32(a.kv_locs), host_i32(a.kv_start),
                           host_i32(a.ctx_len));
    validate::indexer_logits_out(a, row_begin, row_end, logits, Device::kCpu, host_i32(a.ctx_len));
    cpu::indexer_logits(ctx_, a, row_begin, row_end, logits, options);
  }
  void topk(const TensorView& logits, const TensorView& ctx_len, int k,
            const TensorView& out) override {
    validate::topk(logits, ctx_len, k, out, Device::kCpu, host_i32(ctx_len));
    cpu::topk(ctx_, logits, ctx_len, k, out);
  }
  void absorb_q(const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
                const TensorView& q_abs) override {
    validate::absorb_q(q_nope, kv_b_proj, d_v, q_abs, Device::kCpu);
    cpu::absorb_q(ctx_, q_nope, kv_b_proj, d_v, q_abs);
  }
  void up_proj_v(const TensorView& o_lat, const TensorView& kv_b_proj, int d_nope,
                 const TensorView& o) override {
    validate::up_proj_v(o_lat, kv_b_proj, d_nope, o, Device::kCpu);
    cpu::up_proj_v(ctx_, o_lat, kv_b_proj, d_nope, o);
  }
  void up_proj_kv(const TensorView& c_kv, const TensorView& kv_b_proj, const TensorView& k_nope,
                  const TensorView& v) override {
    validate::up_proj_kv(c_kv, kv_b_proj, k_nope, v, Device::kCpu);
    cpu::up_proj_kv(ctx_, c_kv, kv_b_proj, k_nope, v);
  }
  void up_proj_kv_fp8(const PagedKvPool& pool, const TensorView& locs, const Fp8BlockWeights& w,
                      const TensorView& k_nope, const TensorView& v,
                      const TensorView& k_pe) override {
    validate::up_proj_kv_fp8(pool, locs, w, k_nope, v, k_pe, Device::kCpu, host_i32(locs));
    cpu::up_proj_kv_fp8(ctx_, pool, locs, w, k_nope, v, k_pe);
  }
  int64_t up_proj_kv_fp8_scratch_bytes(int64_t n, int64_t w_rows, int d_c) const override {
    return 4 * (n + w_rows) * d_c;  // the f32 rows and the f32 weights
  }

  void sparse_mla(const SparseMlaArgs& a) override {
    validate::sparse_mla(a, Device::kCpu);
    cpu::sparse_mla(ctx_, a);
  }
  void dense_mha(const DenseMhaArgs& a) override {
    validate::dense_mha(a, Device::kCpu);
    cpu::dense_mha(ctx_, a);
  }
  void merge_partials(const TensorView& o_parts, const TensorView& lse_parts, const TensorView& o,
                      const TensorView& lse) override {
    validate::merge_partials(o_parts, lse_parts, o, lse, Device::kCpu);
    cpu::merge_partials(ctx_, o_parts, lse_parts, o, lse);
  }

  void select_rows(const TensorView& src, const TensorView& rows, const TensorView& dst) override {
    validate::select_rows(src, rows, dst, Device::kCpu, host_i32(rows));
    cpu::select_rows(ctx_, src, rows, dst);
  }
  void merge_topk(const TensorView& scores, const TensorView& positions, int k,
                  const TensorView& out) override {
    validate::merge_topk(scores, positions, k, out, Device::kCpu);
    cpu::merge_topk(ctx_, scores, positions, k, out);
  }

  void positions_to_locations(const TensorView& positions, const TensorView& kv_locs,
                              const TensorView& kv_start, const TensorView& ctx_len,
                              const TensorView& out) override {
    validate::positions_to_locations(positions, kv_locs, kv_start, ctx_len, out, Device::kCpu,
                                     host_i32(kv_start), host_i32(ctx_len));
    const int64_t t = positions.shape[0], k = positions.shape[1];
    const int32_t* pos = host_i32(positions);
    const int32_t* locs = kv_locs.ndim == 0 ? nullptr : host_i32(kv_locs);  // null: identity
    int32_t* dst = out.ptr<int32_t>();
    for (int64_t i = 0; i < t; ++i) {
      const int32_t start = host_i32(kv_start)[i], len = host_i32(ctx_len)[i];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t p = pos[i * k + j];
        dst[i * k + j] = !(p >= 0 && p < len) ? -1 : locs ? locs[start + p] : start + p;
      }
    }
  }

 private:
  cpu::CpuContext ctx_;
  Capabilities caps_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace dsakit
