// float64 reference of every step of the DSA layer (docs/design.md#what-the-library-computes,
// docs/formats.md), written independently of the optimized kernels: tests compare two
// implementations, never one with itself. Used only by tests and `dsakit run --verify`; it
// includes no backend.
//
// Arrays are row-major std::vector<double> (or bytes); shapes are given in the comments.
// Inputs are the already-rounded values (bf16 / fp8-dequantized) as double.
#pragma once

#include <cstdint>
#include <vector>

#include "dsakit/formats.h"
#include "dsakit/pool.h"
#include "dsakit/tensor.h"

namespace dsakit::reference {

using Vec = std::vector<double>;

// Any bf16 / f32 / f64 / i32 / u8 host tensor as doubles.
Vec to_vec(const TensorView& host);

// ---- number formats (an independent implementation: search over the code table) --------
double e4m3_value(uint8_t code);  // NaN for 0x7F / 0xFF
// Nearest e4m3fn code to x (ties to the even code), saturating to ±448; NaN -> 0x7F|sign.
uint8_t e4m3_encode(double x);
// Nearest bf16 to x (ties to even), as a double.
double bf16_round(double x);

// ---- pool rows ---------------------------------------------------------------------------
// One token row of the given layout, built from c_kv [d_c] and k_pe [d_rope] (bf16 values).
std::vector<uint8_t> encode_kv_row(const KvRowLayout& row, const double* c_kv, const double* k_pe,
                                   ScalePolicy policy, double k_scale);
// The values a reader sees: c_kv [d_c], k_pe [d_rope].
void decode_kv_row(const KvRowLayout& row, const uint8_t* bytes, double k_scale, double* c_kv,
                   double* k_pe);
// Indexer FP8 quantization of one d-vector: e4m3 codes and the power-of-two scale
// (docs/formats.md#scale-rules).
void indexer_quantize(const double* x, int d, uint8_t* codes, double* scale);

// ---- indexer and top-k ------------------------------------------------------------------
// logits[t, p] = k_scale[loc] · Σ_h gate[t,h] · ReLU(q[t,h,:] · k[loc,:]) with
// loc = kv_locs[kv_start[t] + p], for p < ctx_len[t]; -inf for ctx_len[t] <= p < width.
// q: [T, H_i, d_i] fp8 values (unscaled), gate: [T, H_i], k: [num_locs, d_i] fp8 values,
// k_scale: [num_locs]. Returns [T, width].
Vec indexer_logits(const Vec& q, const Vec& gate, const Vec& k, const Vec& k_scale, int64_t T,
                   int h_i, int d_i, const std::vector<int32_t>& kv_locs,
                   const std::vector<int32_t>& kv_start, const std::vector<int32_t>& ctx_len,
                   int64_t width);
// Per row: the min(k, ctx_len) positions with the largest logits (ties -> lower position,
// NaN below everything), ascending, -1 padded. Returns [rows, k].
std::vector<int32_t> topk(const Vec& logits, int64_t rows, int64_t width,
                          const std::vector<int32_t>& ctx_len, int k);

// ---- projections ------------------------------------------------------------------------
// w: kv_b_proj [H*(d_nope+d_v), d_c]; per head d_nope rows of W_UK then d_v rows of W_UV.
Vec absorb_q(const Vec& q_nope, const Vec& w, int64_t T, int H, int d_nope, int d_v, int d_c);
Vec up_proj_v(const Vec& o_lat, const Vec& w, int64_t T, int H, int d_nope, int d_v, int d_c);
// c_kv [N, d_c] -> k_nope [N, H, d_nope], v [N, H, d_v].
void up_proj_kv(const Vec& c_kv, const Vec& w, int64_t N, int H, int d_nope, int d_v, int d_c,
                Vec& k_nope, Vec& v);

// ---- attention --------------------------------------------------------------------------
// Softmax attention of one query row over a list of (key, value) rows; keys have d_qk values,
// values d_v. Writes o [d_v] and returns {lse, max}. An empty list gives o = 0, lse = +inf,
// max = -inf; a NaN score makes o, lse and max NaN, an infinite score makes o and lse NaN.
struct RowStats {
  double lse;
  double max_logit;
};
RowStats attend_row(const double* q, const std::vector<const double*>& keys,
                    const std::vector<const double*>& values, int d_qk, int d_v, double sm_scale,
                    double* o);

struct Attention {
  Vec o;          // [T, H, d_v]
  Vec lse;        // [T, H] natural log; +inf for a query with no valid key (o = 0 there)
  Vec max_logit;  // [T, H] max of sm_scale·q·k over valid keys; -inf if none
};
// FlashMLA's sparse attention: q [T, H, d_qk], kv [N, d_qk] (keys = all d_qk values,
// values = the first d_v), indices [T, k]: entries < 0 or >= N are skipped, duplicates count
// once per slot. topk_length (optional, size T): only slots [0, topk_length[t]) are read.
Attention sparse_attention(const Vec& q, const Vec& kv, int64_t T, int H, int d_qk, int d_v,
                           int64_t N, const std::vector<int32_t>& indices, int k,
                           const std::vector<int32_t>* topk_length, double sm_scale);
// Causal varlen MHA with prefix: q [T, H, d_qk], k [N, H, d_qk], v [N, H, d_v]; query i of
// request r (rows cu_q[r]…) sees kv rows cu_kv[r] … cu_kv[r] + (L_r - E_r) + i. kv_mask
// (optional, [T, mask_words] bits, DenseMhaArgs::kv_mask's layout): query t sees position p of
// those only where bit p % 32 of word p / 32 of row t is set.
Attention dense_attention(const Vec& q, const Vec& k, const Vec& v, int H, int d_qk, int d_v,
                          const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_kv,
                          double sm_scale, const std::vector<uint32_t>* kv_mask = nullptr,
                          int64_t mask_words = 0);

}  // namespace dsakit::reference
