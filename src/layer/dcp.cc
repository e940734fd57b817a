#include "dsakit/dcp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "src/layer/page_tables.h"
#include "src/layer/paths.h"

namespace dsakit {

namespace {

// Positions < len owned by rank w of W (p % W == w).
int32_t owned(int32_t len, int w, int world) {
  return len > w ? (len - 1 - w) / world + 1 : 0;
}

TensorView host_i32(std::vector<int32_t>& v) {
  return make_view(v.data(), DType::kI32, Device::kCpu, {int64_t(v.size())});
}

// Copies a bf16/f32 tensor (any device) into `dst` as f32 on the host.
void copy_to_f32(Backend& be, const TensorView& src, float* dst) {
  const Tensor h = be.to_host(src);
  for (int64_t i = 0; i < h.numel(); ++i) dst[i] = load_as_float(h.view(), i);
}

// NaN ranks below every number; then larger score first; then lower position first.
bool better(float a, int32_t pa, float b, int32_t pb) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return pa < pb;
}

}  // namespace

DcpSimulation::DcpSimulation(ModelConfig config, Backend& backend, int world,
                             const KvPoolDesc& pool, const std::vector<int32_t>& max_lengths,
                             TensorView kv_b_proj, LayerOptions options)
    : config_(std::move(config)),
      backend_(backend),
      world_(world),
      max_lengths_(max_lengths),
      kv_b_proj_(kv_b_proj),
      options_(std::move(options)) {
  config_.validate();
  DSAKIT_CHECK_ARG(world_ >= 1 && world_ <= 64, "dcp world size: expected 1..64, got ", world_);
  DSAKIT_CHECK_ARG(pool.d_c == config_.kv_lora_rank && pool.d_rope == config_.qk_rope_head_dim,
                   "dcp pool dims do not match the model");
  check_tensor(kv_b_proj_, "kv_b_proj", DType::kBF16, backend_.device(),
               {int64_t(config_.num_heads) * (config_.qk_nope_head_dim + config_.v_head_dim),
                config_.kv_lora_rank});
  sm_scale_ = options_.sm_scale > 0 ? options_.sm_scale : config_.softmax_scale();
  for (int w = 0; w < world_; ++w) {
    std::vector<int32_t> local(max_lengths_.size());
    for (size_t r = 0; r < local.size(); ++r) local[r] = owned(max_lengths_[r], w, world_);
    Rank rank{backend_.make_kv_pool(pool),
              backend_.make_index_pool({pool.page_size, pool.num_pages, config_.index_head_dim}),
              allocate_pages(local, pool.page_size, pool.num_pages, uint64_t(1000 + w))};
    ranks_.push_back(std::move(rank));
  }
}

