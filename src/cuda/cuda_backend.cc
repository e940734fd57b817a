#include "src/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dsakit/error.h"
#include "src/core/validate.h"
#include "src/cuda/attention/attention_ops.h"
#include "src/cuda/attention/merge_kernels.h"
#include "src/cuda/common/check.h"
#include "src/cuda/gemm/projections.h"
#include "src/cuda/indexer/indexer_kernels.h"
#include "src/cuda/pool/kv_pool_kernels.h"

namespace dsakit {
namespace cuda {

namespace {

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation on sm_90

int64_t to_i64(size_t v) {
  return int64_t(v);
}

// The logits kernel to run: DSAKIT_INDEXER_KERNEL (scalar | tc | sm90-exact | sm90) overrides
// the option.
IndexerKernel indexer_kernel(const CudaBackendOptions& options) {
  constexpr const char* kEnv = "DSAKIT_INDEXER_KERNEL";
  const char* s = std::getenv(kEnv);
  if (s == nullptr || *s == 0) return options.indexer_kernel;
  const std::string v = s;
  DSAKIT_CHECK_ARG(v == "scalar" || v == "tc" || v == "sm90-exact" || v == "sm90", kEnv,
                   ": expected 'scalar', 'tc', 'sm90-exact' or 'sm90', got '", v, "'");
  return v == "sm90"         ? IndexerKernel::kWgmma
         : v == "sm90-exact" ? IndexerKernel::kWgmmaExact
         : v == "tc"         ? IndexerKernel::kTensorCore
                             : IndexerKernel::kScalar;
}

// A boolean option that the environment variable `env` (0 | 1) overrides.
bool env_switch(const char* env, bool option) {
  const char* s = std::getenv(env);
  if (s == nullptr || *s == 0) return option;
  const std::string v = s;
  DSAKIT_CHECK_ARG(v == "0" || v == "1", env, ": expected '0' or '1', got '", v, "'");
  return v == "1";
}

// The wgmma logits kernel's operands for a wgmma choice.
LogitsOperands logits_operands(IndexerKernel kernel) {
  return kernel == IndexerKernel::kWgmmaExact ? LogitsOperands::kF16 : LogitsOperands::kE4m3;
}
bool is_wgmma(IndexerKernel kernel) {
  return kernel == IndexerKernel::kWgmmaExact || kernel == IndexerKernel::kWgmma;
}

// The attention kernel to run: the environment variable `env` (auto | sm80 | sm90) overrides
// the option.
AttentionKernel attention_kernel(const char* env, AttentionKernel option) {
  const char* s = std::getenv(env);
  if (s == nullptr || *s == 0) return option;
  const std::string v = s;
  DSAKIT_CHECK_ARG(v == "auto" || v == "sm80" || v == "sm90", env,
                   ": expected 'auto', 'sm80' or 'sm90', got '", v, "'");
  return v == "sm80"   ? AttentionKernel::kMmaSync
         : v == "sm90" ? AttentionKernel::kWgmma
                       : AttentionKernel::kAuto;
}

// The wgmma sparse kernel's heads per CTA: DSAKIT_SPARSE_MLA_SM90_HEADS (auto | 16 | 32 | 64)
// overrides the option (auto: 0, by H).
int sparse_mla_sm90_heads(int option) {
  const char* s = std::getenv("DSAKIT_SPARSE_MLA_SM90_HEADS");
  if (s == nullptr || *s == 0) return option;
  const std::string v = s;
  DSAKIT_CHECK_ARG(v == "auto" || v == "16" || v == "32" || v == "64",
                   "DSAKIT_SPARSE_MLA_SM90_HEADS: expected 'auto', '16', '32' or '64', got '", v,
                   "'");
  return v == "auto" ? 0 : std::stoi(v);
}

// The wgmma dense kernel's head group: DSAKIT_DENSE_HEAD_GROUP (auto | n >= 1) overrides the
// option (auto: 0, by the K / V bytes).
int dense_head_group(int option) {
  constexpr const char* kEnv = "DSAKIT_DENSE_HEAD_GROUP";
  const char* s = std::getenv(kEnv);
  if (s == nullptr || *s == 0) return option;
  const std::string v = s;
  if (v == "auto") return 0;
  char* end = nullptr;
  const long n = std::strtol(s, &end, 10);
  DSAKIT_CHECK_ARG(*end == 0 && n >= 1 && n <= (1 << 20), kEnv,
                   ": expected 'auto' or a head count >= 1, got '", v, "'");
  return int(n);
}

}  // namespace

struct CudaBackend::ProjectionOperands {
  cudaDataType operand_type = CUDA_R_16BF;
  const void* w = nullptr;
  float* staging[2] = {nullptr, nullptr};  // f32 result of output i, rounded into it afterwards

