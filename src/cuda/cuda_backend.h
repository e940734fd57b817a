// The CUDA backend (docs/cuda.md): dsakit::Backend on one sm_90 device and one stream.
// Each op validates its arguments with the checks every backend shares (src/core/validate.h),
// then launches kernels from common/, pool/, indexer/, gemm/, dcp/ and attention/ (which dispatches
// to the kernel folders sm80/ and sm90/); those know nothing of the dsakit API. Device memory:
// DeviceArena (empty()) and Workspace (op scratch), see common/workspace.h. docs/cuda.md
// describes kernels, workspace and graph capture.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "dsakit/backend.h"
#include "src/cuda/attention/attention_ops.h"
#include "src/cuda/common/workspace.h"
#include "src/cuda/gemm/projections.h"

namespace dsakit::cuda {

// Which kernel computes the indexer logits (indexer_logits and inside indexer_topk).
enum class IndexerKernel {
  kScalar,      // fp32 CUDA cores on dequantized codes (indexer/logits.cu): the exact cross-check
  kTensorCore,  // mma.sync e4m3 on the raw codes, fp32-exact per k32 step (indexer/logits_tc.cu);
                // where it cannot run (d_i != 128, or too little shared memory) the scalar
                // kernel runs instead
  kWgmmaExact,  // wgmma on the codes widened to f16 (sm90/indexer/): fp32-exact, the
                // arithmetic the mma.sync kernel compiles to; where it cannot run (h_i without an
                // instance, page_size % 4 != 0, unaligned codes) the mma.sync kernel runs instead
  kWgmma,       // wgmma e4m3 on the codes, fp8 accumulation (~1e-4 from fp32, DeepGEMM's
                // arithmetic); the same fallback
};

struct CudaBackendOptions {
  // Copy device index tensors (locations, kv_start, ctx_len) to the host and check their values
  // before any kernel writes, so a rejected call leaves pools untouched. This is a host sync.
  // Off — and automatically while the stream is capturing a CUDA graph — only shapes, dtypes and
  // devices are checked; kernels still bound-check every index they read (out-of-range
  // locations are skipped by stores and gather as zeros).
  bool host_value_checks = true;
  // The f16 wgmma kernel by default: fp32-exact like the mma.sync kernel (the same f16 tensor
  // path), so the layer keeps the float64 reference's top-k sets, and 2.8-3.7x faster
  // (docs/perf.md). kWgmma is faster still with DeepGEMM's fp8 accumulation (~1e-4 rel-L2),
  // which moves near-tie top-k choices: opt in (docs/numerics.md).
  // DSAKIT_INDEXER_KERNEL (scalar | tc | sm90-exact | sm90) overrides it.
  IndexerKernel indexer_kernel = IndexerKernel::kWgmmaExact;
  // The wgmma logits kernel's work items per row group over the key range: 0 chooses by grid size
  // (indexer_logits_key_splits); the logits are the same bits for every value (tested).
  int indexer_key_splits = 0;
  // The wgmma logits kernel's persistent grid: 0 one CTA per SM; n > 0 runs it (and chooses key
  // splits) as if the device had min(n, SMs) SMs. The logits are the same bits for every value.
  int indexer_logits_ctas = 0;
  // The wgmma e4m3 logits kernel loads each half tile of keys that is one run of a page by one
  // TMA box (else 16-byte cp.async per row); the logits are the same bits either way.
  // DSAKIT_LOGITS_PAGE_TMA (0 | 1) overrides it.
  bool logits_page_tma = true;
  // The sparse MLA kernel: kAuto chooses per call (sparse_mla_kernel_for); the environment
  // variable DSAKIT_SPARSE_MLA_KERNEL (auto | sm80 | sm90) overrides it.
  AttentionKernel sparse_mla_kernel = AttentionKernel::kAuto;
  // The wgmma sparse kernel's heads per CTA: 0 chooses by H and layout (the keys-on-M kernel for
  // H <= 16, and on FP8 pools for H <= 32), 16 or 64 forces one, 32 the keys-on-M kernel's
  // 32-head items (fp8-raw pools); DSAKIT_SPARSE_MLA_SM90_HEADS (auto | 16 | 32 | 64) overrides
  // it.
  int sparse_mla_sm90_heads = 0;
  // The dense MHA kernel: kAuto chooses per call (dense_mha_kernel_for); the environment
  // variable DSAKIT_DENSE_MHA_KERNEL (auto | sm80 | sm90) overrides it.
  AttentionKernel dense_mha_kernel = AttentionKernel::kAuto;
  // The wgmma dense kernel's heads per grid group (the CTAs' order; the same bits for every
  // value): 0 chooses by the K / V bytes (dense_head_group), n > 0 takes min(n, H);
  // DSAKIT_DENSE_HEAD_GROUP (auto | n) overrides it.
  int dense_head_group = 0;
  // The wgmma dense kernel's tiles of <= 64 rows split their kv blocks between its two consumer
  // groups (else the first takes them all); DSAKIT_DENSE_SPLIT_BLOCKS (0 | 1) overrides it.
  bool dense_split_blocks = true;
  // Threads per row of the top-k kernel: 0 chooses by row width (topk_threads_for), else 256,
  // 512 or 1024 (the benchmark and the tests run each).
  int topk_threads = 0;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device_index);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const Capabilities& capabilities() const override { return caps_; }
  std::unique_ptr<Backend> make_peer() const override {
    return std::make_unique<CudaBackend>(device_);
  }

