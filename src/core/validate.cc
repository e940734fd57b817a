#include "src/core/validate.h"

#include <algorithm>
#include <cstdint>
#include <unordered_set>
#include <vector>

#include "dsakit/error.h"

namespace dsakit::validate {

namespace {

constexpr std::initializer_list<DType> kFloat = {DType::kBF16, DType::kF32};

void check_locs_values(const int32_t* locs, int64_t n, int64_t num_locations, const char* name,
                       bool distinct) {
  if (locs == nullptr) return;
  std::unordered_set<int32_t> seen;
  for (int64_t i = 0; i < n; ++i) {
    DSAKIT_CHECK_ARG(locs[i] >= 0 && locs[i] < num_locations, name, "[", i,
                     "]: expected a pool location in [0, ", num_locations, "), got ", locs[i]);
    if (distinct)
      DSAKIT_CHECK_ARG(seen.insert(locs[i]).second, name, "[", i, "]: location ", locs[i],
                       " appears twice (each token needs its own location)");
  }
}

// k_nope and v as the shape checks see them: the halves of one buffer (when allowed) stand for
// the contiguous tensors of their shapes; anything else is checked as given.
struct KvViews {
  TensorView k_nope, v;
};
KvViews kv_for_checks(const TensorView& k_nope, const TensorView& v, bool kv_halves_ok) {
  if (!kv_halves_ok || !are_kv_halves(k_nope, v)) return {k_nope, v};
  const auto contiguous = [](const TensorView& t) {
    return make_view(t.data, t.dtype, t.device, {t.shape[0], t.shape[1], t.shape[2]});
  };
  return {contiguous(k_nope), contiguous(v)};
}

}  // namespace

void store_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
              const TensorView& k_pe, Device dev, const int32_t* host_locs) {
  DSAKIT_CHECK_ARG(pool.device() == dev, "store_kv: pool lives on ", to_string(pool.device()),
                   ", backend on ", to_string(dev));
  const auto& d = pool.desc();
  check_tensor(locs, "locs", DType::kI32, dev, {-1});
  const int64_t n = locs.shape[0];
  check_strided_tensor(c_kv, "c_kv", {DType::kBF16}, dev, {n, d.d_c});
  check_strided_tensor(k_pe, "k_pe", {DType::kBF16}, dev, {n, d.d_rope});
  check_locs_values(host_locs, n, d.num_locations(), "locs", true);
}

void gather_kv(const PagedKvPool& pool, const TensorView& locs, const TensorView& c_kv,
               const TensorView& k_pe, Device dev, const int32_t* host_locs) {
  DSAKIT_CHECK_ARG(pool.device() == dev, "gather_kv: pool lives on ", to_string(pool.device()),
                   ", backend on ", to_string(dev));
  const auto& d = pool.desc();
  check_tensor(locs, "locs", DType::kI32, dev, {-1});
  const int64_t n = locs.shape[0];
  check_strided_tensor(c_kv, "c_kv", kFloat, dev, {n, d.d_c});
  check_strided_tensor(k_pe, "k_pe", kFloat, dev, {n, d.d_rope});
  check_locs_values(host_locs, n, d.num_locations(), "locs", false);
}

void store_index_keys(const IndexKeyPool& pool, const TensorView& locs, const TensorView& idx_k,
                      Device dev, const int32_t* host_locs) {
  DSAKIT_CHECK_ARG(pool.device() == dev, "store_index_keys: pool lives on ",
                   to_string(pool.device()), ", backend on ", to_string(dev));
  check_tensor(locs, "locs", DType::kI32, dev, {-1});
  const int64_t n = locs.shape[0];
  check_tensor(idx_k, "idx_k", DType::kBF16, dev, {n, pool.desc().d_i});
  check_locs_values(host_locs, n, pool.desc().num_locations(), "locs", true);
}

void indexer_quantize_q(const TensorView& idx_q, const TensorView& idx_w, const TensorView& q8,
                        const TensorView& gate, Device dev) {
  check_tensor(idx_q, "idx_q", DType::kBF16, dev, {-1, -1, -1});
  const int64_t t = idx_q.shape[0], h = idx_q.shape[1], d = idx_q.shape[2];
  check_tensor(idx_w, "idx_w", DType::kF32, dev, {t, h});
  check_tensor(q8, "q8", DType::kU8, dev, {t, h, d});
  check_tensor(gate, "gate", DType::kF32, dev, {t, h});
}

