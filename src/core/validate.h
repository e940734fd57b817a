// Argument validation shared by every backend (docs/reliability.md). Each function checks shapes,
// dtypes, devices and contiguity of one Backend op's arguments and throws Error naming the
// argument; value checks (location ranges, distinctness) read host copies of index tensors,
// passed by the backend (nullptr skips them, for ops whose kernels bound-check instead).
#pragma once

#include <cstdint>

#include "dsakit/backend.h"

namespace dsakit::validate {

void store_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
              const TensorView& k_pe, Device dev, const int32_t* host_locs);
void gather_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
               const TensorView& k_pe, Device dev, const int32_t* host_locs);
void store_index_keys(const IndexKeyPool& pool, const TensorView& locs, const TensorView& idx_k,
                      Device dev, const int32_t* host_locs);
void indexer_quantize_q(const TensorView& idx_q, const TensorView& idx_w, const TensorView& q8,
                        const TensorView& gate, Device dev);
// Checks shapes and that every kv_locs entry the rows can reach is in range; host_* may be
// nullptr to skip value checks. Returns max ctx_len over the rows (0 if unknown).
int64_t indexer_args(const IndexerArgs& a, Device dev, const int32_t* host_kv_locs,
                     const int32_t* host_kv_start, const int32_t* host_ctx_len);
// Rows [row_begin, row_end) of a.q8 and logits f32 [rows, width] with width >= every row's
// ctx_len (checked when host_ctx_len is given).
void indexer_logits_out(const IndexerArgs& a, int64_t row_begin, int64_t row_end,
                        const TensorView& logits, Device dev, const int32_t* host_ctx_len);
// The whole indexer: k >= 1, idx_q bf16 [T, H_i, d_i] (H_i >= 1, d_i of the index-key pool),
// idx_w f32 [T, H_i], out i32 [T, k], and the layout's pool, kv_locs, kv_start and ctx_len as
// in indexer_args (its q8 and gate are not read). host_* as above. Returns max ctx_len.
int64_t indexer_topk(const TensorView& idx_q, const TensorView& idx_w, const IndexerArgs& layout,
                     int k, const TensorView& out, Device dev, const int32_t* host_kv_locs,
                     const int32_t* host_kv_start, const int32_t* host_ctx_len);
// The same for queries already quantized: k >= 1, the args as in indexer_args (their q8 and gate
// read), out i32 [T, k]. Returns max ctx_len.
int64_t indexer_topk(const IndexerArgs& args, int k, const TensorView& out, Device dev,
                     const int32_t* host_kv_locs, const int32_t* host_kv_start,
                     const int32_t* host_ctx_len);
// logits f32 [rows, width]: width >= ctx_len[t] for every row with ctx_len[t] > k (the rows
// whose logits top-k reads).
void topk(const TensorView& logits, const TensorView& ctx_len, int k, const TensorView& out,
          Device dev, const int32_t* host_ctx_len);
void absorb_q(const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
              const TensorView& q_abs, Device dev);
void up_proj_v(const TensorView& o_lat, const TensorView& kv_b_proj, int d_nope,
               const TensorView& o, Device dev);
// kv_halves_ok: k_nope / v may also be the halves of one buffer (are_kv_halves), for backends
// with Capabilities::kv_halves; otherwise both must be contiguous.
void up_proj_kv(const TensorView& c_kv, const TensorView& kv_b_proj, const TensorView& k_nope,
                const TensorView& v, Device dev, bool kv_halves_ok = false);
// Fp8BlockWeights of a [rows, d_c] kv_b_proj (d_c a multiple of 128).
void fp8_block_weights(const Fp8BlockWeights& w, Device dev, int64_t rows, int64_t d_c);
// LayerOptions::kv_b_proj_fp8: nothing given passes; either half given makes both required (a
// lone scales tensor is refused, not ignored), then as fp8_block_weights.
void optional_fp8_block_weights(const Fp8BlockWeights& w, Device dev, int64_t rows, int64_t d_c);
// An fp8 or fp8-raw pool; k_nope / v as in up_proj_kv, k_pe as in gather_kv.
void up_proj_kv_fp8(const PagedKvPool& pool, const TensorView& locs, const Fp8BlockWeights& w,
                    const TensorView& k_nope, const TensorView& v, const TensorView& k_pe,
                    Device dev, const int32_t* host_locs, bool kv_halves_ok = false);
void sparse_mla(const SparseMlaArgs& a, Device dev);
void dense_mha(const DenseMhaArgs& a, Device dev, bool kv_halves_ok = false);
// host_*: host copies (nullptr skips value checks). Checks kv_start[t] + ctx_len[t] <= N_kv.
void positions_to_locations(const TensorView& positions, const TensorView& kv_locs,
                            const TensorView& kv_start, const TensorView& ctx_len,
                            const TensorView& out, Device dev, const int32_t* host_kv_start,
                            const int32_t* host_ctx_len);
// positions i32 [T, k], mask i32 [T, W]; host_positions (nullptr skips value checks): every
// position >= 0 below W * 32.
void topk_to_kv_mask(const TensorView& positions, const TensorView& mask, Device dev,
                     const int32_t* host_positions);
// o_parts bf16 | f32 [W, T, H, D] (W >= 1), lse_parts f32 [W, T, H], o bf16 | f32 [T, H, D],
// lse f32 [T, H].
void merge_partials(const TensorView& o_parts, const TensorView& lse_parts, const TensorView& o,
                    const TensorView& lse, Device dev);
// src [N, ...] and dst [M, ...]: contiguous, one dtype, the same trailing shape; rows i32 [M].
// host_rows (nullptr skips the check): every entry in [0, N).
void select_rows(const TensorView& src, const TensorView& rows, const TensorView& dst, Device dev,
                 const int32_t* host_rows);
// scores f32 [W, T, C] and positions i32 [W, T, C] with C >= 1 and W * C <=
// Backend::kMergeTopkMaxCandidates, k >= 1, out i32 [T, k].
void merge_topk(const TensorView& scores, const TensorView& positions, int k, const TensorView& out,
                Device dev);

}  // namespace dsakit::validate
