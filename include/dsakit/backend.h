// The backend interface: every kernel of the layer, on one device. The layer composes these
// ops; tests run the same suite against every backend. Arguments are device views on the
// backend's device unless noted; every op validates its arguments (shapes, dtypes, devices,
// index ranges that can be checked without a device round trip) before any write.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dsakit/pool.h"
#include "dsakit/tensor.h"

namespace dsakit {

struct Capabilities {
  Device device = Device::kCpu;
  std::string device_name;        // "cpu (2 threads)", "NVIDIA H200"
  int sm_arch = 0;                // 90 for sm_90; 0 on the CPU
  bool dense_mha = false;         // a dense MHA path exists for this device
  bool dense_kv_visible = false;  // dense_mha honours DenseMhaArgs::kv_visible (DCP)
  bool dense_kv_mask = false;     // dense_mha honours DenseMhaArgs::kv_mask
  // up_proj_kv and dense_mha also take k_nope / v as the two halves of one [N, H, d_nope + d_v]
  // buffer (kv_halves()): the up-projection is then one GEMM instead of two.
  bool kv_halves = false;
  // up_proj_kv_fp8 exists: the K/V up-projection as an FP8 GEMM on an FP8 pool's codes.
  bool fp8_up_proj = false;
  // (d_nope, d_rope, d_v) the dense kernels are compiled for; empty: any (the CPU backend).
  std::vector<std::array<int, 3>> dense_head_dims;
  // The compiled kernel instances, one line per kernel family (`dsakit info`); empty: any shape.
  std::vector<std::string> kernel_instances;
  DType intermediate_dtype = DType::kF32;  // q_abs, o_lat, up-projected K/V
  // sparse_mla reads a bf16 pool faster than an fp8 / fp8-raw one (CUDA sm_90: the wgmma kernels'
  // producers widen every fp8 row they gather): the layer's sparse path then reads an FP8 pool's
  // context through a bf16 copy of it where each copied row is read often
  // (docs/layer.md#staged-rows).
  bool sparse_prefers_bf16_rows = false;
  // ... except fp8-raw pools at up to this many heads, which sparse_mla reads directly at least as
  // fast (CUDA sm_90: 32, the keys-on-M kernel widens the codes in its consumers' registers): the
  // layer reads those pools as they are.
  int sparse_reads_fp8_raw_heads = 0;
};

// k_nope [N, H, d_nope] and v [N, H, d_v] as views of one [N, H, d_nope + d_v] buffer (row n,
// head h: d_nope values of k_nope then d_v of v), the layout a single up-projection GEMM with
// kv_b_proj writes (its rows are [W_UK[h]; W_UV[h]] per head). For backends with
// Capabilities::kv_halves.
struct KvHalves {
  TensorView k_nope, v;
};
KvHalves kv_halves(const TensorView& kv, int64_t d_nope);
// True when (k_nope, v) are laid out as kv_halves() makes them (and not contiguous tensors).
bool are_kv_halves(const TensorView& k_nope, const TensorView& v);

// kv_b_proj as an FP8 checkpoint stores it (DeepSeek-V3's block-quantized linear weights): e4m3
// codes and one f32 scale per 128 x 128 block, W[r, c] = e4m3(codes[r, c]) · scales[r / 128,
// c / 128] (docs/formats.md#fp8-weights).
struct Fp8BlockWeights {
  TensorView codes;   // u8  [H*(d_nope+d_v), d_c]  e4m3 bytes, rows as kv_b_proj's
  TensorView scales;  // f32 [ceil(H*(d_nope+d_v) / 128), d_c / 128]
  bool defined() const { return codes.ndim != 0; }
};

// Indexer (docs/design.md, "Lightning indexer") over the index-key pool. Scores of token t cover
// positions 0 … ctx_len[t]-1 of its request, whose locations are kv_locs[kv_start[t] + p].
struct IndexerArgs {
  TensorView q8;    // u8  [T, H_i, d_i]  e4m3 bytes of idx_q / s_q
  TensorView gate;  // f32 [T, H_i]       idx_w · H_i^-0.5 · d_i^-0.5 · s_q
  const IndexKeyPool* keys = nullptr;
  TensorView kv_locs;   // i32 [N_kv]
  TensorView kv_start;  // i32 [T]
  TensorView ctx_len;   // i32 [T]
};

// What indexer_logits may leave unwritten when its caller is the top-k of the same rows.
struct IndexerLogitsOptions {
  int64_t skip_ctx_at_most = -1;  // rows with ctx_len[t] <= this are not written at all
  bool fill_masked = true;        // false: entries p >= ctx_len[t] are not written
};

// Bound on the indexer's scratch per block of query rows (FP8 queries, gates, logits), bytes:
// the environment's DSAKIT_INDEXER_WORKSPACE_BYTES (a positive integer) when set, else
// kIndexerBlockBytes. Throws kInvalidArgument naming the variable for any other value.
inline constexpr int64_t kIndexerBlockBytes = int64_t(256) << 20;
int64_t indexer_block_bytes();

// How indexer_topk cuts T query rows over num_kv key rows (shapes only, never index values, so an
// eager call and a captured graph of the same shapes agree): blocks of `rows` rows, each with
// q8 u8 [rows, H_i, d_i], gate f32 [rows, H_i] and logits f32 [rows, width = num_kv], `bytes` in
// all; at least one row per block even when one row alone exceeds the bound. When every context
// fits in k (num_kv <= k) every row is the identity: no blocks, 0 bytes.
struct IndexerBlocks {
  int64_t rows = 0;
  int64_t width = 0;
  int64_t bytes = 0;
  static IndexerBlocks plan(int64_t tokens, int64_t h_i, int64_t d_i, int64_t num_kv, int k,
                            int64_t block_bytes);
};

struct SparseMlaArgs {
  // q_abs and q_pe may be strided views (unit stride in the last dim), e.g. the column ranges
  // [0, d_c) and [d_c, d_c + d_rope) of one [T, H, d_c + d_rope] query tensor.
  TensorView q_abs;  // [T, H, d_c]   bf16 | f32 (absorbed no-position query)
  TensorView q_pe;   // [T, H, d_rope] bf16 | f32
  const PagedKvPool* kv = nullptr;
  TensorView indices;      // i32 [T, k] pool locations; < 0 or >= num_locations: skipped
  TensorView topk_length;  // optional i32 [T]: token t reads only slots [0, topk_length[t])
  double sm_scale = 0;
  TensorView o_lat;  // out [T, H, d_c] bf16 | f32
  TensorView lse;    // out f32 [T, H], natural log; +inf for a query with no valid slot
  // Optional out f32 [T, H]: max over the valid slots of sm_scale·q·k; -inf with no valid slot.
  TensorView max_logits;
};

struct DenseMhaArgs {
  TensorView q_nope;  // [T, H, d_nope] bf16 | f32
  TensorView q_pe;    // [T, H, d_rope] bf16 | f32
  TensorView k_nope;  // [N, H, d_nope] bf16 | f32 (up-projected from the pool)
  TensorView k_pe;    // [N, d_rope]    bf16 | f32 (shared by all heads)
  TensorView v;       // [N, H, d_v]    bf16 | f32
  TensorView cu_q;    // i32 [B+1]
  TensorView cu_kv;   // i32 [B+1]; query i of request r sees kv rows [0, L_r - E_r + i]
  // Optional i32 [T]: query t sees the first kv_visible[t] kv rows of its request instead
  // (non-decreasing within a request, <= L_r; context-parallel shards). ndim == 0: the causal
  // default. kv_visible_host is its host copy (required when kv_visible is set).
  TensorView kv_visible;
  const int32_t* kv_visible_host = nullptr;
  // Optional i32 [T, W], bits: query t sees kv row p (< its visible count) of its request only
  // where bit p % 32 of word p / 32 of row t is set; W · 32 >= every request's kv length. The
  // sparse path's selection as dense attention (a top-k as a mask). Backends with
  // Capabilities::dense_kv_mask; the others refuse it (Error(kUnsupported)). CUDA multiplies a
  // masked key's V row by P = 0: it must be finite there.
  TensorView kv_mask;
  // Host copies of cu_q / cu_kv (always host memory), for scheduling without a device read.
  const int32_t* cu_q_host = nullptr;
  const int32_t* cu_kv_host = nullptr;
  int num_requests = 0;
  double sm_scale = 0;
  TensorView o;    // out [T, H, d_v] bf16 | f32
  TensorView lse;  // out f32 [T, H]
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const Capabilities& capabilities() const = 0;
  Device device() const { return capabilities().device; }
  // A new backend on the same device with its own stream and memory (CPU: the same threads).
  // One backend serves one thread at a time; threads that run concurrently take a peer each.
  virtual std::unique_ptr<Backend> make_peer() const = 0;

