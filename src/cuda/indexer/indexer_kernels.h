// Launchers of the lightning-indexer kernels (docs/design.md#lightning-indexer, #top-k): query
// quantization, logits over the index-key pool, per-row top-k, top-k positions -> pool
// locations, and top-k positions -> dense_mha's kv_mask bits. Plain parameter structs; every index
// read from device memory is bound-checked in the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsakit/formats.h"
#include "src/cuda/indexer/logits_operands.h"

namespace dsakit::cuda {

struct QuantizeQParams {
  const bf16_t* idx_q;  // [rows, d_i], rows = T * H_i
  const float* idx_w;   // [rows]
  uint8_t* q8;          // [rows, d_i] e4m3 codes of idx_q / s_q
  float* gate;          // [rows] idx_w * head_scale * s_q
  int64_t rows;
  int d_i;           // multiple of 4
  float head_scale;  // H_i^-0.5 * d_i^-0.5
};

struct IndexerLogitsParams {
  const uint8_t* q8;         // [T, h_i, d_i] e4m3 codes
  const float* gate;         // [T, h_i]
  const uint8_t* key_pages;  // index-key pool [num_pages, page_size * (d_i + 4)]
  const int32_t* kv_locs;    // [n_kv] pool locations
  const int32_t* kv_start;   // [T] offset of each token's request in kv_locs
  const int32_t* ctx_len;    // [T] visible positions of each token
  float* logits;             // [row_end - row_begin, width]
  int64_t row_begin;
  int64_t row_end;
  int64_t width;
  int64_t n_kv;
  int64_t num_locations;  // num_pages * page_size
  int page_size;
  int h_i;
  int d_i;  // multiple of 4
  // Rows with ctx_len <= skip_ctx_at_most are left unwritten (top-k's identity shortcut);
  // -1 computes every row.
  int64_t skip_ctx_at_most;
  // Write -inf at positions [ctx_len, width) of computed rows (the indexer_logits contract);
  // top-k never reads them, so indexer_topk leaves them unwritten.
  bool fill_masked;
  // The wgmma e4m3 kernel: a tile half whose 32 rows are one run of a page (consecutive
  // locations, as page tables lay them out) comes by one TMA box instead of 256 cp.async.
  bool page_tma;
  uint64_t* trace;  // [grid][kTraceSlots] event stamps of a trace build (kernel_trace.h); or null
};

struct TopkParams {
  const float* logits;     // [rows, width]; only entries [0, ctx_len) of a row are read, and
                           // none of a row with ctx_len <= k (null when every row is one)
  const int32_t* ctx_len;  // [rows]; a row with ctx_len > k is clamped to width
  int32_t* out;            // [rows, k] ascending positions, -1 padded
  int64_t rows;
  int64_t width;
  int k;
};

struct PositionsToLocationsParams {
  const int32_t* positions;  // [T, k]
  const int32_t* kv_locs;    // [n_kv], or nullptr: the identity (out = kv_start + pos)
  const int32_t* kv_start;   // [T]
  const int32_t* ctx_len;    // [T]
  int32_t* out;              // [T, k] kv_locs[kv_start + pos] for pos in [0, ctx_len), else -1
  int64_t tokens;
  int k;
  int64_t n_kv;  // kv_start + pos < n_kv (identity: 2^31)
};

struct TopkToKvMaskParams {
  const int32_t* positions;  // [T, k] request positions, -1 padded
  uint32_t* mask;            // [T, words] bits: dense_mha's kv_mask
  int64_t tokens;
  int k;
  int64_t words;
};

cudaError_t launch_indexer_quantize_q(const QuantizeQParams& p, cudaStream_t stream);
// Dynamic shared memory the logits kernel needs for h_i heads of d_i values.
size_t indexer_logits_smem_bytes(int h_i, int d_i);
cudaError_t launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream);
// The FP8 tensor-core logits kernel (logits_tc.cu): the same contract, d_i = 128 only.
size_t indexer_logits_tc_smem_bytes(int h_i);
bool indexer_logits_tc_supported(int h_i, int d_i, size_t smem_optin);
cudaError_t launch_indexer_logits_tc(const IndexerLogitsParams& p, cudaStream_t stream);
// The wgmma logits kernel (src/cuda/sm90/indexer/): the same contract, for the (h_i, operands)
// of its instances (instances.h), d_i = 128, page_size % 4 == 0 and 16-byte aligned key pages
// and query codes. kF16 is fp32-exact like the mma.sync kernel; kE4m3 accumulates in fp8
// (~1e-4 rel-L2 from fp32; the kernel header).
bool indexer_logits_sm90_supported(const IndexerLogitsParams& p, LogitsOperands ops);
// key_splits: work items per row group over the key range, 0 to choose by grid size against the
// device's `sms` streaming multiprocessors; the persistent grid has min(items, sms) CTAs (the
// logits are the same bits for any value of either).
cudaError_t launch_indexer_logits_sm90(const IndexerLogitsParams& p, LogitsOperands ops,
                                       int key_splits, int sms, cudaStream_t stream);
// threads: the block size per row (256, 512 or 1024), 0 for topk_threads_for(p.width); any
// other value is cudaErrorInvalidValue.
cudaError_t launch_topk(const TopkParams& p, int threads, cudaStream_t stream);
int topk_threads_for(int64_t width);
cudaError_t launch_positions_to_locations(const PositionsToLocationsParams& p, cudaStream_t stream);
// Positions outside [0, words * 32) are skipped (the backend refuses them first where it reads
// the values: host_value_checks).
cudaError_t launch_topk_to_kv_mask(const TopkToKvMaskParams& p, cudaStream_t stream);

namespace indexer_sm90 {
// One instance per row of DSAKIT_INDEXER_LOGITS_SM90_INSTANCES (its launcher is in the kernel
// header; cudaErrorInvalidConfiguration when indexer_logits_sm90_accepts() does not hold).
template <int kHeads, LogitsOperands kOps>
cudaError_t run_indexer_logits_sm90(const IndexerLogitsParams& p, int key_splits, int sms,
                                    cudaStream_t stream);

// The kernel's invariants: d_i = 128, page_size % 4 == 0 (every key row 16-byte aligned),
// 16-byte aligned key pages, query codes and gates (it copies them 16 bytes at a time),
// positions below 2^31 (it counts them in 32 bits), and query code rows (row_end * h_i, and a
// 256-row box past them) below 2^31: the query tensor map's coordinates are 32-bit.
inline bool indexer_logits_sm90_accepts(const IndexerLogitsParams& p) {
  return p.d_i == 128 && p.page_size > 0 && p.page_size % 4 == 0 && p.width <= INT32_MAX &&
         p.row_end * p.h_i + 256 <= INT32_MAX &&
         reinterpret_cast<uintptr_t>(p.key_pages) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.q8) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.gate) % 16 == 0;
}
}  // namespace indexer_sm90

}  // namespace dsakit::cuda