namespace {

// The key side of the indexer for T tokens: pool on `dev`, kv_locs i32 [N_kv], kv_start and
// ctx_len i32 [T], every kv_start[t] + ctx_len[t] within kv_locs and every location a token reads
// (entries of the ranges [kv_start[t], kv_start[t] + ctx_len[t])) in the pool; entries no range
// covers are never read and may hold anything (e.g. -1 padding).
int64_t check_index_layout(const IndexerArgs& a, int64_t t, Device dev, const int32_t* host_kv_locs,
                           const int32_t* host_kv_start, const int32_t* host_ctx_len) {
  check_tensor(a.kv_locs, "kv_locs", DType::kI32, dev, {-1});
  check_tensor(a.kv_start, "kv_start", DType::kI32, dev, {t});
  check_tensor(a.ctx_len, "ctx_len", DType::kI32, dev, {t});
  const int64_t n_kv = a.kv_locs.shape[0];
  int64_t max_ctx = 0;
  if (host_kv_start && host_ctx_len) {
    for (int64_t i = 0; i < t; ++i) {
      DSAKIT_CHECK_ARG(host_ctx_len[i] >= 0, "ctx_len[", i, "]: expected >= 0, got ",
                       host_ctx_len[i]);
      DSAKIT_CHECK_ARG(host_kv_start[i] >= 0 && int64_t(host_kv_start[i]) + host_ctx_len[i] <= n_kv,
                       "kv_start[", i, "] + ctx_len[", i, "] = ", host_kv_start[i], " + ",
                       host_ctx_len[i], ": expected within kv_locs of ", n_kv, " entries");
      max_ctx = std::max<int64_t>(max_ctx, host_ctx_len[i]);
    }
  }
  if (host_kv_locs && host_kv_start && host_ctx_len) {
    std::vector<int32_t> depth(size_t(n_kv) + 1, 0);  // ranges covering each entry (prefix sum)
    for (int64_t i = 0; i < t; ++i) {
      ++depth[size_t(host_kv_start[i])];
      --depth[size_t(host_kv_start[i]) + size_t(host_ctx_len[i])];
    }
    const int64_t num_locations = a.keys->desc().num_locations();
    int32_t covered = 0;
    for (int64_t j = 0; j < n_kv; ++j) {
      covered += depth[size_t(j)];
      if (covered > 0)
        DSAKIT_CHECK_ARG(host_kv_locs[j] >= 0 && host_kv_locs[j] < num_locations, "kv_locs[", j,
                         "]: expected a pool location in [0, ", num_locations, "), got ",
                         host_kv_locs[j]);
    }
  } else {
    check_locs_values(host_kv_locs, host_kv_locs ? n_kv : 0, a.keys->desc().num_locations(),
                      "kv_locs", false);
  }
  return max_ctx;
}

}  // namespace

int64_t indexer_args(const IndexerArgs& a, Device dev, const int32_t* host_kv_locs,
                     const int32_t* host_kv_start, const int32_t* host_ctx_len) {
  DSAKIT_CHECK_ARG(a.keys != nullptr, "indexer: keys (index-key pool) is null");
  DSAKIT_CHECK_ARG(a.keys->device() == dev, "indexer: index-key pool lives on ",
                   to_string(a.keys->device()), ", backend on ", to_string(dev));
  const int d_i = a.keys->desc().d_i;
  check_tensor(a.q8, "q8", DType::kU8, dev, {-1, -1, d_i});
  const int64_t t = a.q8.shape[0], h = a.q8.shape[1];
  check_tensor(a.gate, "gate", DType::kF32, dev, {t, h});
  return check_index_layout(a, t, dev, host_kv_locs, host_kv_start, host_ctx_len);
}