LayerResult DcpSimulation::forward(const Batch& batch, const LayerInputs& in) {
  Backend& be = backend_;
  const auto& c = config_;
  const int b = batch.num_requests();
  DSAKIT_CHECK_ARG(b == int(max_lengths_.size()), "dcp batch: expected ", max_lengths_.size(),
                   " requests, got ", b);
  DSAKIT_CHECK_ARG(batch.extend_lens.size() == size_t(b), "dcp batch: extend_lens size");
  for (int r = 0; r < b; ++r)
    DSAKIT_CHECK_ARG(batch.prefix_lens[size_t(r)] >= 0 && batch.extend_lens[size_t(r)] >= 0 &&
                         int64_t(batch.prefix_lens[size_t(r)]) + batch.extend_lens[size_t(r)] <=
                             max_lengths_[size_t(r)],
                     "dcp request ", r, ": prefix + extend exceeds its max length ",
                     max_lengths_[size_t(r)]);
  LayerResult res;
  res.plan =
      plan_batch(batch, c, ranks_[0].kv.layout(), be.capabilities(), options_.policy.with_env());
  const int64_t t = batch.num_new_tokens();
  const int64_t h = c.num_heads, dv = c.v_head_dim, dc = c.kv_lora_rank;
  check_layer_inputs(c, be.device(), in, t);
  res.o = be.empty(options_.output_dtype, {t, h, dv});
  res.lse = be.empty(DType::kF32, {t, h});
  if (t == 0) return res;
  const int ps = ranks_[0].kv.desc().page_size;
  const BatchIndex gi = BatchIndex::build(
      Batch{
          batch.mode, batch.prefix_lens, batch.extend_lens,
          std::vector<std::vector<int32_t>>(
              size_t(b), std::vector<int32_t>(size_t((batch.max_kv_len() + ps - 1) / ps + 1), 0))},
      ps);  // positions and request of each token (locations unused)
  const TokenStore host{{},
                        be.to_host(in.q_nope),
                        be.to_host(in.q_pe),
                        be.to_host(in.c_kv),
                        be.to_host(in.k_pe),
                        be.to_host(in.idx_q),
                        be.to_host(in.idx_k),
                        be.to_host(in.idx_w)};

  // ---- each rank stores the new tokens it owns --------------------------------------------
  for (int w = 0; w < world_; ++w) {
    Rank& rank = ranks_[size_t(w)];
    std::vector<int64_t> rows;
    std::vector<int32_t> locs;
    for (int64_t i = 0; i < t; ++i) {
      const int32_t p = gi.token_pos[size_t(i)];
      if (p % world_ != w) continue;
      rows.push_back(i);
      locs.push_back(int32_t(
          location_of(rank.page_tables[size_t(gi.token_request[size_t(i)])], ps, p / world_)));
    }
    if (rows.empty()) continue;
    const auto part = host.slice(be, rows);
    const Tensor dlocs = be.to_device(host_i32(locs));
    be.store_kv(rank.kv, dlocs, part.c_kv, part.k_pe);
    be.store_index_keys(rank.index, dlocs, part.idx_k);
  }

  // Per rank: local kv_locs of every request's owned positions and visible counts per token.
  struct Local {
    std::vector<int32_t> kv_locs, cu_kv, visible, kv_start;
  };
  std::vector<Local> local(static_cast<size_t>(world_));
  for (int w = 0; w < world_; ++w) {
    Local& l = local[size_t(w)];
    l.cu_kv.assign(size_t(b) + 1, 0);
    for (int r = 0; r < b; ++r) {
      const int32_t n = owned(gi.cu_kv[size_t(r) + 1] - gi.cu_kv[size_t(r)], w, world_);
      for (int32_t j = 0; j < n; ++j)
        l.kv_locs.push_back(int32_t(location_of(ranks_[size_t(w)].page_tables[size_t(r)], ps, j)));
      l.cu_kv[size_t(r) + 1] = l.cu_kv[size_t(r)] + n;
    }
    for (int64_t i = 0; i < t; ++i) {
      l.visible.push_back(owned(gi.token_ctx_len[size_t(i)], w, world_));
      l.kv_start.push_back(l.cu_kv[size_t(gi.token_request[size_t(i)])]);
    }
  }

  const bool dense = res.plan.path == AttentionPath::kDenseMha;
  DSAKIT_CHECK(!dense || be.capabilities().dense_kv_visible, kUnsupported,
               "dcp: the dense path needs per-query visible counts, which the ",
               be.capabilities().device_name, " dense kernel does not support; use sparse");
  const int64_t d_part = dense ? dv : dc;
  Tensor o_parts = Tensor::host(DType::kF32, {world_, t, h, d_part});
  Tensor lse_parts = Tensor::host(DType::kF32, {world_, t, h});
  const DType mid = be.capabilities().intermediate_dtype;
  Tensor q_abs;
  std::vector<int32_t> selected;  // [t, k] global positions (sparse path)
  const int k = c.index_topk;

  if (!dense) {
    q_abs = be.empty(mid, {t, h, dc});
    be.absorb_q(in.q_nope, kv_b_proj_, c.v_head_dim, q_abs);
    // Global top-k = merge of per-rank candidates (identity where ctx <= k).
    selected.assign(size_t(t * k), -1);
    std::vector<std::vector<std::pair<float, int32_t>>> cand(static_cast<size_t>(t));
    Tensor q8 = be.empty(DType::kU8, {t, c.index_n_heads, c.index_head_dim});
    Tensor gate = be.empty(DType::kF32, {t, c.index_n_heads});
    be.indexer_quantize_q(in.idx_q, in.idx_w, q8, gate);
    for (int w = 0; w < world_; ++w) {
      Local& l = local[size_t(w)];
      int32_t width = 1;
      for (int32_t v : l.visible) width = std::max(width, v);
      const Tensor kv_locs = be.to_device(host_i32(l.kv_locs));
      const Tensor kv_start = be.to_device(host_i32(l.kv_start));
      const Tensor visible = be.to_device(host_i32(l.visible));
      IndexerArgs a{q8, gate, &ranks_[size_t(w)].index, kv_locs, kv_start, visible};
      Tensor logits = be.empty(DType::kF32, {t, width});
      be.indexer_logits(a, 0, t, logits);
      Tensor top = be.empty(DType::kI32, {t, k});
      be.topk(logits, visible, k, top);
      const Tensor hl = be.to_host(logits), ht = be.to_host(top);
      for (int64_t i = 0; i < t; ++i)
        for (int j = 0; j < k; ++j) {
          const int32_t lr = ht.ptr<int32_t>()[i * k + j];
          if (lr >= 0)
            cand[size_t(i)].push_back({hl.ptr<float>()[i * width + lr], w + lr * world_});
        }
    }
    for (int64_t i = 0; i < t; ++i) {
      auto& cs = cand[size_t(i)];
      std::sort(cs.begin(), cs.end(), [](const auto& x, const auto& y) {
        return better(x.first, x.second, y.first, y.second);
      });
      const size_t keep = std::min<size_t>(size_t(k), cs.size());
      std::vector<int32_t> pos;
      for (size_t j = 0; j < keep; ++j) pos.push_back(cs[j].second);
      std::sort(pos.begin(), pos.end());
      std::copy(pos.begin(), pos.end(), selected.begin() + i * k);
    }
  }

  for (int w = 0; w < world_; ++w) {
    Local& l = local[size_t(w)];
    Rank& rank = ranks_[size_t(w)];
    float* o_dst = o_parts.ptr<float>() + int64_t(w) * t * h * d_part;
    float* lse_dst = lse_parts.ptr<float>() + int64_t(w) * t * h;
    Tensor o_w = be.empty(mid, {t, h, d_part});
    Tensor lse_w = be.empty(DType::kF32, {t, h});
    const detail::PackedI32 idx =
        detail::upload_i32(be, {&l.kv_locs, &gi.cu_q, &l.cu_kv, &l.visible});
    const TensorView& kv_locs = idx.views[0];
    const detail::StageFn run = [](const char*, const std::function<void()>& fn) { fn(); };
    if (dense) {
      detail::dense_path(be, c, sm_scale_, rank.kv, kv_locs, in.q_nope, in.q_pe, kv_b_proj_,
                         gi.cu_q, l.cu_kv, idx.views[1], idx.views[2], &l.visible, idx.views[3],
                         o_w, lse_w, run);
    } else {
      std::vector<int32_t> locs(size_t(t * k), -1);
      for (int64_t i = 0; i < t; ++i) {
        const int r = gi.token_request[size_t(i)];
        for (int j = 0; j < k; ++j) {
          const int32_t p = selected[size_t(i * k + j)];
          if (p >= 0 && p % world_ == w)
            locs[size_t(i * k + j)] =
                int32_t(location_of(rank.page_tables[size_t(r)], ps, p / world_));
        }
      }
      const Tensor indices =
          be.to_device(make_view(locs.data(), DType::kI32, Device::kCpu, {t, k}));
      detail::sparse_attention(be, sm_scale_, rank.kv, q_abs, in.q_pe, indices, o_w, lse_w, run);
    }
    copy_to_f32(be, o_w, o_dst);
    copy_to_f32(be, lse_w, lse_dst);
  }

  // ---- merge the partials by lse ----------------------------------------------------------
  const Tensor d_o_parts = be.to_device(o_parts);
  const Tensor d_lse_parts = be.to_device(lse_parts);
  if (dense) {
    be.merge_partials(d_o_parts, d_lse_parts, res.o, res.lse);
  } else {
    Tensor o_lat = be.empty(mid, {t, h, dc});
    be.merge_partials(d_o_parts, d_lse_parts, o_lat, res.lse);
    be.up_proj_v(o_lat, kv_b_proj_, c.qk_nope_head_dim, res.o);
    res.topk = be.to_device(make_view(selected.data(), DType::kI32, Device::kCpu, {t, k}));
  }
  return res;
}

}  // namespace dsakit
