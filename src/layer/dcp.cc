// DcpRank: one rank's part of the DSA layer under context parallelism, and DcpSimulation: W of
// them on threads of one process (include/dsakit/dcp.h, docs/layer.md).
//
// Rank w of W owns position p of a request when p % W == w, at local row p / W. One forward:
//   1. every rank validates the batch and plans with the global lengths (all ranks alike);
//   2. stores the new tokens it owns (their rows selected from the replicated inputs);
//   3. dense: attention of every query over the keys it owns (per-query visible counts);
//      sparse: local top-k of the owned keys, their scores re-read by the indexer, an
//      all-gather of (score, global position) candidates, the same merged top-k on every rank,
//      attention over the selected keys it owns, V up-projection;
//   4. all-gather of the partial outputs (o, lse) and their merge by lse.
#include <algorithm>
#include <exception>
#include <thread>

#include "dsakit/cost_model.h"
#include "dsakit/dcp.h"
#include "dsakit/error.h"
#include "src/core/validate.h"
#include "src/layer/page_tables.h"
#include "src/layer/paths.h"

namespace dsakit {

DcpRank::DcpRank(ModelConfig config, Backend& backend, DcpComm& comm, const KvPoolDesc& pool,
                 const std::vector<int32_t>& max_lengths, TensorView kv_b_proj,
                 LayerOptions options)
    : config_(std::move(config)),
      be_(backend),
      comm_(comm),
      max_lengths_(max_lengths),
      kv_b_proj_(kv_b_proj),
      options_(std::move(options)),
      kv_(backend.make_kv_pool(pool)),
      index_(backend.make_index_pool({pool.page_size, pool.num_pages, config_.index_head_dim})) {
  config_.validate();
  DSAKIT_CHECK_ARG(pool.d_c == config_.kv_lora_rank && pool.d_rope == config_.qk_rope_head_dim,
                   "dcp pool dims do not match the model");
  check_tensor(kv_b_proj_, "kv_b_proj", DType::kBF16, be_.device(),
               {int64_t(config_.num_heads) * (config_.qk_nope_head_dim + config_.v_head_dim),
                config_.kv_lora_rank});
  validate::optional_fp8_block_weights(options_.kv_b_proj_fp8, be_.device(), kv_b_proj_.shape[0],
                                       config_.kv_lora_rank);
  for (const int32_t len : max_lengths_)
    DSAKIT_CHECK_ARG(len >= 0, "dcp max_lengths: expected >= 0, got ", len);
  sm_scale_ = options_.sm_scale > 0 ? options_.sm_scale : config_.softmax_scale();
  options_.sparse_rows = detail::resolve_sparse_rows(kv_, options_.sparse_rows);
  std::vector<int32_t> local(max_lengths_.size());
  for (size_t r = 0; r < local.size(); ++r)
    local[r] = dcp_owned_positions(max_lengths_[r], rank(), world());
  page_tables_ = allocate_pages(local, pool.page_size, pool.num_pages, uint64_t(1000 + rank()));
}

LayerResult DcpRank::forward(const Batch& batch, const LayerInputs& in,
                             const std::vector<int32_t>& requests) {
  Backend& be = be_;
  const ModelConfig& c = config_;
  const int world = comm_.world(), w = comm_.rank();
  const int b = batch.num_requests();
  const int num_requests = int(max_lengths_.size());
  DSAKIT_CHECK_ARG(batch.extend_lens.size() == size_t(b), "dcp batch: extend_lens size");
  std::vector<int32_t> req(requests);
  if (req.empty()) {
    DSAKIT_CHECK_ARG(b == num_requests, "dcp batch: expected ", num_requests,
                     " requests (or their ids), got ", b);
    for (int r = 0; r < b; ++r) req.push_back(r);
  }
  DSAKIT_CHECK_ARG(int(req.size()) == b, "dcp batch: ", b, " requests but ", req.size(), " ids");
  std::vector<uint8_t> seen(size_t(num_requests), 0);
  for (int r = 0; r < b; ++r) {
    const int32_t id = req[size_t(r)];
    DSAKIT_CHECK_ARG(id >= 0 && id < num_requests && !seen[size_t(id)], "dcp batch entry ", r,
                     ": request id ", id, " is out of range [0, ", num_requests, ") or repeated");
    seen[size_t(id)] = 1;
    DSAKIT_CHECK_ARG(batch.prefix_lens[size_t(r)] >= 0 && batch.extend_lens[size_t(r)] >= 0 &&
                         int64_t(batch.prefix_lens[size_t(r)]) + batch.extend_lens[size_t(r)] <=
                             max_lengths_[size_t(id)],
                     "dcp request ", id, ": prefix + extend exceeds its max length ",
                     max_lengths_[size_t(id)]);
  }
  LayerResult res;
  res.plan = plan_batch(batch, c, kv_.layout(), be.capabilities(), options_.policy.with_env());
  const int64_t t = batch.num_new_tokens();
  const int64_t h = c.num_heads, dv = c.v_head_dim, dc = c.kv_lora_rank;
  const int k = c.index_topk;
  check_layer_inputs(c, be.device(), in, t);
  bool dense = res.plan.path == AttentionPath::kDenseMha;
  if (dense && !be.capabilities().dense_kv_visible) {
    // A shard's dense attention needs per-query visible counts. Where the kernel lacks them, the
    // sparse path computes the same exact result (dense is only planned where every context fits
    // in k, unless approximation or a forced mode asked for it).
    DSAKIT_CHECK(options_.policy.mode != DispatchMode::kDense && !res.plan.approximate,
                 kUnsupported, "dcp: the dense path needs per-query visible counts, which the ",
                 be.capabilities().device_name, " dense kernel does not support; use sparse");
    dense = false;
    res.plan.path = AttentionPath::kSparseMla;
    for (PlanSegment& segment : res.plan.segments) segment.path = AttentionPath::kSparseMla;
    res.plan.reason += "; dcp: sparse MLA instead (exact here; the " +
                       be.capabilities().device_name +
                       " dense kernel has no per-query visible counts for a shard)";
  }
  DSAKIT_CHECK_ARG(t * k <= INT32_MAX, "dcp: ", t, " tokens x top-k ", k,
                   " exceeds the int32 candidate index");
  res.o = be.empty(options_.output_dtype, {t, h, dv});
  res.lse = be.empty(DType::kF32, {t, h});
  if (t == 0) return res;
  const detail::StageFn stage = [&](const char* name, const std::function<void()>& fn) {
    if (!options_.time_stages) return fn();
    res.stages.push_back({name, be.time_ms(fn)});
  };

  // ---- host index lists of this rank --------------------------------------------------------
  const int ps = kv_.desc().page_size;
  const BatchIndex gi = BatchIndex::build(
      Batch{
          batch.mode, batch.prefix_lens, batch.extend_lens,
          std::vector<std::vector<int32_t>>(
              size_t(b), std::vector<int32_t>(size_t((batch.max_kv_len() + ps - 1) / ps + 1), 0))},
      ps);  // positions and request of each token (its locations are not used)
  std::vector<int32_t> store_rows, store_locs;  // new tokens this rank owns: input row, location
  for (int64_t i = 0; i < t; ++i) {
    const int32_t p = gi.token_pos[size_t(i)];
    if (p % world != w) continue;
    store_rows.push_back(int32_t(i));
    store_locs.push_back(int32_t(location_of(
        page_tables_[size_t(req[size_t(gi.token_request[size_t(i)])])], ps, p / world)));
  }
  // Local keys, request-major: locations of the owned positions, the global position of each
  // local row, and per token the local row range it sees.
  std::vector<int32_t> kv_locs, row_pos, cu_kv(static_cast<size_t>(b) + 1, 0),
      visible(static_cast<size_t>(t)), kv_start(static_cast<size_t>(t));
  // Global positions (gi.kv_locs order) -> this rank's locations, -1 where another rank owns it;
  // with staged rows (docs/layer.md#staged-rows), -> the owned row's index in kv_locs instead.
  // This rank owns its rows of every request and reads about 1/world of the batch's
  // Σ_t min(ctx_t, k) selected slots.
  int64_t owned_rows = 0;
  for (int r = 0; r < b; ++r)
    owned_rows += dcp_owned_positions(gi.cu_kv[size_t(r) + 1] - gi.cu_kv[size_t(r)], w, world);
  const bool staged =
      !dense && detail::stage_sparse_rows(be, kv_, options_.sparse_rows, double(owned_rows),
                                          CostFeatures::of(batch, c).ctx_topk / world, c.num_heads);
  std::vector<int32_t> global_locs;
  for (int r = 0; r < b; ++r) {
    const int32_t len = gi.cu_kv[size_t(r) + 1] - gi.cu_kv[size_t(r)];
    const int32_t n = dcp_owned_positions(len, w, world);
    const std::vector<int32_t>& table = page_tables_[size_t(req[size_t(r)])];
    for (int32_t j = 0; j < n; ++j) {
      kv_locs.push_back(int32_t(location_of(table, ps, j)));
      row_pos.push_back(w + j * world);
    }
    cu_kv[size_t(r) + 1] = cu_kv[size_t(r)] + n;
    for (int32_t p = 0; p < len; ++p)
      global_locs.push_back(p % world != w ? -1
                            : staged       ? cu_kv[size_t(r)] + p / world
                                           : int32_t(location_of(table, ps, p / world)));
  }
  std::vector<int32_t> cand_start(static_cast<size_t>(t)), cand_len(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) {
    visible[size_t(i)] = dcp_owned_positions(gi.token_ctx_len[size_t(i)], w, world);
    kv_start[size_t(i)] = cu_kv[size_t(gi.token_request[size_t(i)])];
    cand_start[size_t(i)] = int32_t(i * k);
    // A token whose whole context fits in k keeps every position: its scores are not needed.
    cand_len[size_t(i)] =
        gi.token_ctx_len[size_t(i)] <= k ? 0 : std::min<int32_t>(visible[size_t(i)], k);
  }
  // The rank feeds the backend indices it built itself from a validated batch.
  const IndexValueChecksOff checks_off(be);
  const detail::PackedI32 idx = detail::upload_i32(
      be, {&store_rows, &store_locs, &kv_locs, &row_pos, &cu_kv, &visible, &kv_start, &gi.cu_q,
           &global_locs, &gi.token_kv_start, &gi.token_ctx_len, &cand_start, &cand_len});
  const TensorView &d_store_rows = idx.views[0], &d_store_locs = idx.views[1],
                   &d_kv_locs = idx.views[2], &d_row_pos = idx.views[3], &d_cu_kv = idx.views[4],
                   &d_visible = idx.views[5], &d_kv_start = idx.views[6], &d_cu_q = idx.views[7],
                   &d_global_locs = idx.views[8], &d_token_kv_start = idx.views[9],
                   &d_ctx_len = idx.views[10], &d_cand_start = idx.views[11],
                   &d_cand_len = idx.views[12];

  // ---- store the owned new tokens -----------------------------------------------------------
  if (!store_rows.empty()) {
    stage("store", [&] {
      const int64_t m = int64_t(store_rows.size());
      const Tensor c_kv = be.empty(in.c_kv.dtype, {m, dc});
      const Tensor k_pe = be.empty(in.k_pe.dtype, {m, c.qk_rope_head_dim});
      const Tensor idx_k = be.empty(in.idx_k.dtype, {m, c.index_head_dim});
      be.select_rows(in.c_kv, d_store_rows, c_kv);
      be.select_rows(in.k_pe, d_store_rows, k_pe);
      be.select_rows(in.idx_k, d_store_rows, idx_k);
      be.store_tokens(kv_, index_, d_store_locs, c_kv, k_pe, idx_k);
    });
  }

  // ---- partial attention over the owned keys ------------------------------------------------
  const DType mid = be.capabilities().intermediate_dtype;
  const Tensor o_part = be.empty(mid, {t, h, dv});
  const Tensor lse_part = be.empty(DType::kF32, {t, h});
  if (dense) {
    detail::dense_path(be, c, sm_scale_, kv_, d_kv_locs, in.q_nope, in.q_pe, kv_b_proj_, gi.cu_q,
                       cu_kv, d_cu_q, d_cu_kv, &visible, d_visible, o_part, lse_part, stage, {},
                       detail::fp8_up_proj_weights(be, kv_, options_));
  } else {
    // Local top-k (local rows) and the candidates' scores and global positions.
    const Tensor local_top = be.empty(DType::kI32, {t, k});
    IndexerArgs local;
    local.keys = &index_;
    local.kv_locs = d_kv_locs;
    local.kv_start = d_kv_start;
    local.ctx_len = d_visible;
    stage("indexer_topk", [&] { be.indexer_topk(in.idx_q, in.idx_w, local, k, local_top); });
    const Tensor scores = be.empty(DType::kF32, {t, k});
    const Tensor positions = be.empty(DType::kI32, {t, k});
    stage("candidates", [&] {
      const Tensor cand_locs = be.empty(DType::kI32, {t, k});
      be.positions_to_locations(local_top, d_kv_locs, d_kv_start, d_visible, cand_locs);
      be.positions_to_locations(local_top, d_row_pos, d_kv_start, d_visible, positions);
      const Tensor q8 = be.empty(DType::kU8, {t, c.index_n_heads, c.index_head_dim});
      const Tensor gate = be.empty(DType::kF32, {t, c.index_n_heads});
      be.indexer_quantize_q(in.idx_q, in.idx_w, q8, gate);
      IndexerArgs cand;
      cand.q8 = q8;
      cand.gate = gate;
      cand.keys = &index_;
      cand.kv_locs = make_view(cand_locs.view().data, DType::kI32, be.device(), {t * k});
      cand.kv_start = d_cand_start;
      cand.ctx_len = d_cand_len;
      be.indexer_logits(cand, 0, t, scores);
    });
    const Tensor all_scores = be.empty(DType::kF32, {world, t, k});
    const Tensor all_positions = be.empty(DType::kI32, {world, t, k});
    res.topk = be.empty(DType::kI32, {t, k});
    stage("exchange_topk", [&] {
      comm_.all_gather(be, scores, all_scores);
      comm_.all_gather(be, positions, all_positions);
    });
    stage("merge_topk", [&] { be.merge_topk(all_scores, all_positions, k, res.topk); });
    // The selected positions this rank owns -> its pool locations, or the rows of its staged
    // copy (-1 elsewhere).
    PagedKvPool rows;
    if (staged) rows = detail::stage_rows(be, kv_, d_kv_locs, stage);
    const Tensor locs = be.empty(DType::kI32, {t, k});
    stage("topk_to_locations", [&] {
      be.positions_to_locations(res.topk, d_global_locs, d_token_kv_start, d_ctx_len, locs);
    });
    const Tensor q_abs = be.empty(mid, {t, h, dc});
    stage("absorb_q", [&] { be.absorb_q(in.q_nope, kv_b_proj_, c.v_head_dim, q_abs); });
    const Tensor o_lat = be.empty(mid, {t, h, dc});
    detail::sparse_attention(be, sm_scale_, staged ? rows : kv_, q_abs, in.q_pe, locs, o_lat,
                             lse_part, stage);
    stage("up_proj_v", [&] { be.up_proj_v(o_lat, kv_b_proj_, c.qk_nope_head_dim, o_part); });
  }

  // ---- merge the ranks' partials by lse -----------------------------------------------------
  const Tensor o_parts = be.empty(mid, {world, t, h, dv});
  const Tensor lse_parts = be.empty(DType::kF32, {world, t, h});
  stage("exchange_partials", [&] {
    comm_.all_gather(be, o_part, o_parts);
    comm_.all_gather(be, lse_part, lse_parts);
  });
  stage("merge_partials", [&] { be.merge_partials(o_parts, lse_parts, res.o, res.lse); });
  return res;
}

// ---- DcpSimulation ------------------------------------------------------------------------------

DcpSimulation::DcpSimulation(ModelConfig config, Backend& backend, int world,
                             const KvPoolDesc& pool, const std::vector<int32_t>& max_lengths,
                             TensorView kv_b_proj, LayerOptions options)
    : backend_(backend), group_(world) {
  for (int w = 1; w < world; ++w) peers_.push_back(backend.make_peer());
  for (int w = 0; w < world; ++w)
    ranks_.push_back(std::make_unique<DcpRank>(config, w == 0 ? backend : *peers_[size_t(w - 1)],
                                               group_.comm(w), pool, max_lengths, kv_b_proj,
                                               options));
  // The peers' pools were zero-filled on their own streams.
  for (auto& peer : peers_) peer->synchronize();
}

DcpSimulation::~DcpSimulation() = default;

int DcpSimulation::world() const {
  return group_.world();
}

LayerResult DcpSimulation::forward(const Batch& batch, const LayerInputs& inputs,
                                   const std::vector<int32_t>& requests) {
  const int world = group_.world();
  // The inputs were written in the caller's stream order; the other ranks read them.
  backend_.synchronize();
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::vector<LayerResult> results(static_cast<size_t>(world));
  const auto run_rank = [&](int w) {
    try {
      results[size_t(w)] = ranks_[size_t(w)]->forward(batch, inputs, requests);
    } catch (...) {
      errors[size_t(w)] = std::current_exception();
      group_.abort();
    }
  };
  std::vector<std::thread> threads;
  for (int w = 1; w < world; ++w) threads.emplace_back(run_rank, w);
  run_rank(0);
  for (std::thread& th : threads) th.join();
  for (auto& peer : peers_) peer->synchronize();
  // A rank's own error, rather than the "another rank failed" of the ranks it released.
  std::exception_ptr first;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    bool released = false;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& err) {
      released =
          std::string(err.what()).find(InProcessDcpGroup::kAbortedMessage) != std::string::npos;
    } catch (...) {
    }
    if (!first || !released) first = e;
    if (!released) break;
  }
  if (first) {
    group_.reset();
    std::rethrow_exception(first);
  }
  return std::move(results[0]);
}

}  // namespace dsakit
