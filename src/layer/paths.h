// The two paths over a pool, shared by DsaAttention (one rank) and DcpSimulation (one call per
// rank): the same gather → up-projection → dense MHA chain and the same absorbed sparse
// attention, so the two drivers cannot drift apart. DsaAttention runs whole paths (dense_path,
// sparse_path); DcpSimulation composes the attention halves with its own top-k merge.
#pragma once

#include <functional>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/batch.h"
#include "dsakit/config.h"
#include "dsakit/layer.h"

namespace dsakit::detail {

// Host i32 arrays -> one device tensor in one copy; views[i] is arrays[i] (aliasing storage).
// Each host-to-device copy costs the host a few µs (CUDA: pinned staging + a queued DMA), so a
// layer call packs all of its index arrays into one.
struct PackedI32 {
  Tensor storage;
  std::vector<TensorView> views;
};
PackedI32 upload_i32(Backend& be, const std::vector<const std::vector<int32_t>*>& arrays);

// The index arrays a forward call reads on the device, for the requests one BatchIndex covers.
struct DeviceBatchIndex {
  Tensor storage;       // shared by every index of one upload()
  TensorView new_locs;  // [T]
  TensorView kv_locs;   // [N]
  TensorView kv_start;  // [T]
  TensorView ctx_len;   // [T]
  TensorView cu_q;      // [B+1]
  TensorView cu_kv;     // [B+1]