void indexer_logits_out(const IndexerArgs& a, int64_t row_begin, int64_t row_end,
                        const TensorView& logits, Device dev, const int32_t* host_ctx_len) {
  const int64_t t = a.q8.shape[0];
  DSAKIT_CHECK_ARG(0 <= row_begin && row_begin <= row_end && row_end <= t,
                   "indexer_logits rows: expected 0 <= begin <= end <= ", t, ", got [", row_begin,
                   ", ", row_end, ")");
  check_tensor(logits, "logits", DType::kF32, dev, {row_end - row_begin, -1});
  if (host_ctx_len == nullptr) return;
  int64_t max_ctx = 0;
  for (int64_t r = row_begin; r < row_end; ++r)
    max_ctx = std::max<int64_t>(max_ctx, host_ctx_len[r]);
  DSAKIT_CHECK_ARG(logits.shape[1] >= max_ctx, "logits: width ", logits.shape[1],
                   " is smaller than the longest context ", max_ctx);
}

int64_t indexer_topk(const TensorView& idx_q, const TensorView& idx_w, const IndexerArgs& layout,
                     int k, const TensorView& out, Device dev, const int32_t* host_kv_locs,
                     const int32_t* host_kv_start, const int32_t* host_ctx_len) {
  DSAKIT_CHECK_ARG(k >= 1, "indexer_topk k: expected >= 1, got ", k);
  DSAKIT_CHECK_ARG(layout.keys != nullptr, "indexer_topk: keys (index-key pool) is null");
  DSAKIT_CHECK_ARG(layout.keys->device() == dev, "indexer_topk: index-key pool lives on ",
                   to_string(layout.keys->device()), ", backend on ", to_string(dev));
  check_tensor(idx_q, "idx_q", DType::kBF16, dev, {-1, -1, layout.keys->desc().d_i});
  const int64_t t = idx_q.shape[0], h = idx_q.shape[1];
  DSAKIT_CHECK_ARG(h >= 1, "idx_q: expected at least one indexer head, got shape ",
                   idx_q.shape_str());
  check_tensor(idx_w, "idx_w", DType::kF32, dev, {t, h});
  check_tensor(out, "out", DType::kI32, dev, {t, k});
  return check_index_layout(layout, t, dev, host_kv_locs, host_kv_start, host_ctx_len);
}

int64_t indexer_topk(const IndexerArgs& args, int k, const TensorView& out, Device dev,
                     const int32_t* host_kv_locs, const int32_t* host_kv_start,
                     const int32_t* host_ctx_len) {
  DSAKIT_CHECK_ARG(k >= 1, "indexer_topk k: expected >= 1, got ", k);
  const int64_t max_ctx = indexer_args(args, dev, host_kv_locs, host_kv_start, host_ctx_len);
  DSAKIT_CHECK_ARG(args.q8.shape[1] >= 1, "q8: expected at least one indexer head, got shape ",
                   args.q8.shape_str());
  check_tensor(out, "out", DType::kI32, dev, {args.q8.shape[0], k});
  return max_ctx;
}

void topk(const TensorView& logits, const TensorView& ctx_len, int k, const TensorView& out,
          Device dev, const int32_t* host_ctx_len) {
  DSAKIT_CHECK_ARG(k >= 1, "topk k: expected >= 1, got ", k);
  check_tensor(logits, "logits", DType::kF32, dev, {-1, -1});
  const int64_t rows = logits.shape[0], width = logits.shape[1];
  check_tensor(ctx_len, "ctx_len", DType::kI32, dev, {rows});
  check_tensor(out, "topk out", DType::kI32, dev, {rows, k});
  if (host_ctx_len)
    for (int64_t i = 0; i < rows; ++i)
      DSAKIT_CHECK_ARG(host_ctx_len[i] >= 0 && (host_ctx_len[i] <= k || host_ctx_len[i] <= width),
                       "ctx_len[", i, "]: expected in [0, ", std::max<int64_t>(width, k),
                       "] (logits width ", width, ", k ", k, "), got ", host_ctx_len[i]);
}

static void check_kv_b_proj(const TensorView& w, Device dev, int64_t h, int64_t d_nope, int64_t d_v,
                            int64_t d_c) {
  check_tensor(w, "kv_b_proj", DType::kBF16, dev, {h * (d_nope + d_v), d_c});
}