  Tensor empty(DType dtype, const std::vector<int64_t>& shape) override;
  void copy(const TensorView& dst, const TensorView& src) override;
  void fill_bytes(const TensorView& dst, uint8_t byte) override;
  void poison(const TensorView& dst) override;
  void synchronize() override;
  double time_ms(const std::function<void()>& fn) override;
  Ceilings measure_ceilings() override;
  bool set_index_value_checks(bool on) override {
    const bool previous = options_.host_value_checks;
    options_.host_value_checks = on;
    return previous;
  }
  HostIndexValues host_index_values(const TensorView& t) const override;
  int64_t device_bytes_held() const override {
    const MemoryStats m = memory_stats();
    return int64_t(m.arena_bytes + m.workspace_bytes);
  }
  int64_t dense_mha_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope,
                                  int d_v) const override;

  void store_kv(PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                const TensorView& k_pe) override;
  void gather_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                 const TensorView& k_pe) override;
  void store_index_keys(IndexKeyPool& pool, const TensorView& locs,
                        const TensorView& idx_k) override;
  void store_tokens(PagedKvPool& kv, IndexKeyPool& index, const TensorView& locs,
                    const TensorView& c_kv, const TensorView& k_pe,
                    const TensorView& idx_k) override;

  void indexer_quantize_q(const TensorView& idx_q, const TensorView& idx_w, const TensorView& q8,
                          const TensorView& gate) override;
  void indexer_logits(const IndexerArgs& args, int64_t row_begin, int64_t row_end,
                      const TensorView& logits, const IndexerLogitsOptions& options) override;
  void topk(const TensorView& logits, const TensorView& ctx_len, int k,
            const TensorView& out) override;

  void absorb_q(const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
                const TensorView& q_abs) override;
  void up_proj_v(const TensorView& o_lat, const TensorView& kv_b_proj, int d_nope,
                 const TensorView& o) override;
  void up_proj_kv(const TensorView& c_kv, const TensorView& kv_b_proj, const TensorView& k_nope,
                  const TensorView& v) override;
  void up_proj_kv_fp8(const PagedKvPool& pool, const TensorView& locs, const Fp8BlockWeights& w,
                      const TensorView& k_nope, const TensorView& v,
                      const TensorView& k_pe) override;
  int64_t up_proj_kv_fp8_scratch_bytes(int64_t n, int64_t w_rows, int d_c) const override;

  void sparse_mla(const SparseMlaArgs& args) override;
  void dense_mha(const DenseMhaArgs& args) override;
  void merge_partials(const TensorView& o_parts, const TensorView& lse_parts, const TensorView& o,
                      const TensorView& lse) override;
  void select_rows(const TensorView& src, const TensorView& rows, const TensorView& dst) override;
  void merge_topk(const TensorView& scores, const TensorView& positions, int k,
                  const TensorView& out) override;
  void positions_to_locations(const TensorView& positions, const TensorView& kv_locs,
                              const TensorView& kv_start, const TensorView& ctx_len,
                              const TensorView& out) override;
  void topk_to_kv_mask(const TensorView& positions, const TensorView& mask) override;

  // ---- CUDA specifics --------------------------------------------------------------------
  cudaStream_t stream() const { return stream_; }
  // All later work goes to `stream` (nullptr: the backend's own stream). Synchronizes the
  // previous stream first, so arena blocks freed under it are safe to reuse on the new one.
  void set_stream(cudaStream_t stream);
  CudaBackendOptions& options() { return options_; }
  MemoryStats memory_stats() const;

 private:
  struct ProjectionOperands;

  void activate() const;  // makes this backend's device current on the calling thread
  ProjectionOperands prepare_projection(const TensorView& act, const TensorView& w,
                                        std::initializer_list<const TensorView*> outs);
  void finish_projection(const ProjectionOperands& ops,
                         std::initializer_list<const TensorView*> outs);

  int device_;
  int sm_count_ = 1;  // streaming multiprocessors (the dense schedule sizes short grids by it)
  Capabilities caps_;
  CudaBackendOptions options_;
  cudaStream_t own_stream_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  void* cublas_workspace_ = nullptr;  // cuBLAS's and the GEMM plans' (one stream)
  std::unique_ptr<GemmPlans> gemm_plans_;
  GemmContext gemm_context() const { return {gemm_plans_.get(), cublas_, stream_}; }
  std::shared_ptr<DeviceArena> arena_;
  std::vector<std::shared_ptr<void>> graph_blocks_;  // allocated while capturing: never recycled
  Workspace workspace_;
  PinnedStaging staging_;  // host -> device copies (declared last: destroyed first)
};

}  // namespace dsakit::cuda