  // ---- memory -------------------------------------------------------------------------
  virtual Tensor empty(DType dtype, const std::vector<int64_t>& shape) = 0;
  // Copies between any two devices; shapes' numel and dtypes must match. In stream order with
  // the backend's work; a host source may be reused as soon as copy() returns, a host
  // destination holds the data when it returns (a device-to-host copy synchronizes).
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  virtual void fill_bytes(const TensorView& dst, uint8_t byte) = 0;
  // Fills with NaN (float tensors) or 0xFF bytes: poison before a kernel writes.
  virtual void poison(const TensorView& dst) = 0;
  virtual void synchronize() = 0;
  // Milliseconds fn's work takes as the device sees it, from an idle device: CUDA times it with
  // events recorded on the stream before and after fn (the gaps while the host enqueues are
  // included, the wake-up of a final host synchronization is not); the default is wall time
  // between two synchronize() calls.
  virtual double time_ms(const std::function<void()>& fn);

  // The machine's ceilings, measured now (benchmarks print results against them): copy
  // bandwidth (read + write bytes of a large device-to-device copy) and the dense GEMM rate of
  // the precision the backend computes its projections in (CUDA: cuBLAS bf16 8192^3; CPU:
  // OpenBLAS sgemm 2048^3 on the backend's threads). Takes about a second.
  struct Ceilings {
    double copy_gbs = 0, gemm_tflops = 0;
    std::string gemm;  // what the GEMM rate is of
  };
  virtual Ceilings measure_ceilings() = 0;