void absorb_q(const TensorView& q_nope, const TensorView& kv_b_proj, int d_v,
              const TensorView& q_abs, Device dev) {
  check_tensor(q_nope, "q_nope", kFloat, dev, {-1, -1, -1});
  const int64_t t = q_nope.shape[0], h = q_nope.shape[1], dn = q_nope.shape[2];
  DSAKIT_CHECK_ARG(d_v > 0, "d_v: expected > 0, got ", d_v);
  DSAKIT_CHECK_ARG(kv_b_proj.ndim == 2, "kv_b_proj: expected 2 dims, got ", kv_b_proj.shape_str());
  const int64_t dc = kv_b_proj.shape[1];
  check_kv_b_proj(kv_b_proj, dev, h, dn, d_v, dc);
  check_tensor(q_abs, "q_abs", kFloat, dev, {t, h, dc});
}

void up_proj_v(const TensorView& o_lat, const TensorView& kv_b_proj, int d_nope,
               const TensorView& o, Device dev) {
  check_tensor(o_lat, "o_lat", kFloat, dev, {-1, -1, -1});
  const int64_t t = o_lat.shape[0], h = o_lat.shape[1], dc = o_lat.shape[2];
  check_tensor(o, "o", kFloat, dev, {t, h, -1});
  check_kv_b_proj(kv_b_proj, dev, h, d_nope, o.shape[2], dc);
}

void up_proj_kv(const TensorView& c_kv, const TensorView& kv_b_proj, const TensorView& k_nope,
                const TensorView& v, Device dev, bool kv_halves_ok) {
  check_tensor(c_kv, "c_kv", kFloat, dev, {-1, -1});
  const int64_t n = c_kv.shape[0], dc = c_kv.shape[1];
  const KvViews kv = kv_for_checks(k_nope, v, kv_halves_ok);
  check_tensor(kv.k_nope, "k_nope", kFloat, dev, {n, -1, -1});
  const int64_t h = k_nope.shape[1];
  check_tensor(kv.v, "v", kFloat, dev, {n, h, -1});
  check_kv_b_proj(kv_b_proj, dev, h, k_nope.shape[2], v.shape[2], dc);
}

void fp8_block_weights(const Fp8BlockWeights& w, Device dev, int64_t rows, int64_t d_c) {
  DSAKIT_CHECK_ARG(d_c % kFp8TileSize == 0, "kv_b_proj_fp8: d_c must be a multiple of ",
                   kFp8TileSize, " for 128 x 128 block scales, got ", d_c);
  check_tensor(w.codes, "kv_b_proj_fp8.codes", DType::kU8, dev, {rows, d_c});
  check_tensor(w.scales, "kv_b_proj_fp8.scales", DType::kF32, dev,
               {(rows + kFp8TileSize - 1) / kFp8TileSize, d_c / kFp8TileSize});
}

void optional_fp8_block_weights(const Fp8BlockWeights& w, Device dev, int64_t rows, int64_t d_c) {
  if (w.defined() || w.scales.ndim != 0) fp8_block_weights(w, dev, rows, d_c);
}

void up_proj_kv_fp8(const PagedKvPool& pool, const TensorView& locs, const Fp8BlockWeights& w,
                    const TensorView& k_nope, const TensorView& v, const TensorView& k_pe,
                    Device dev, const int32_t* host_locs, bool kv_halves_ok) {
  DSAKIT_CHECK_ARG(pool.device() == dev, "up_proj_kv_fp8: pool lives on ", to_string(pool.device()),
                   ", backend on ", to_string(dev));
  const auto& d = pool.desc();
  DSAKIT_CHECK(d.layout != KvLayout::kBf16, kLayoutMismatch,
               "up_proj_kv_fp8: the pool's layout is bf16; the FP8 up-projection reads fp8 or "
               "fp8-raw pools (up_proj_kv takes the gathered bf16 rows)");
  check_tensor(locs, "locs", DType::kI32, dev, {-1});
  const int64_t n = locs.shape[0];
  const KvViews kv = kv_for_checks(k_nope, v, kv_halves_ok);
  check_tensor(kv.k_nope, "k_nope", kFloat, dev, {n, -1, -1});
  const int64_t h = k_nope.shape[1];
  check_tensor(kv.v, "v", kFloat, dev, {n, h, -1});
  check_tensor(k_pe, "k_pe", kFloat, dev, {n, d.d_rope});
  fp8_block_weights(w, dev, h * (k_nope.shape[2] + v.shape[2]), d.d_c);
  check_locs_values(host_locs, n, d.num_locations(), "locs", false);
}