  void* out(int i, const TensorView& o) const { return staging[i] ? staging[i] : o.data; }
  cudaDataType out_type(int i, const TensorView& o) const {
    return staging[i] || o.dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  }
};

CudaBackend::CudaBackend(int device_index) : device_(device_index) {
  const int count = cuda_device_count();
  DSAKIT_CHECK(device_index >= 0 && device_index < count, kUnsupported,
               "device cuda:", device_index, ": no such CUDA device (", count, " visible)");
  cudaDeviceProp prop{};
  DSAKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_index));
  const int arch = prop.major * 10 + prop.minor;
  DSAKIT_CHECK(arch == 90, kUnsupported, "device cuda:", device_index, " (", prop.name, ") is sm_",
               arch, "; this dsakit build ships sm_90a kernels only (H100/H200)");
  caps_ = cuda_capabilities(arch);
  caps_.device_name = prop.name;
  sm_count_ = prop.multiProcessorCount;

  activate();
  DSAKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking));
  stream_ = own_stream_;
  DSAKIT_CUBLAS_CHECK(cublasCreate(&cublas_));
  DSAKIT_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // No TF32, and split-K partial sums reduced in fp32, never in the bf16 output type.
  DSAKIT_CUBLAS_CHECK(cublasSetMathMode(
      cublas_,
      cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  // A fixed cuBLAS workspace: cuBLAS then never allocates inside an op (graph capture).
  DSAKIT_CUDA_CHECK(cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes));
  DSAKIT_CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes));
  gemm_plans_ = std::make_unique<GemmPlans>(cublas_workspace_, kCublasWorkspaceBytes);
  arena_ = std::make_shared<DeviceArena>(device_);
}

CudaBackend::~CudaBackend() {
  // Destructors must not throw: errors here are ignored.
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  gemm_plans_.reset();
  if (cublas_) cublasDestroy(cublas_);
  if (cublas_workspace_) cudaFree(cublas_workspace_);
  if (own_stream_) cudaStreamDestroy(own_stream_);
  cudaSetDevice(previous);
}

void CudaBackend::activate() const {
  // cudaGetDevice reads the thread's current device without a driver call; switch only when
  // another device is current (every op and allocation calls this).
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device_) return;
  DSAKIT_CUDA_CHECK(cudaSetDevice(device_));
}

void CudaBackend::set_stream(cudaStream_t stream) {
  activate();
  DSAKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  stream_ = stream ? stream : own_stream_;
  DSAKIT_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
}

MemoryStats CudaBackend::memory_stats() const {
  MemoryStats stats;
  arena_->add_stats(stats);
  workspace_.add_stats(stats);
  return stats;
}

Backend::HostIndexValues CudaBackend::host_index_values(const TensorView& t) const {
  if (t.device != Device::kCuda) return Backend::host_index_values(t);
  HostIndexValues h;
  // A view that is not a contiguous device i32 tensor is left to the shape checks to reject.
  if (!options_.host_value_checks || t.dtype != DType::kI32 || !t.is_contiguous() ||
      (t.data == nullptr && t.numel() != 0) || stream_is_capturing(stream_))
    return h;
  activate();
  h.copy.resize(size_t(t.numel()));
  if (t.numel() > 0) {
    DSAKIT_CUDA_CHECK(
        cudaMemcpyAsync(h.copy.data(), t.data, t.nbytes(), cudaMemcpyDeviceToHost, stream_));
    DSAKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  h.data = h.copy.data();
  return h;
}

// ---- memory ---------------------------------------------------------------------------------

Tensor CudaBackend::empty(DType dtype, const std::vector<int64_t>& shape) {
  activate();
  TensorView view = make_view(nullptr, dtype, Device::kCuda, shape);
  std::shared_ptr<void> block = arena_->allocate(view.nbytes());
  view.data = block.get();
  // A captured graph keeps writing its blocks on every replay: they must never go back to the
  // arena's free list for another tensor, so the backend holds them until it is destroyed.
  if (stream_is_capturing(stream_)) graph_blocks_.push_back(block);
  return Tensor(std::move(block), view);
}

void CudaBackend::copy(const TensorView& dst, const TensorView& src) {
  DSAKIT_CHECK_ARG(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: dst ",
                   to_string(dst.dtype), dst.shape_str(), " vs src ", to_string(src.dtype),
                   src.shape_str());
  DSAKIT_CHECK_ARG(dst.is_contiguous() && src.is_contiguous(), "copy: tensors must be contiguous");
  if (dst.nbytes() == 0) return;
  if (dst.device == Device::kCpu && src.device == Device::kCpu) {
    std::memmove(dst.data, src.data, dst.nbytes());
    return;
  }
  activate();
  // A host source is copied to pinned staging at once and the DMA is queued behind the stream's
  // work, without waiting for it (not while capturing a graph: a replay would re-read staging
  // memory that has been reused since).
  if (src.device == Device::kCpu && dst.device == Device::kCuda &&
      dst.nbytes() <= PinnedStaging::kMaxBytes && !stream_is_capturing(stream_)) {
    staging_.copy_to_device(dst.data, src.data, dst.nbytes(), stream_);
    return;
  }
  DSAKIT_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, dst.nbytes(), cudaMemcpyDefault, stream_));
  // A host side is read or may be freed by the caller as soon as copy() returns.
  if (dst.device == Device::kCpu || src.device == Device::kCpu)
    DSAKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaBackend::fill_bytes(const TensorView& dst, uint8_t byte) {
  DSAKIT_CHECK_ARG(dst.device == Device::kCuda && dst.is_contiguous(),
                   "fill_bytes: expected a contiguous cuda tensor");
  if (dst.nbytes() == 0) return;
  activate();
  DSAKIT_CUDA_CHECK(cudaMemsetAsync(dst.data, byte, dst.nbytes(), stream_));
}