  // Host-side value checks of device index tensors (locations, kv_start, ctx_len, top-k): on
  // CUDA a device-to-host copy and a sync per op, so a bad index is refused before any write.
  // The layer turns them off around the ops it feeds with indices it built itself from a
  // validated batch; kernels still bound-check every index they read. Returns the previous
  // setting. The CPU backend checks in place at no cost and ignores it.
  virtual bool set_index_value_checks(bool on) {
    (void)on;
    return true;
  }
  // The values of an i32 index tensor for those checks: `data` points at host memory holding
  // them (the tensor itself on the CPU, a synchronizing copy on a device), or is null when the
  // backend checks no values now (checks off; CUDA: also while a graph is being captured).
  struct HostIndexValues {
    std::vector<int32_t> copy;
    const int32_t* data = nullptr;
  };
  virtual HostIndexValues host_index_values(const TensorView& t) const;

  // ---- workspace ----------------------------------------------------------------------
  // Device memory this backend holds now: its cached tensor blocks and its scratch workspace.
  // Blocks go back to the backend's cache, never to the driver, so this is the peak since the
  // backend was made. 0 on the CPU (its tensors are ordinary heap memory).
  virtual int64_t device_bytes_held() const { return 0; }
  // Device scratch an op allocates beyond its arguments, in bytes, from shapes alone: the
  // layer's workspace bound (DsaAttention::workspace_bytes) adds these to its own tensors.
  // dense_mha over num_kv key rows of num_heads heads:
  virtual int64_t dense_mha_scratch_bytes(int64_t num_kv, int64_t num_heads, int d_nope,
                                          int d_v) const {
    (void)num_kv, (void)num_heads, (void)d_nope, (void)d_v;
    return 0;
  }

  PagedKvPool make_kv_pool(const KvPoolDesc& desc);  // zero-filled
  IndexKeyPool make_index_pool(const IndexKeyPoolDesc& desc);
  Tensor to_device(const TensorView& host);  // copy of a host tensor
  Tensor to_host(const TensorView& t);

  // ---- pool ---------------------------------------------------------------------------
  // Quantizes n tokens into their locations. locs: i32 [n], c_kv: bf16 [n, d_c],
  // k_pe: bf16 [n, d_rope], each one's rows possibly strided (unit stride in the last dim), e.g.
  // the two column ranges of one [n, d_c + d_rope] array. Locations must be distinct and in range.
  virtual void store_kv(PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                        const TensorView& k_pe) = 0;
  // Dequantizes n locations into c_kv [n, d_c] and k_pe [n, d_rope] (bf16 or f32). Each output's
  // rows may be strided (unit stride in the last dim), e.g. the two column ranges of a bf16
  // pool's storage: copying rows into a bf16 pool is gather_kv into its c_kv and k_pe columns.
  virtual void gather_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
                         const TensorView& k_pe) = 0;
  // Quantizes idx_k bf16 [n, d_i] per token (power-of-two scale) into the index-key pool.
  virtual void store_index_keys(IndexKeyPool& pool, const TensorView& locs,
                                const TensorView& idx_k) = 0;
  // A layer's new tokens into both pools at the same locations: store_kv(kv, locs, c_kv, k_pe)
  // and store_index_keys(index, locs, idx_k), each argument checked before either pool is
  // written. The CUDA backend runs both in one launch.
  virtual void store_tokens(PagedKvPool& kv, IndexKeyPool& index, const TensorView& locs,
                            const TensorView& c_kv, const TensorView& k_pe,
                            const TensorView& idx_k);

