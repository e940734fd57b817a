#include "src/reference/layer_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <numeric>

#include "dsakit/batch.h"
#include "dsakit/error.h"

namespace dsakit::reference {

namespace {

struct RequestKv {
  Vec kv;         // [L, d_c + d_rope] decoded latent rows
  Vec idx_k;      // [L, d_i] fp8 values of the index keys
  Vec idx_scale;  // [L]
};

RequestKv decode_request(const LayerSnapshot& s, int r) {
  const auto& c = *s.config;
  const int32_t len = s.lengths[size_t(r)];
  const int dkv = c.kv_lora_rank + c.qk_rope_head_dim, di = c.index_head_dim;
  const KvRowLayout row = s.kv_desc.row();
  const int bpt = row.bytes_per_token();
  RequestKv out{Vec(size_t(len) * dkv), Vec(size_t(len) * di), Vec(static_cast<size_t>(len))};
  const auto* kv_bytes = s.kv_storage.ptr<const uint8_t>();
  const auto* ix_bytes = s.index_storage.ptr<const uint8_t>();
  const int ps = s.index_desc.page_size;
  for (int32_t p = 0; p < len; ++p) {
    const int64_t loc = location_of(s.page_tables[size_t(r)], s.kv_desc.page_size, p);
    decode_kv_row(row, kv_bytes + loc * bpt, s.kv_desc.k_scale, &out.kv[size_t(p) * dkv],
                  &out.kv[size_t(p) * dkv + c.kv_lora_rank]);
    const int64_t iloc = location_of(s.page_tables[size_t(r)], ps, p);
    const uint8_t* page = ix_bytes + (iloc / ps) * s.index_desc.page_bytes();
    const int slot = int(iloc % ps);
    for (int j = 0; j < di; ++j) out.idx_k[size_t(p) * di + j] = e4m3_value(page[slot * di + j]);
    float scale;
    std::memcpy(&scale, page + int64_t(ps) * di + slot * 4, 4);
    out.idx_scale[size_t(p)] = scale;
  }
  return out;
}

// bf16-rounded up-projections of a request's positions 0 … max_pos, per head (dense path of a
// backend with bf16 intermediates).
struct DenseKv {
  std::vector<float> k_nope;  // [positions, H, d_nope]
  std::vector<float> v;       // [positions, H, d_v]
};

DenseKv up_project(const LayerSnapshot& s, const RequestKv& kv, const Vec& w, int32_t positions) {
  const auto& c = *s.config;
  const int h = c.num_heads, dn = c.qk_nope_head_dim, dv = c.v_head_dim, dc = c.kv_lora_rank;
  const int dkv = dc + c.qk_rope_head_dim;
  DenseKv out{std::vector<float>(size_t(positions) * h * dn),
              std::vector<float>(size_t(positions) * h * dv)};
  Vec lat(size_t(positions) * dc);  // a gather hands the projection bf16 latent rows
  for (int32_t p = 0; p < positions; ++p)
    for (int d = 0; d < dc; ++d) {
      const double x = kv.kv[size_t(p) * dkv + d];
      lat[size_t(p) * dc + d] = s.fp8_up_projection ? x : bf16_round(x);
    }
#pragma omp parallel for schedule(dynamic, 4)
  for (int32_t p = 0; p < positions; ++p)
    for (int hh = 0; hh < h; ++hh)
      for (int j = 0; j < dn + dv; ++j) {
        const double* wr = &w[(size_t(hh) * (dn + dv) + j) * dc];
        double acc = 0;
        for (int d = 0; d < dc; ++d) acc += wr[d] * lat[size_t(p) * dc + d];
        const float r = float(bf16_round(acc));
        if (j < dn)
          out.k_nope[(size_t(p) * h + hh) * dn + j] = r;
        else
          out.v[(size_t(p) * h + hh) * dv + (j - dn)] = r;
      }
  return out;
}

}  // namespace

LayerReference layer_outputs(const LayerSnapshot& s, const std::vector<TokenQuery>& queries) {
  DSAKIT_CHECK_ARG(s.config != nullptr, "layer reference: config is null");
  const auto& c = *s.config;
  const int h = c.num_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim,
            dc = c.kv_lora_rank, hi = c.index_n_heads, di = c.index_head_dim, k = c.index_topk;
  const int dkv = dc + dr;
  const Vec w_sparse = to_vec(s.kv_b_proj);
  const Vec w_dense_own = s.kv_b_proj_dense.ndim != 0 ? to_vec(s.kv_b_proj_dense) : Vec();
  const Vec& w_dense = w_dense_own.empty() ? w_sparse : w_dense_own;
  std::vector<int64_t> offset(s.lengths.size() + 1, 0);
  for (size_t r = 0; r < s.lengths.size(); ++r) offset[r + 1] = offset[r] + s.lengths[r];

  std::map<int, RequestKv> cache;
  for (const auto& q : queries) {
    DSAKIT_CHECK_ARG(q.request >= 0 && size_t(q.request) < s.lengths.size() && q.pos >= 0 &&
                         q.pos < s.lengths[size_t(q.request)],
                     "layer reference: query (", q.request, ", ", q.pos, ") out of range");
    if (!cache.count(q.request)) cache.emplace(q.request, decode_request(s, q.request));
  }

  std::map<int, DenseKv> dense;
  if (s.bf16_intermediates) {
    std::map<int, int32_t> need;  // request -> positions its dense queries read
    for (const auto& q : queries)
      if (q.all_positions || q.dense_kv) need[q.request] = std::max(need[q.request], q.pos + 1);
    for (const auto& [r, n] : need) dense.emplace(r, up_project(s, cache.at(r), w_dense, n));
  }

  LayerReference out;
  const size_t nq = queries.size();
  out.o.assign(nq * h * dv, 0.0);
  out.lse.assign(nq * h, 0.0);
  out.selected.resize(nq);
  const TensorView& qn = s.q_nope;
  const TensorView& qp = s.q_pe;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t qi = 0; qi < int64_t(nq); ++qi) {
    const TokenQuery& q = queries[size_t(qi)];
    const RequestKv& kv = cache.at(q.request);
    const int64_t row = offset[size_t(q.request)] + q.pos;
    const int32_t ctx = q.pos + 1;
    std::vector<int32_t> sel;
    if (q.all_positions || ctx <= k) {
      sel.resize(size_t(ctx));
      std::iota(sel.begin(), sel.end(), 0);
    } else {
      // Reference indexer over this token's visible positions.
      Vec qv(size_t(hi) * di), gate(static_cast<size_t>(hi));
      std::vector<uint8_t> codes(static_cast<size_t>(di));
      for (int hh = 0; hh < hi; ++hh) {
        Vec x(static_cast<size_t>(di));
        for (int j = 0; j < di; ++j)
          x[size_t(j)] = load_as_float(s.idx_q, (row * hi + hh) * di + j);
        double scale = 0;
        indexer_quantize(x.data(), di, codes.data(), &scale);
        for (int j = 0; j < di; ++j) qv[size_t(hh) * di + j] = e4m3_value(codes[size_t(j)]);
        gate[size_t(hh)] = double(load_as_float(s.idx_w, row * hi + hh)) / std::sqrt(double(hi)) /
                           std::sqrt(double(di)) * scale;
      }
      std::vector<int32_t> locs(static_cast<size_t>(ctx));
      std::iota(locs.begin(), locs.end(), 0);
      const Vec logits =
          indexer_logits(qv, gate, kv.idx_k, kv.idx_scale, 1, hi, di, locs, {0}, {ctx}, ctx);
      const std::vector<int32_t> top = topk(logits, 1, ctx, {ctx}, k);
      for (int32_t p : top)
        if (p >= 0) sel.push_back(p);
    }
    const bool dense_kv = q.all_positions || q.dense_kv;
    if (dense_kv && s.bf16_intermediates) {
      // Dense path as the backend runs it: bf16 up-projected K/V per head.
      // Keys are [k_nope of the head, bf16 k_pe], values the head's v, as doubles.
      const DenseKv& dk = dense.at(q.request);
      const int dqk = dn + dr;
      Vec qh(static_cast<size_t>(dqk)), keys(sel.size() * size_t(dqk)),
          values(sel.size() * size_t(dv));
      std::vector<const double*> key_rows(sel.size()), value_rows(sel.size());
      for (size_t i = 0; i < sel.size(); ++i) {
        key_rows[i] = keys.data() + i * size_t(dqk);
        value_rows[i] = values.data() + i * size_t(dv);
        for (int d = 0; d < dr; ++d)
          keys[i * size_t(dqk) + size_t(dn + d)] = bf16_round(kv.kv[size_t(sel[i]) * dkv + dc + d]);
      }
      for (int hh = 0; hh < h; ++hh) {
        for (int d = 0; d < dn; ++d) qh[size_t(d)] = load_as_float(qn, (row * h + hh) * dn + d);
        for (int d = 0; d < dr; ++d)
          qh[size_t(dn + d)] = load_as_float(qp, (row * h + hh) * dr + d);
        for (size_t i = 0; i < sel.size(); ++i) {
          const size_t base = size_t(sel[i]) * h + hh;
          std::copy_n(&dk.k_nope[base * dn], dn, keys.data() + i * size_t(dqk));
          std::copy_n(&dk.v[base * dv], dv, values.data() + i * size_t(dv));
        }
        out.lse[size_t(qi) * h + hh] = attend_row(qh.data(), key_rows, value_rows, dqk, dv,
                                                  s.sm_scale, &out.o[(size_t(qi) * h + hh) * dv])
                                           .lse;
      }
      out.selected[size_t(qi)] = std::move(sel);
      continue;
    }
    // Absorbed attention over the selected rows, then V up-projection (for a dense_kv query,
    // with the dense path's weights: the same function as its up-projected K/V).
    const Vec& w = dense_kv ? w_dense : w_sparse;
    const auto mid = [&](double x) { return s.bf16_intermediates ? bf16_round(x) : x; };
    std::vector<const double*> rows(sel.size());  // keys: all d_c + d_rope values; values: d_c
    for (size_t i = 0; i < sel.size(); ++i) rows[i] = &kv.kv[size_t(sel[i]) * dkv];
    for (int hh = 0; hh < h; ++hh) {
      Vec q576(size_t(dkv), 0.0);
      for (int j = 0; j < dn; ++j) {
        const double qj = load_as_float(qn, (row * h + hh) * dn + j);
        const double* wk = &w[(size_t(hh) * (dn + dv) + j) * dc];
        for (int d = 0; d < dc; ++d) q576[size_t(d)] += qj * wk[d];
      }
      for (int d = 0; d < dc; ++d) q576[size_t(d)] = mid(q576[size_t(d)]);
      for (int j = 0; j < dr; ++j)
        q576[size_t(dc + j)] = load_as_float(qp, (row * h + hh) * dr + j);
      Vec olat(static_cast<size_t>(dc));
      out.lse[size_t(qi) * h + hh] =
          attend_row(q576.data(), rows, rows, dkv, dc, s.sm_scale, olat.data()).lse;
      for (int d = 0; d < dc; ++d) olat[size_t(d)] = mid(olat[size_t(d)]);
      for (int j = 0; j < dv; ++j) {
        const double* wv = &w[(size_t(hh) * (dn + dv) + dn + j) * dc];
        double acc = 0;
        for (int d = 0; d < dc; ++d) acc += wv[d] * olat[size_t(d)];
        out.o[(size_t(qi) * h + hh) * dv + j] = acc;
      }
    }
    out.selected[size_t(qi)] = std::move(sel);
  }
  return out;
}

double lse_bound(const LayerSnapshot& s) {
  if (!s.bf16_intermediates) return 1e-3;
  return s.fp8_up_projection ? kLseBoundAcrossPaths : 5e-3;
}

}  // namespace dsakit::reference