void sparse_mla(const SparseMlaArgs& a, Device dev) {
  DSAKIT_CHECK_ARG(a.kv != nullptr, "sparse_mla: kv pool is null");
  DSAKIT_CHECK_ARG(a.kv->device() == dev, "sparse_mla: kv pool lives on ",
                   to_string(a.kv->device()), ", backend on ", to_string(dev));
  const auto& d = a.kv->desc();
  check_strided_tensor(a.q_abs, "q_abs", kFloat, dev, {-1, -1, d.d_c});
  const int64_t t = a.q_abs.shape[0], h = a.q_abs.shape[1];
  check_strided_tensor(a.q_pe, "q_pe", kFloat, dev, {t, h, d.d_rope});
  check_tensor(a.indices, "indices", DType::kI32, dev, {t, -1});
  if (a.topk_length.ndim != 0) check_tensor(a.topk_length, "topk_length", DType::kI32, dev, {t});
  check_tensor(a.o_lat, "o_lat", kFloat, dev, {t, h, d.d_c});
  check_tensor(a.lse, "lse", DType::kF32, dev, {t, h});
  if (a.max_logits.ndim != 0) check_tensor(a.max_logits, "max_logits", DType::kF32, dev, {t, h});
  DSAKIT_CHECK_ARG(a.sm_scale > 0 && a.sm_scale < 1e6,
                   "sm_scale: expected a positive finite value, got ", a.sm_scale);
}

void dense_mha(const DenseMhaArgs& a, Device dev, bool kv_halves_ok) {
  check_tensor(a.q_nope, "q_nope", kFloat, dev, {-1, -1, -1});
  const int64_t t = a.q_nope.shape[0], h = a.q_nope.shape[1], dn = a.q_nope.shape[2];
  check_tensor(a.q_pe, "q_pe", kFloat, dev, {t, h, -1});
  const int64_t dr = a.q_pe.shape[2];
  const KvViews kv = kv_for_checks(a.k_nope, a.v, kv_halves_ok);
  check_tensor(kv.k_nope, "k_nope", kFloat, dev, {-1, h, dn});
  const int64_t n = a.k_nope.shape[0];
  check_tensor(a.k_pe, "k_pe", kFloat, dev, {n, dr});
  check_tensor(kv.v, "v", kFloat, dev, {n, h, -1});
  const int64_t dv = a.v.shape[2];
  const int64_t b = a.num_requests;
  DSAKIT_CHECK_ARG(b >= 1, "dense_mha num_requests: expected >= 1, got ", b);
  check_tensor(a.cu_q, "cu_q", DType::kI32, dev, {b + 1});
  check_tensor(a.cu_kv, "cu_kv", DType::kI32, dev, {b + 1});
  DSAKIT_CHECK_ARG(a.cu_q_host && a.cu_kv_host, "dense_mha: host copies of cu_q/cu_kv required");
  DSAKIT_CHECK_ARG(a.cu_q_host[0] == 0 && a.cu_kv_host[0] == 0, "cu_q[0], cu_kv[0]: expected 0");
  const bool custom = a.kv_visible.ndim != 0;
  if (custom) {
    check_tensor(a.kv_visible, "kv_visible", DType::kI32, dev, {t});
    DSAKIT_CHECK_ARG(a.kv_visible_host != nullptr, "dense_mha: kv_visible needs its host copy");
  }
  const bool masked = a.kv_mask.ndim != 0;
  if (masked) check_tensor(a.kv_mask, "kv_mask", DType::kI32, dev, {t, -1});
  int64_t longest = 0;  // kv rows of the longest request
  for (int64_t r = 0; r < b; ++r) {
    const int64_t q0 = a.cu_q_host[r], e = a.cu_q_host[r + 1] - q0;
    const int64_t l = a.cu_kv_host[r + 1] - a.cu_kv_host[r];
    longest = std::max(longest, l);
    DSAKIT_CHECK_ARG(e >= 0 && l >= 0 && (custom || l >= e), "request ", r,
                     ": expected 0 <= extend (", e, ") <= kv length (", l, ")");
    DSAKIT_CHECK_ARG(a.cu_q_host[r + 1] <= t, "cu_q[", r + 1, "] = ", a.cu_q_host[r + 1],
                     ": exceeds the number of query tokens ", t);
    for (int64_t i = 0; custom && i < e; ++i) {
      const int32_t v = a.kv_visible_host[q0 + i];
      DSAKIT_CHECK_ARG(v >= 0 && v <= l && (i == 0 || v >= a.kv_visible_host[q0 + i - 1]),
                       "kv_visible[", q0 + i, "] = ", v,
                       ": expected non-decreasing within request ", r, " and in [0, ", l, "]");
    }
  }
  DSAKIT_CHECK_ARG(!masked || a.kv_mask.shape[1] * 32 >= longest, "kv_mask: ", a.kv_mask.shape[1],
                   " words a row cover ", a.kv_mask.shape[1] * 32,
                   " kv rows, fewer than the longest request's ", longest);
  DSAKIT_CHECK_ARG(a.cu_q_host[b] == t, "cu_q[", b, "] = ", a.cu_q_host[b],
                   ": expected the number of query tokens ", t);
  DSAKIT_CHECK_ARG(a.cu_kv_host[b] == n, "cu_kv[", b, "] = ", a.cu_kv_host[b],
                   ": expected the number of kv rows ", n);
  check_tensor(a.o, "o", kFloat, dev, {t, h, dv});
  check_tensor(a.lse, "lse", DType::kF32, dev, {t, h});
  DSAKIT_CHECK_ARG(a.sm_scale > 0 && a.sm_scale < 1e6,
                   "sm_scale: expected a positive finite value, got ", a.sm_scale);
}