  // All of `indexes` in one copy (a mixed plan uploads its segments together).
  static std::vector<DeviceBatchIndex> upload(Backend& be,
                                              const std::vector<const BatchIndex*>& indexes);
};

// Runs fn, timed under `name` when the caller records stage times.
using StageFn = std::function<void(const char* name, const std::function<void()>& fn)>;

// Dense MHA of T queries over kv_locs (i32 [N] on the device: every key row, request-major):
// gather from the pool (dequantized to the backend's intermediate dtype), up-project K/V with
// kv_b_proj, causal varlen attention. cu_q / cu_kv: host prefix sums [B+1], and d_cu_q /
// d_cu_kv their device copies; kv_visible: optional per-query visible counts (host, [T]; DCP
// shards) with its device copy d_kv_visible. Writes o [T, H, d_v] and lse [T, H].
// stored (optional): the rows of kv_locs exactly as the gather would return them, bit for bit
// (pool_rows_are_inputs() says when the caller's inputs are); the gather is then skipped.
// kv_mask (optional, i32 [T, W] on the device): DenseMhaArgs::kv_mask (the sparse path's
// masked-MHA form).
struct KvRows {
  TensorView c_kv;  // [N, d_c] intermediate dtype
  TensorView k_pe;  // [N, d_rope]
  bool empty() const { return c_kv.data == nullptr; }
};
void dense_path(Backend& be, const ModelConfig& c, double sm_scale, const PagedKvPool& pool,
                const TensorView& kv_locs, const TensorView& q_nope, const TensorView& q_pe,
                const TensorView& kv_b_proj, const std::vector<int32_t>& cu_q,
                const std::vector<int32_t>& cu_kv, const TensorView& d_cu_q,
                const TensorView& d_cu_kv, const std::vector<int32_t>* kv_visible,
                const TensorView& d_kv_visible, const TensorView& o, const TensorView& lse,
                const StageFn& stage, const KvRows& stored = {},
                const Fp8BlockWeights* kv_b_proj_fp8 = nullptr, const TensorView& kv_mask = {});

// LayerOptions::kv_b_proj_fp8 where the dense path's K/V up-projection takes it (given, an fp8
// or fp8-raw pool, a backend with Capabilities::fp8_up_proj), else null.
const Fp8BlockWeights* fp8_up_proj_weights(const Backend& be, const PagedKvPool& pool,
                                           const LayerOptions& options);

// True when gathering kv rows cu_kv from the pool would return the new tokens' c_kv / k_pe
// inputs unchanged: no request has a cached prefix (the kv rows are the new tokens, in order),
// the pool stores bf16 as given (no quantization), and the backend's intermediates are bf16.
bool pool_rows_are_inputs(const Backend& be, const PagedKvPool& pool,
                          const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_kv);

// Staged rows (docs/layer.md#staged-rows): the sparse path copies the batch's N context rows of
// an fp8 / fp8-raw pool into a bf16 pool of N rows (N · bf16 row bytes of workspace, in kv_locs
// order) and sparse_mla reads the copy — the same values where bf16_holds_pool_values(). The copy
// costs a read and a write of each row once; reading bf16 rows saves on every (token, slot)
// read. kAuto stages where the backend prefers bf16 rows and the batch reads each context row at
// least kStagedRowMinReads times on average (Σ_t min(ctx_t, k) >= kStagedRowMinReads · N): a
// prefill reads a row up to k times, a decode step about once.
inline constexpr double kStagedRowMinReads = 32;
// Whether a sparse call of `num_heads` heads that reads `reads` (token, slot) pairs of `rows`
// copied rows stages them (never an fp8-raw pool the backend reads directly at that head count:
// Capabilities::sparse_reads_fp8_raw_heads).
bool stage_sparse_rows(const Backend& be, const PagedKvPool& pool, SparseRows option, double rows,
                       double reads, int64_t num_heads);
// The same for a batch of the layer: N = its positions, reads = Σ_t min(ctx_t, k).
bool stage_sparse_rows(const Backend& be, const PagedKvPool& pool, SparseRows option,
                       const Batch& batch, const ModelConfig& c);
// Workspace of the staged rows of n context rows of `pool`.
int64_t staged_rows_bytes(const KvPoolDesc& pool, int64_t n);
// A layer's option as it runs (DSAKIT_SPARSE_ROWS overrides it; a bad value is an error naming
// the variable), checked against the pool: Error(kInvalidArgument) when it is kStaged and bf16
// does not hold the pool's values. Layers call it when made, before anything is stored.
SparseRows resolve_sparse_rows(const PagedKvPool& pool, SparseRows option);
// The rows of `pool` at kv_locs (i32 [n] on the device), in that order, as a bf16 pool whose
// location r is row r (timed as stage "stage_rows").
PagedKvPool stage_rows(Backend& be, const PagedKvPool& pool, const TensorView& kv_locs,
                       const StageFn& stage);

// `option`, or DSAKIT_SPARSE_FORM where it is set (a bad value is an error naming the variable).
SparseForm sparse_form_from_env(SparseForm option);
// LayerOptions::sparse_form as the layer runs it (sparse_form_from_env): kAuto becomes kMla on a
// backend without the masked dense kernel for the config's head dims (masked_mha_available), where
// kMaskedMha is Error(kUnsupported). Layers call it when made.
SparseForm resolve_sparse_form(const Backend& be, const ModelConfig& c, SparseForm option);
// Words per row of the masked-MHA form's kv_mask over requests of at most max_kv_len positions
// (at least one).
int64_t kv_mask_words(int64_t max_kv_len);

// The sparse path of the T new tokens `bi` / `dev` index: the indexer's top-k positions (into
// topk i32 [T, index_topk], ascending, -1 padded), then by `form`
//   kMla: positions -> pool locations (or, with staged_rows, the rows of the bf16 copy), q
//     absorption, absorbed sparse attention over the selected rows (each token stopping at its
//     context length), and the V up-projection;
//   kMaskedMha: the positions as kv_mask bits (topk_to_kv_mask) and dense_path over every
//     context row with that mask (kv_b_proj_fp8 as there);
// into o [T, H, d_v]; lse [T, H]. Inputs: the layer's q_nope, q_pe, idx_q, idx_w.
void sparse_path(Backend& be, const ModelConfig& c, double sm_scale, const PagedKvPool& kv_pool,
                 const IndexKeyPool& index_pool, const BatchIndex& bi, const DeviceBatchIndex& dev,
                 const LayerInputs& in, const TensorView& kv_b_proj, const TensorView& o,
                 const TensorView& lse, const TensorView& topk, const StageFn& stage,
                 SparseForm form = SparseForm::kMla, bool staged_rows = false,
                 const Fp8BlockWeights* kv_b_proj_fp8 = nullptr);

// Absorbed sparse attention over pool locations: o_lat [T, H, d_c] and lse [T, H] from
// q_abs [T, H, d_c], q_pe [T, H, d_rope] and indices i32 [T, k] (pool locations, -1 skipped).
// topk_length (optional i32 [T]): token t reads only slots [0, topk_length[t]) — pass the
// per-token context length when the indices are the indexer's (ascending, valid slots first,
// -1 padded), so a token with ctx_len < k stops after its ctx_len slots.
void sparse_attention(Backend& be, double sm_scale, const PagedKvPool& pool,
                      const TensorView& q_abs, const TensorView& q_pe, const TensorView& indices,
                      const TensorView& o_lat, const TensorView& lse, const StageFn& stage,
                      const TensorView& topk_length = {});

}  // namespace dsakit::detail