void CudaBackend::poison(const TensorView& dst) {
  // All-ones bytes are a NaN in f32, f64 and bf16 (exponent all ones, mantissa non-zero), and
  // 0xFF bytes for the integer dtypes: one memset serves every dtype.
  fill_bytes(dst, 0xFF);
}

void CudaBackend::synchronize() {
  activate();
  DSAKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

double CudaBackend::time_ms(const std::function<void()>& fn) {
  activate();
  // Events of this call (fn may time its own parts with time_ms).
  cudaEvent_t start = nullptr, stop = nullptr;
  DSAKIT_CUDA_CHECK(cudaEventCreate(&start));
  const auto destroy = [&] {
    cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  };
  float ms = 0;
  try {
    DSAKIT_CUDA_CHECK(cudaEventCreate(&stop));
    DSAKIT_CUDA_CHECK(cudaStreamSynchronize(stream_));
    DSAKIT_CUDA_CHECK(cudaEventRecord(start, stream_));
    fn();
    DSAKIT_CUDA_CHECK(cudaEventRecord(stop, stream_));
    DSAKIT_CUDA_CHECK(cudaEventSynchronize(stop));
    DSAKIT_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  } catch (...) {
    destroy();
    throw;
  }
  destroy();
  return double(ms);
}

Backend::Ceilings CudaBackend::measure_ceilings() {
  activate();
  // Median of 10 runs after 2 warm-ups, each timed by time_ms (CUDA events on the stream).
  auto median_ms = [&](const std::function<void()>& fn) {
    std::vector<double> ms;
    for (int i = 0; i < 12; ++i) {
      const double t = time_ms(fn);
      if (i >= 2) ms.push_back(t);
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    return ms[ms.size() / 2];
  };
  Ceilings c;
  const int64_t bytes = int64_t(1) << 30;
  {
    Tensor src = empty(DType::kU8, {bytes}), dst = empty(DType::kU8, {bytes});
    fill_bytes(src, 0x5A);
    const double ms = median_ms([&] {
      DSAKIT_CUDA_CHECK(cudaMemcpyAsync(dst.view().data, src.view().data, size_t(bytes),
                                        cudaMemcpyDeviceToDevice, stream_));
    });
    c.copy_gbs = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
  }
  const int n = 8192;
  Tensor a = empty(DType::kBF16, {n, n}), b = empty(DType::kBF16, {n, n}),
         o = empty(DType::kBF16, {n, n});
  fill_bytes(a, 0x3C);  // bf16 0x3C3C ~ 0.0115: finite, nonzero operands
  fill_bytes(b, 0x3C);
  const float one = 1, zero = 0;
  const double ms = median_ms([&] {
    DSAKIT_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one,
                                     a.view().data, CUDA_R_16BF, n, b.view().data, CUDA_R_16BF, n,
                                     &zero, o.view().data, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
  });
  c.gemm_tflops = 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12;
  c.gemm = "cuBLAS bf16 8192^3";
  return c;
}

// ---- pool -----------------------------------------------------------------------------------

namespace {

StoreKvParams store_kv_params(PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                              const TensorView& k_pe) {
  const KvPoolDesc& d = pool.desc();
  return {locs.ptr<const int32_t>(),
          c_kv.ptr<const bf16_t>(),
          k_pe.ptr<const bf16_t>(),
          c_kv.stride[0],
          k_pe.stride[0],
          pool.storage().ptr<uint8_t>(),
          locs.numel(),
          d.num_locations(),
          d.row(),
          d.scale_policy,
          d.k_scale};
}

StoreIndexKeysParams store_index_keys_params(IndexKeyPool& pool, const TensorView& locs,
                                             const TensorView& idx_k) {
  const IndexKeyPoolDesc& d = pool.desc();
  return {locs.ptr<const int32_t>(),
          idx_k.ptr<const bf16_t>(),
          pool.storage().ptr<uint8_t>(),
          locs.numel(),
          d.num_locations(),
          d.page_size,
          d.d_i};
}

}  // namespace

void CudaBackend::store_kv(PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                           const TensorView& k_pe) {
  activate();
  const HostIndexValues host_locs = host_index_values(locs);
  validate::store_kv(pool, locs, c_kv, k_pe, Device::kCuda, host_locs.data);
  DSAKIT_CUDA_CHECK(launch_store_kv(store_kv_params(pool, locs, c_kv, k_pe), stream_));
}

void CudaBackend::store_tokens(PagedKvPool& kv, IndexKeyPool& index, const TensorView& locs,
                               const TensorView& c_kv, const TensorView& k_pe,
                               const TensorView& idx_k) {
  activate();
  const HostIndexValues host_locs = host_index_values(locs);
  validate::store_kv(kv, locs, c_kv, k_pe, Device::kCuda, host_locs.data);
  validate::store_index_keys(index, locs, idx_k, Device::kCuda, host_locs.data);
  DSAKIT_CUDA_CHECK(launch_store_tokens(store_kv_params(kv, locs, c_kv, k_pe),
                                        store_index_keys_params(index, locs, idx_k), stream_));
}

void CudaBackend::gather_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                            const TensorView& k_pe) {
  activate();
  const HostIndexValues host_locs = host_index_values(locs);
  validate::gather_kv(pool, locs, c_kv, k_pe, Device::kCuda, host_locs.data);
  const KvPoolDesc& d = pool.desc();
  const GatherKvParams p{locs.ptr<const int32_t>(),
                         pool.storage().ptr<const uint8_t>(),
                         c_kv.data,
                         k_pe.data,
                         c_kv.dtype == DType::kF32,
                         k_pe.dtype == DType::kF32,
                         c_kv.stride[0],
                         k_pe.stride[0],
                         locs.numel(),
                         d.num_locations(),
                         d.row(),
                         d.k_scale};
  DSAKIT_CUDA_CHECK(launch_gather_kv(p, stream_));
}

void CudaBackend::store_index_keys(IndexKeyPool& pool, const TensorView& locs,
                                   const TensorView& idx_k) {
  activate();
  const HostIndexValues host_locs = host_index_values(locs);
  validate::store_index_keys(pool, locs, idx_k, Device::kCuda, host_locs.data);
  DSAKIT_CUDA_CHECK(launch_store_index_keys(store_index_keys_params(pool, locs, idx_k), stream_));
}

// ---- indexer --------------------------------------------------------------------------------

namespace {

float indexer_head_scale(int64_t h_i, int64_t d_i) {
  return float(1.0 / std::sqrt(double(h_i) * double(d_i)));
}

IndexerLogitsParams logits_params(const IndexerArgs& a) {
  const IndexKeyPoolDesc& kd = a.keys->desc();
  IndexerLogitsParams p{};
  p.q8 = a.q8.ptr<const uint8_t>();
  p.gate = a.gate.ptr<const float>();
  p.key_pages = a.keys->storage().ptr<const uint8_t>();
  p.kv_locs = a.kv_locs.ptr<const int32_t>();
  p.kv_start = a.kv_start.ptr<const int32_t>();
  p.ctx_len = a.ctx_len.ptr<const int32_t>();
  p.n_kv = a.kv_locs.numel();
  p.num_locations = kd.num_locations();
  p.page_size = kd.page_size;
  p.h_i = int(a.q8.shape[1]);
  p.d_i = kd.d_i;
  p.skip_ctx_at_most = -1;
  p.fill_masked = true;
  return p;
}

// The kernel that runs for these logits: the requested one if it can, else the next simpler
// one (wgmma -> mma.sync -> scalar); the scalar kernel must fit the device's shared memory.
IndexerKernel choose_logits_kernel(IndexerKernel requested, const IndexerLogitsParams& p,
                                   int device) {
  if (is_wgmma(requested) && indexer_logits_sm90_supported(p, logits_operands(requested)))
    return requested;
  int optin = 0;
  DSAKIT_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (requested != IndexerKernel::kScalar && indexer_logits_tc_supported(p.h_i, p.d_i, optin))
    return IndexerKernel::kTensorCore;
  const size_t need = indexer_logits_smem_bytes(p.h_i, p.d_i);
  DSAKIT_CHECK(need <= size_t(optin), kUnsupported, "indexer logits: H_i = ", p.h_i,
               ", d_i = ", p.d_i, " needs ", need,
               " B of shared memory per block, the device allows ", optin);
  return IndexerKernel::kScalar;
}

cudaError_t launch_logits(IndexerKernel kernel, const IndexerLogitsParams& p, int key_splits,
                          int sms, cudaStream_t stream) {
  switch (kernel) {
    case IndexerKernel::kWgmmaExact:
    case IndexerKernel::kWgmma:
      return launch_indexer_logits_sm90(p, logits_operands(kernel), key_splits, sms, stream);
    case IndexerKernel::kTensorCore:
      return launch_indexer_logits_tc(p, stream);
    case IndexerKernel::kScalar:
      break;
  }
  return launch_indexer_logits(p, stream);
}

}  // namespace

void CudaBackend::indexer_quantize_q(const TensorView& idx_q, const TensorView& idx_w,
                                     const TensorView& q8, const TensorView& gate) {
  activate();
  validate::indexer_quantize_q(idx_q, idx_w, q8, gate, Device::kCuda);
  const int64_t h_i = idx_q.shape[1], d_i = idx_q.shape[2];
  DSAKIT_CHECK_ARG(d_i % 4 == 0, "idx_q: head dim expected a multiple of 4, got ", d_i);
  const QuantizeQParams p{idx_q.ptr<const bf16_t>(),   idx_w.ptr<const float>(), q8.ptr<uint8_t>(),
                          gate.ptr<float>(),           idx_q.shape[0] * h_i,     int(d_i),
                          indexer_head_scale(h_i, d_i)};
  DSAKIT_CUDA_CHECK(launch_indexer_quantize_q(p, stream_));
}

void CudaBackend::indexer_logits(const IndexerArgs& a, int64_t row_begin, int64_t row_end,
                                 const TensorView& logits, const IndexerLogitsOptions& options) {
  activate();
  const HostIndexValues kv_locs = host_index_values(a.kv_locs),
                        kv_start = host_index_values(a.kv_start),
                        ctx_len = host_index_values(a.ctx_len);
  validate::indexer_args(a, Device::kCuda, kv_locs.data, kv_start.data, ctx_len.data);
  validate::indexer_logits_out(a, row_begin, row_end, logits, Device::kCuda, ctx_len.data);
  IndexerLogitsParams p = logits_params(a);
  p.logits = logits.ptr<float>();
  p.row_begin = row_begin;
  p.row_end = row_end;
  p.width = logits.shape[1];
  p.skip_ctx_at_most = options.skip_ctx_at_most;
  p.fill_masked = options.fill_masked;
  p.page_tma = env_switch("DSAKIT_LOGITS_PAGE_TMA", options_.logits_page_tma);
  const IndexerKernel kernel = choose_logits_kernel(indexer_kernel(options_), p, device_);
  DSAKIT_CHECK_ARG(options_.indexer_key_splits >= 0,
                   "CudaBackendOptions::indexer_key_splits: expected >= 0, got ",
                   options_.indexer_key_splits);
  DSAKIT_CHECK_ARG(options_.indexer_logits_ctas >= 0,
                   "CudaBackendOptions::indexer_logits_ctas: expected >= 0, got ",
                   options_.indexer_logits_ctas);
  const int ctas = options_.indexer_logits_ctas > 0
                       ? std::min(options_.indexer_logits_ctas, sm_count_)
                       : sm_count_;
  DSAKIT_CUDA_CHECK(launch_logits(kernel, p, options_.indexer_key_splits, ctas, stream_));
}

void CudaBackend::topk(const TensorView& logits, const TensorView& ctx_len, int k,
                       const TensorView& out) {
  activate();
  const HostIndexValues host_ctx = host_index_values(ctx_len);
  validate::topk(logits, ctx_len, k, out, Device::kCuda, host_ctx.data);
  const TopkParams p{logits.ptr<const float>(), ctx_len.ptr<const int32_t>(),
                     out.ptr<int32_t>(),        logits.shape[0],
                     logits.shape[1],           k};
  DSAKIT_CHECK_ARG(options_.topk_threads == 0 || options_.topk_threads == 256 ||
                       options_.topk_threads == 512 || options_.topk_threads == 1024,
                   "CudaBackendOptions::topk_threads: expected 0, 256, 512 or 1024, got ",
                   options_.topk_threads);
  DSAKIT_CUDA_CHECK(launch_topk(p, options_.topk_threads, stream_));
}

void CudaBackend::positions_to_locations(const TensorView& positions, const TensorView& kv_locs,
                                         const TensorView& kv_start, const TensorView& ctx_len,
                                         const TensorView& out) {
  activate();
  const HostIndexValues host_start = host_index_values(kv_start),
                        host_ctx = host_index_values(ctx_len);
  validate::positions_to_locations(positions, kv_locs, kv_start, ctx_len, out, Device::kCuda,
                                   host_start.data, host_ctx.data);
  const bool identity = kv_locs.ndim == 0;
  const PositionsToLocationsParams p{positions.ptr<const int32_t>(),
                                     identity ? nullptr : kv_locs.ptr<const int32_t>(),
                                     kv_start.ptr<const int32_t>(),
                                     ctx_len.ptr<const int32_t>(),
                                     out.ptr<int32_t>(),
                                     positions.shape[0],
                                     int(positions.shape[1]),
                                     identity ? int64_t(INT32_MAX) + 1 : kv_locs.numel()};
  DSAKIT_CUDA_CHECK(launch_positions_to_locations(p, stream_));
}

void CudaBackend::topk_to_kv_mask(const TensorView& positions, const TensorView& mask) {
  activate();
  validate::topk_to_kv_mask(positions, mask, Device::kCuda, nullptr);
  const HostIndexValues host = host_index_values(positions);
  validate::topk_to_kv_mask(positions, mask, Device::kCuda, host.data);
  const TopkToKvMaskParams p{positions.ptr<const int32_t>(), static_cast<uint32_t*>(mask.data),
                             positions.shape[0], int(positions.shape[1]), mask.shape[1]};
  DSAKIT_CUDA_CHECK(launch_topk_to_kv_mask(p, stream_));
}

// ---- projections ----------------------------------------------------------------------------
// cuBLAS needs both GEMM operands in one type. bf16 activations multiply kv_b_proj as stored;
// f32 activations multiply an exact f32 copy of it (workspace), and a bf16 output is then
// rounded from an f32 staging buffer.

CudaBackend::ProjectionOperands CudaBackend::prepare_projection(
    const TensorView& act, const TensorView& w, std::initializer_list<const TensorView*> outs) {
  ProjectionOperands ops;
  if (act.dtype == DType::kBF16) {
    ops.operand_type = CUDA_R_16BF;
    ops.w = w.data;
    return ops;
  }
  ops.operand_type = CUDA_R_32F;
  float* w32 = nullptr;
  auto carve = [&](WorkspaceCarver& c) {
    w32 = c.take<float>(w.numel());
    int i = 0;
    for (const TensorView* o : outs) {
      ops.staging[i] = o->dtype == DType::kBF16 ? c.take<float>(o->numel()) : nullptr;
      ++i;
    }
  };
  WorkspaceCarver sizing(nullptr);
  carve(sizing);
  WorkspaceCarver slices(workspace_.ensure(sizing.bytes(), stream_));
  carve(slices);
  DSAKIT_CUDA_CHECK(launch_bf16_to_f32(w.data, w32, w.numel(), stream_));
  ops.w = w32;
  return ops;
}

void CudaBackend::finish_projection(const ProjectionOperands& ops,
                                    std::initializer_list<const TensorView*> outs) {
  int i = 0;
  for (const TensorView* o : outs) {
    if (ops.staging[i])
      DSAKIT_CUDA_CHECK(launch_f32_to_bf16(ops.staging[i], o->data, o->numel(), stream_));
    ++i;
  }
}

void CudaBackend::absorb_q(const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
                           const TensorView& q_abs) {
  activate();
  validate::absorb_q(q_nope, kv_b_proj, d_v, q_abs, Device::kCuda);
  const ProjectionDims dims{q_nope.shape[0], int(q_nope.shape[1]), int(q_nope.shape[2]), d_v,
                            int(kv_b_proj.shape[1])};
  const ProjectionOperands ops = prepare_projection(q_nope, kv_b_proj, {&q_abs});
  DSAKIT_CUBLAS_CHECK(gemm_absorb_q(gemm_context(), dims, ops.operand_type, q_nope.data, ops.w,
                                    ops.out_type(0, q_abs), ops.out(0, q_abs)));
  finish_projection(ops, {&q_abs});
}

void CudaBackend::up_proj_v(const TensorView& o_lat, const TensorView& kv_b_proj, int d_nope,
                            const TensorView& o) {
  activate();
  validate::up_proj_v(o_lat, kv_b_proj, d_nope, o, Device::kCuda);
  const ProjectionDims dims{o_lat.shape[0], int(o_lat.shape[1]), d_nope, int(o.shape[2]),
                            int(o_lat.shape[2])};
  const ProjectionOperands ops = prepare_projection(o_lat, kv_b_proj, {&o});
  DSAKIT_CUBLAS_CHECK(gemm_up_project(gemm_context(), dims, ops.operand_type, o_lat.data, dims.d_c,
                                      ops.w, d_nope, dims.d_v, ops.out_type(0, o), ops.out(0, o)));
  finish_projection(ops, {&o});
}

void CudaBackend::up_proj_kv(const TensorView& c_kv, const TensorView& kv_b_proj,
                             const TensorView& k_nope, const TensorView& v) {
  activate();
  validate::up_proj_kv(c_kv, kv_b_proj, k_nope, v, Device::kCuda, /*kv_halves_ok=*/true);
  const ProjectionDims dims{c_kv.shape[0], int(k_nope.shape[1]), int(k_nope.shape[2]),
                            int(v.shape[2]), int(c_kv.shape[1])};
  if (are_kv_halves(k_nope, v)) {
    // One GEMM writes both halves: per head, W rows [W_UK[h]; W_UV[h]] are contiguous, and the
    // output [N, H, d_nope + d_v] is exactly kv_halves' buffer.
    DSAKIT_CHECK(c_kv.dtype == DType::kBF16 && k_nope.dtype == DType::kBF16, kUnsupported,
                 "cuda up_proj_kv: k_nope/v as halves of one buffer need bf16 c_kv and outputs; "
                 "got c_kv ",
                 to_string(c_kv.dtype), ", outputs ", to_string(k_nope.dtype));
    DSAKIT_CUBLAS_CHECK(gemm_up_project(gemm_context(), dims, CUDA_R_16BF, c_kv.data, 0,
                                        kv_b_proj.data, 0, dims.d_nope + dims.d_v, CUDA_R_16BF,
                                        k_nope.data));
    return;
  }
  const ProjectionOperands ops = prepare_projection(c_kv, kv_b_proj, {&k_nope, &v});
  // c_kv [N, d_c] is shared by every head: head stride 0.
  DSAKIT_CUBLAS_CHECK(gemm_up_project(gemm_context(), dims, ops.operand_type, c_kv.data, 0, ops.w,
                                      0, dims.d_nope, ops.out_type(0, k_nope), ops.out(0, k_nope)));
  DSAKIT_CUBLAS_CHECK(gemm_up_project(gemm_context(), dims, ops.operand_type, c_kv.data, 0, ops.w,
                                      dims.d_nope, dims.d_v, ops.out_type(1, v), ops.out(1, v)));
  finish_projection(ops, {&k_nope, &v});
}

int64_t CudaBackend::up_proj_kv_fp8_scratch_bytes(int64_t n, int64_t w_rows, int d_c) const {
  const int64_t padded = (n + kFp8GemmRows - 1) / kFp8GemmRows * kFp8GemmRows;
  // The codes and tile scales of the padded rows, the tail's scales and its bf16 output rows.
  return padded * (d_c + 4 * (d_c / kFp8TileSize)) +
         kFp8GemmRows * (4 * (d_c / kFp8TileSize) + 2 * w_rows);
}

void CudaBackend::up_proj_kv_fp8(const PagedKvPool& pool, const TensorView& locs,
                                 const Fp8BlockWeights& w, const TensorView& k_nope,
                                 const TensorView& v, const TensorView& k_pe) {
  activate();
  const HostIndexValues host_locs = host_index_values(locs);
  validate::up_proj_kv_fp8(pool, locs, w, k_nope, v, k_pe, Device::kCuda, host_locs.data,
                           /*kv_halves_ok=*/true);
  DSAKIT_CHECK(are_kv_halves(k_nope, v) && k_nope.dtype == DType::kBF16, kUnsupported,
               "cuda up_proj_kv_fp8: k_nope / v must be the bf16 halves of one [N, H, d_nope + "
               "d_v] buffer (kv_halves)");
  const KvPoolDesc& d = pool.desc();
  DSAKIT_CHECK(d.d_c % (4 * kFp8TileSize) == 0, kUnsupported,
               "cuda up_proj_kv_fp8: d_c must be a multiple of 512 (cuBLASLt takes 128 x 128 block "
               "scales in groups of 4 along d_c), got ",
               d.d_c);
  const int64_t n = locs.numel();
  if (n == 0) return;
  // The GEMMs' rows in multiples of kFp8GemmRows: the first n_main rows in one GEMM straight
  // into k_nope's buffer, the last n % kFp8GemmRows (zero-padded) into a scratch copied after it.
  constexpr int kRows = kFp8GemmRows;
  const int64_t n_main = n / kRows * kRows, tiles = d.d_c / kFp8TileSize;
  const int64_t m = k_nope.shape[1] * (k_nope.shape[2] + v.shape[2]);
  const Tensor codes = empty(DType::kU8, {(n + kRows - 1) / kRows * kRows, d.d_c});
  const Tensor scales = empty(DType::kF32, {tiles, std::max<int64_t>(n_main, 1)});
  const Tensor tail_scales = empty(DType::kF32, {tiles, kRows});
  const GatherKvCodesParams p{locs.ptr<const int32_t>(),
                              pool.storage().ptr<const uint8_t>(),
                              codes.ptr<uint8_t>(),
                              scales.ptr<float>(),
                              tail_scales.ptr<float>(),
                              k_pe.data,
                              k_pe.dtype == DType::kF32,
                              n,
                              n_main,
                              kRows,
                              d.num_locations(),
                              d.row(),
                              d.k_scale};
  DSAKIT_CUDA_CHECK(launch_gather_kv_codes(p, stream_));
  ProjectionDims dims{n_main, int(k_nope.shape[1]), int(k_nope.shape[2]), int(v.shape[2]),
                      int(d.d_c)};
  const auto project = [&](const void* x, const float* x_scales, void* out) {
    const cublasStatus_t status = gemm_up_project_fp8(
        gemm_context(), dims, x, x_scales, w.codes.data, w.scales.ptr<const float>(), out);
    DSAKIT_CHECK(status != CUBLAS_STATUS_NOT_SUPPORTED, kUnsupported,
                 "cuda up_proj_kv_fp8: this cuBLASLt has no block-scaled FP8 GEMM for ", dims.rows,
                 " x ", m, " x ", d.d_c, " on this device (it needs sm_90 and CUDA >= 12.9)");
    DSAKIT_CUBLAS_CHECK(status);
  };
  if (n_main > 0) project(codes.ptr<const uint8_t>(), scales.ptr<const float>(), k_nope.data);
  if (n_main < n) {
    const Tensor tail = empty(DType::kBF16, {kRows, m});
    dims.rows = kRows;
    project(codes.ptr<const uint8_t>() + n_main * d.d_c, tail_scales.ptr<const float>(),
            tail.ptr<bf16_t>());
    DSAKIT_CUDA_CHECK(cudaMemcpyAsync(
        static_cast<bf16_t*>(k_nope.data) + n_main * m, tail.ptr<const bf16_t>(),
        size_t((n - n_main) * m) * sizeof(bf16_t), cudaMemcpyDeviceToDevice, stream_));
  }
}

// ---- attention ------------------------------------------------------------------------------

void CudaBackend::sparse_mla(const SparseMlaArgs& args) {
  activate();
  validate::sparse_mla(args, Device::kCuda);
  cuda_sparse_mla(args, stream_,
                  attention_kernel("DSAKIT_SPARSE_MLA_KERNEL", options_.sparse_mla_kernel),
                  sparse_mla_sm90_heads(options_.sparse_mla_sm90_heads));
}

int64_t CudaBackend::dense_mha_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope,
                                             int d_v) const {
  return cuda_dense_mha_scratch_bytes(num_kv, num_heads, d_nope, d_v, sm_count_);
}