void positions_to_locations(const TensorView& positions, const TensorView& kv_locs,
                            const TensorView& kv_start, const TensorView& ctx_len,
                            const TensorView& out, Device dev, const int32_t* host_kv_start,
                            const int32_t* host_ctx_len) {
  check_tensor(positions, "positions", DType::kI32, dev, {-1, -1});
  const int64_t t = positions.shape[0], k = positions.shape[1];
  const bool identity = kv_locs.ndim == 0;  // out = kv_start + pos
  if (!identity) check_tensor(kv_locs, "kv_locs", DType::kI32, dev, {-1});
  check_tensor(kv_start, "kv_start", DType::kI32, dev, {t});
  check_tensor(ctx_len, "ctx_len", DType::kI32, dev, {t});
  check_tensor(out, "locations out", DType::kI32, dev, {t, k});
  if (!host_kv_start || !host_ctx_len) return;
  const int64_t bound = identity ? int64_t(INT32_MAX) + 1 : kv_locs.shape[0];
  for (int64_t i = 0; i < t; ++i)
    DSAKIT_CHECK_ARG(host_kv_start[i] >= 0 && host_ctx_len[i] >= 0 &&
                         int64_t(host_kv_start[i]) + host_ctx_len[i] <= bound,
                     "kv_start[", i, "] + ctx_len[", i, "] = ", host_kv_start[i], " + ",
                     host_ctx_len[i], ": expected within ", bound,
                     identity ? " (the int32 location range)" : " entries of kv_locs");
}

void topk_to_kv_mask(const TensorView& positions, const TensorView& mask, Device dev,
                     const int32_t* host_positions) {
  check_tensor(positions, "positions", DType::kI32, dev, {-1, -1});
  const int64_t t = positions.shape[0], k = positions.shape[1];
  check_tensor(mask, "kv_mask", DType::kI32, dev, {t, -1});
  DSAKIT_CHECK_ARG(k <= INT32_MAX, "positions: ", k, " columns; expected at most 2^31 - 1");
  const int64_t words = mask.shape[1];
  for (int64_t i = 0; host_positions && i < t * k; ++i)
    DSAKIT_CHECK_ARG(host_positions[i] < words * 32, "positions[", i / k, ", ", i % k,
                     "] = ", host_positions[i], ": beyond the ", words * 32,
                     " positions kv_mask's ", words, " words a row cover");
}