  // ---- indexer ------------------------------------------------------------------------
  // idx_q bf16 [T, H_i, d_i], idx_w f32 [T, H_i] -> q8 u8 [T, H_i, d_i], gate f32 [T, H_i].
  virtual void indexer_quantize_q(const TensorView& idx_q, const TensorView& idx_w,
                                  const TensorView& q8, const TensorView& gate) = 0;
  // Logits of tokens [row_begin, row_end) into logits f32 [row_end - row_begin, width]:
  // entry (t, p) for p < ctx_len[t] (requires ctx_len[t] <= width), -inf for p >= ctx_len[t]
  // unless options say otherwise.
  virtual void indexer_logits(const IndexerArgs& args, int64_t row_begin, int64_t row_end,
                              const TensorView& logits,
                              const IndexerLogitsOptions& options = {}) = 0;
  // Top-k of each logits row over its first ctx_len[t] entries: the selected positions in
  // ascending order, -1 padded, into out i32 [rows, k]. Largest scores win; ties go to the lower
  // position; NaN ranks below every number (-inf included). A row with ctx_len[t] <= k selects
  // 0 … ctx_len[t]-1 without reading its logits, so logits [rows, width] needs width >= ctx_len[t]
  // only for the rows with ctx_len[t] > k (logits [rows, 0] when there are none).
  virtual void topk(const TensorView& logits, const TensorView& ctx_len, int k,
                    const TensorView& out) = 0;
  // The whole indexer, the same on every backend (src/core/indexer_topk.cc): validates, then
  // quantize, logits and top-k of one block of query rows at a time (IndexerBlocks), with the
  // identity shortcut for tokens whose ctx_len <= k (no logits computed for them).
  // out: i32 [T, k] positions within each request, ascending, -1 padded.
  void indexer_topk(const TensorView& idx_q, const TensorView& idx_w, const IndexerArgs& layout,
                    int k, const TensorView& out);
  // The same from queries already quantized: args.q8 u8 [T, H_i, d_i] and args.gate f32
  // [T, H_i] as indexer_logits reads them (e.g. DeepGEMM's e4m3 q and weights).
  void indexer_topk(const IndexerArgs& args, int k, const TensorView& out);

  // ---- projections (GEMMs) ------------------------------------------------------------
  // kv_b_proj: bf16 [H*(d_nope+d_v), d_c] (per head: d_nope rows of W_UK, then d_v of W_UV).
  // q_abs[t,h] = q_nope[t,h] · W_UK[h]: q_nope [T, H, d_nope] -> q_abs [T, H, d_c].
  virtual void absorb_q(const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
                        const TensorView& q_abs) = 0;
  // o[t,h] = W_UV[h] · o_lat[t,h]: o_lat [T, H, d_c] -> o [T, H, d_v].
  virtual void up_proj_v(const TensorView& o_lat, const TensorView& kv_b_proj, int d_nope,
                         const TensorView& o) = 0;
  // k_nope[n,h] = W_UK[h] · c_kv[n], v[n,h] = W_UV[h] · c_kv[n]:
  // c_kv [N, d_c] -> k_nope [N, H, d_nope], v [N, H, d_v].
  virtual void up_proj_kv(const TensorView& c_kv, const TensorView& kv_b_proj,
                          const TensorView& k_nope, const TensorView& v) = 0;
  // The same for the FP8 pool rows at locs i32 [N] (fp8 or fp8-raw layout) and FP8 weights,
  // without dequantizing either: k_nope[n,h,j] = Σ_c x[n,c] · W[h (d_nope+d_v) + j, c] with
  // x[n,c] = e4m3(code) · its tile scale (k_scale for fp8-raw) and W as Fp8BlockWeights defines
  // it, summed in f32; k_pe [N, d_rope] as gather_kv writes it. d_c a multiple of 128. Backends
  // with Capabilities::fp8_up_proj; the others throw Error(kUnsupported).
  virtual void up_proj_kv_fp8(const PagedKvPool& pool, const TensorView& locs,
                              const Fp8BlockWeights& kv_b_proj, const TensorView& k_nope,
                              const TensorView& v, const TensorView& k_pe);
  // Bytes of device memory up_proj_kv_fp8 allocates for n rows and w_rows = H·(d_nope + d_v).
  virtual int64_t up_proj_kv_fp8_scratch_bytes(int64_t n, int64_t w_rows, int d_c) const {
    (void)n, (void)w_rows, (void)d_c;
    return 0;
  }