void CudaBackend::dense_mha(const DenseMhaArgs& args) {
  activate();
  validate::dense_mha(args, Device::kCuda, /*kv_halves_ok=*/true);
  // The schedule and split-KV partials: freed after the launches (the arena reuses them in
  // stream order only).
  std::vector<Tensor> scratch;
  cuda_dense_mha(
      args, sm_count_, stream_,
      [&](size_t bytes) {
        scratch.push_back(empty(DType::kU8, {int64_t(bytes)}));
        return scratch.back().view().data;
      },
      attention_kernel("DSAKIT_DENSE_MHA_KERNEL", options_.dense_mha_kernel),
      dense_head_group(options_.dense_head_group),
      env_switch("DSAKIT_DENSE_SPLIT_BLOCKS", options_.dense_split_blocks));
}

void CudaBackend::merge_partials(const TensorView& o_parts, const TensorView& lse_parts,
                                 const TensorView& o, const TensorView& lse) {
  activate();
  validate::merge_partials(o_parts, lse_parts, o, lse, Device::kCuda);
  const MergePartialsParams p{
      o_parts.data,          lse_parts.ptr<const float>(), o.data,
      lse.ptr<float>(),      o.dtype == DType::kF32,       o_parts.shape[1] * o_parts.shape[2],
      int(o_parts.shape[0]), int(o_parts.shape[3]),        o_parts.dtype == DType::kBF16};
  DSAKIT_CUDA_CHECK(launch_merge_partials(p, stream_));
}

}  // namespace cuda

// ---- entry points of dsakit/backend.h -------------------------------------------------------

bool cuda_backend_compiled() {
  return true;
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: not an error for the caller
    return 0;
  }
  return count;
}

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  return std::make_unique<cuda::CudaBackend>(device_index);
}

}  // namespace dsakit