void merge_partials(const TensorView& o_parts, const TensorView& lse_parts, const TensorView& o,
                    const TensorView& lse, Device dev) {
  check_tensor(o_parts, "o_parts", kFloat, dev, {-1, -1, -1, -1});
  const int64_t w = o_parts.shape[0], t = o_parts.shape[1], h = o_parts.shape[2],
                d = o_parts.shape[3];
  DSAKIT_CHECK_ARG(w >= 1, "o_parts: expected at least one part");
  check_tensor(lse_parts, "lse_parts", DType::kF32, dev, {w, t, h});
  check_tensor(o, "o", kFloat, dev, {t, h, d});
  check_tensor(lse, "lse", DType::kF32, dev, {t, h});
}

void select_rows(const TensorView& src, const TensorView& rows, const TensorView& dst, Device dev,
                 const int32_t* host_rows) {
  DSAKIT_CHECK_ARG(src.ndim >= 1, "select_rows src: expected at least one dim, got shape ",
                   src.shape_str());
  DSAKIT_CHECK_ARG(src.device == dev, "select_rows src: expected a ", to_string(dev),
                   " tensor, got a ", to_string(src.device), " tensor");
  DSAKIT_CHECK_ARG(src.is_contiguous(), "select_rows src: expected a contiguous tensor of shape ",
                   src.shape_str());
  DSAKIT_CHECK_ARG(src.data != nullptr || src.numel() == 0, "select_rows src: null data pointer");
  check_tensor(rows, "rows", DType::kI32, dev, {-1});
  const int64_t m = rows.shape[0], n = src.shape[0];
  DSAKIT_CHECK_ARG(dst.dtype == src.dtype, "select_rows dst: expected dtype ", to_string(src.dtype),
                   " (of src), got ", to_string(dst.dtype));
  bool same_shape = dst.ndim == src.ndim && dst.shape[0] == m;
  for (int d = 1; same_shape && d < src.ndim; ++d)
    same_shape = dst.shape[size_t(d)] == src.shape[size_t(d)];
  DSAKIT_CHECK_ARG(same_shape, "select_rows dst: expected shape [", m,
                   " (rows), then the trailing dims of src ", src.shape_str(), "], got ",
                   dst.shape_str());
  DSAKIT_CHECK_ARG(dst.device == dev, "select_rows dst: expected a ", to_string(dev),
                   " tensor, got a ", to_string(dst.device), " tensor");
  DSAKIT_CHECK_ARG(dst.is_contiguous(), "select_rows dst: expected a contiguous tensor of shape ",
                   dst.shape_str());
  DSAKIT_CHECK_ARG(dst.data != nullptr || dst.numel() == 0, "select_rows dst: null data pointer");
  if (host_rows == nullptr) return;
  for (int64_t i = 0; i < m; ++i)
    DSAKIT_CHECK_ARG(host_rows[i] >= 0 && host_rows[i] < n, "rows[", i,
                     "]: expected a row of src in [0, ", n, "), got ", host_rows[i]);
}

void merge_topk(const TensorView& scores, const TensorView& positions, int k, const TensorView& out,
                Device dev) {
  DSAKIT_CHECK_ARG(k >= 1, "merge_topk k: expected >= 1, got ", k);
  check_tensor(scores, "scores", DType::kF32, dev, {-1, -1, -1});
  const int64_t w = scores.shape[0], t = scores.shape[1], c = scores.shape[2];
  DSAKIT_CHECK_ARG(w >= 1 && c >= 1,
                   "scores: expected at least one shard and one candidate per shard [W >= 1, T, "
                   "C >= 1], got shape ",
                   scores.shape_str());
  DSAKIT_CHECK_ARG(w * c <= Backend::kMergeTopkMaxCandidates, "scores: W * C = ", w, " * ", c,
                   " = ", w * c, " candidates per row exceeds the limit of ",
                   Backend::kMergeTopkMaxCandidates);
  check_tensor(positions, "positions", DType::kI32, dev, {w, t, c});
  check_tensor(out, "merge_topk out", DType::kI32, dev, {t, k});
}

}  // namespace dsakit::validate