  // ---- attention ----------------------------------------------------------------------
  virtual void sparse_mla(const SparseMlaArgs& args) = 0;
  virtual void dense_mha(const DenseMhaArgs& args) = 0;
  // Merges W partial results by lse (DCP): o = Σ_w exp(lse_w - lse) o_w, lse = log Σ exp(lse_w).
  // o_parts [W, T, H, D] (bf16|f32), lse_parts f32 [W, T, H] -> o [T, H, D] (bf16|f32), lse f32
  // [T, H]. A part with lse = +inf (no valid key) contributes nothing.
  virtual void merge_partials(const TensorView& o_parts, const TensorView& lse_parts,
                              const TensorView& o, const TensorView& lse) = 0;

  // ---- context parallelism (docs/layer.md) ---------------------------------------------
  // dst[i] = src[rows[i]]: src [N, ...] and dst [M, ...] contiguous, one dtype, the same trailing
  // shape; rows i32 [M], each in [0, N) (checked on the host where index checks are on; the
  // kernel skips a row out of range).
  virtual void select_rows(const TensorView& src, const TensorView& rows, const TensorView& dst);
  // The global top-k of W shards' candidates: row t's candidates are (scores[w, t, j],
  // positions[w, t, j]) for every w and j with positions >= 0 (positions distinct within a row).
  // Writes the k best of them as positions in ascending order, -1 padded, into out i32 [T, k]:
  // larger score first, NaN below every number (-inf included), ties to the lower position. A
  // row with at most k candidates selects all of them without reading their scores.
  // scores f32 [W, T, C], positions i32 [W, T, C], C >= 1, W * C <= kMergeTopkMaxCandidates.
  static constexpr int64_t kMergeTopkMaxCandidates = 16384;
  virtual void merge_topk(const TensorView& scores, const TensorView& positions, int k,
                          const TensorView& out);

  // ---- index plumbing -----------------------------------------------------------------
  // Top-k positions -> pool locations: out[t, j] = kv_locs[kv_start[t] + pos] for a valid
  // pos = positions[t, j] in [0, ctx_len[t]), else -1. positions/out: i32 [T, k]. kv_locs
  // undefined (ndim 0): the identity, out[t, j] = kv_start[t] + pos — the row of a copy that
  // holds the batch's context rows in kv_locs order (the layer's staged rows).
  virtual void positions_to_locations(const TensorView& positions, const TensorView& kv_locs,
                                      const TensorView& kv_start, const TensorView& ctx_len,
                                      const TensorView& out);
  // Top-k positions -> DenseMhaArgs::kv_mask: mask i32 [T, W] gets bit p of row t set exactly
  // for the positions p >= 0 in positions[t, :] (i32 [T, k]; -1 padding skipped; every p <
  // W · 32, checked before anything is written). The base implementation builds the bits on the
  // host (a round trip through host memory on a device backend).
  virtual void topk_to_kv_mask(const TensorView& positions, const TensorView& mask);
};

// Backend::set_index_value_checks(false) for the scope's lifetime, then the previous setting
// back: around ops fed with indices the caller built itself from validated input (the kernels
// still bound-check every index they read).
class IndexValueChecksOff {
 public:
  explicit IndexValueChecksOff(Backend& be)
      : be_(be), previous_(be.set_index_value_checks(false)) {}
  ~IndexValueChecksOff() { be_.set_index_value_checks(previous_); }
  IndexValueChecksOff(const IndexValueChecksOff&) = delete;
  IndexValueChecksOff& operator=(const IndexValueChecksOff&) = delete;

 private:
  Backend& be_;
  bool previous_;
};

// What the CUDA backend offers on a device of compute capability `sm_arch` (90 = sm_90): the
// planner's view, shared by CudaBackend and `dsakit plan --device cuda`, so a described device and
// a real one plan alike. device_name is "cuda sm_<arch>" (CudaBackend replaces it).
Capabilities cuda_capabilities(int sm_arch);

// The CPU backend (always built). threads <= 0: OpenMP's default.
std::unique_ptr<Backend> make_cpu_backend(int threads = 0);
// The CUDA backend on `device_index`; throws Error(kUnsupported) when dsakit was built without
// CUDA or no usable GPU is present.
std::unique_ptr<Backend> make_cuda_backend(int device_index = 0);
bool cuda_backend_compiled();
int cuda_device_count();  // 0 without CUDA or without a GPU
// "cpu" | "cuda" | "auto" (cuda when a GPU is present, else cpu).
std::unique_ptr<Backend> make_backend(const std::string& device);

}  // namespace dsakit
