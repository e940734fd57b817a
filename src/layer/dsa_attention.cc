// The layer call: validate -> plan -> store -> dense MHA, sparse MLA, or each segment of a mixed
// plan through its own path -> outputs.
#include <algorithm>
#include <cstdlib>
#include <functional>

#include "dsakit/error.h"
#include "dsakit/layer.h"
#include "src/core/validate.h"
#include "src/layer/paths.h"

namespace dsakit {

namespace {

// The index arrays of one BatchIndex on the device (detail::DeviceBatchIndex): new_locs,
// kv_start, ctx_len [T], kv_locs [N], cu_q, cu_kv [B+1].
int64_t index_bytes(const Batch& batch) {
  return 4 * (3 * batch.num_new_tokens() + batch.total_kv_len()) +
         8 * (int64_t(batch.num_requests()) + 1);
}

}  // namespace

const char* to_string(SparseRows rows) {
  switch (rows) {
    case SparseRows::kAuto:
      return "auto";
    case SparseRows::kPool:
      return "pool";
    case SparseRows::kStaged:
      return "staged";
  }
  return "?";
}

SparseRows parse_sparse_rows(const std::string& s) {
  for (SparseRows r : {SparseRows::kAuto, SparseRows::kPool, SparseRows::kStaged})
    if (s == to_string(r)) return r;
  DSAKIT_FAIL(kInvalidArgument, "sparse rows: expected 'auto', 'pool' or 'staged', got '", s, "'");
}

DsaAttention::DsaAttention(ModelConfig config, Backend& backend, PagedKvPool& kv_pool,
                           IndexKeyPool& index_pool, TensorView kv_b_proj, LayerOptions options)
    : config_(std::move(config)),
      backend_(backend),
      kv_pool_(kv_pool),
      index_pool_(index_pool),
      kv_b_proj_(kv_b_proj),
      options_(std::move(options)) {
  config_.validate();
  const Device dev = backend_.device();
  DSAKIT_CHECK_ARG(kv_pool_.device() == dev, "kv pool lives on ", to_string(kv_pool_.device()),
                   ", backend on ", to_string(dev));
  DSAKIT_CHECK_ARG(index_pool_.device() == dev, "index pool lives on ",
                   to_string(index_pool_.device()), ", backend on ", to_string(dev));
  const auto& kd = kv_pool_.desc();
  DSAKIT_CHECK_ARG(kd.d_c == config_.kv_lora_rank && kd.d_rope == config_.qk_rope_head_dim,
                   "kv pool dims d_c=", kd.d_c, ", d_rope=", kd.d_rope,
                   " do not match the model's kv_lora_rank=", config_.kv_lora_rank,
                   ", qk_rope_head_dim=", config_.qk_rope_head_dim);
  DSAKIT_CHECK_ARG(index_pool_.desc().d_i == config_.index_head_dim,
                   "index pool d_i=", index_pool_.desc().d_i,
                   " does not match index_head_dim=", config_.index_head_dim);
  DSAKIT_CHECK_ARG(index_pool_.desc().page_size == kd.page_size, "index pool page_size ",
                   index_pool_.desc().page_size, " differs from kv pool page_size ", kd.page_size);
  DSAKIT_CHECK_ARG(index_pool_.desc().num_pages >= kd.num_pages, "index pool has ",
                   index_pool_.desc().num_pages, " pages, fewer than the kv pool's ", kd.num_pages);
  const int64_t h = config_.num_heads;
  check_tensor(kv_b_proj_, "kv_b_proj", DType::kBF16, dev,
               {h * (config_.qk_nope_head_dim + config_.v_head_dim), config_.kv_lora_rank});
  validate::optional_fp8_block_weights(options_.kv_b_proj_fp8, dev, kv_b_proj_.shape[0],
                                       config_.kv_lora_rank);
  DSAKIT_CHECK_ARG(options_.output_dtype == DType::kBF16 || options_.output_dtype == DType::kF32,
                   "output dtype: expected bf16 or f32, got ", to_string(options_.output_dtype));
  DSAKIT_CHECK(options_.output_dtype == DType::kBF16 ||
                   backend_.capabilities().intermediate_dtype == DType::kF32,
               kUnsupported, "output dtype f32 needs a backend with f32 intermediates (cpu); ",
               backend_.capabilities().device_name, " produces bf16 outputs");
  DSAKIT_CHECK_ARG(options_.sm_scale >= 0, "sm_scale: expected > 0 (or 0 for the config's), got ",
                   options_.sm_scale);
  DSAKIT_CHECK_ARG(options_.max_workspace_bytes >= 0,
                   "max_workspace_bytes: expected >= 0 (0: no limit), got ",
                   options_.max_workspace_bytes);
  sm_scale_ = options_.sm_scale > 0 ? options_.sm_scale : config_.softmax_scale();
  options_.sparse_rows = detail::resolve_sparse_rows(kv_pool_, options_.sparse_rows);
  options_.sparse_form = detail::resolve_sparse_form(backend_, config_, options_.sparse_form);
  set_policy(options_.policy);
}

void DsaAttention::set_policy(const DispatchPolicy& policy) {
  options_.policy = policy;
  // Read the environment's profile once; with_env() in plan() then finds it already loaded.
  if (const char* v = std::getenv("DSAKIT_PROFILE"); v && *v && options_.policy.profile_path != v) {
    try {
      options_.policy = options_.policy.with_profile(v);
    } catch (const Error& e) {
      DSAKIT_FAIL(kInvalidArgument, "DSAKIT_PROFILE: ", e.what());
    }
  }
}

void check_layer_inputs(const ModelConfig& c, Device dev, const LayerInputs& in, int64_t t) {
  check_tensor(in.q_nope, "q_nope", DType::kBF16, dev, {t, c.num_heads, c.qk_nope_head_dim});
  check_tensor(in.q_pe, "q_pe", DType::kBF16, dev, {t, c.num_heads, c.qk_rope_head_dim});
  check_tensor(in.c_kv, "c_kv", DType::kBF16, dev, {t, c.kv_lora_rank});
  check_tensor(in.k_pe, "k_pe", DType::kBF16, dev, {t, c.qk_rope_head_dim});
  check_tensor(in.idx_q, "idx_q", DType::kBF16, dev, {t, c.index_n_heads, c.index_head_dim});
  check_tensor(in.idx_k, "idx_k", DType::kBF16, dev, {t, c.index_head_dim});
  check_tensor(in.idx_w, "idx_w", DType::kF32, dev, {t, c.index_n_heads});
}

Plan DsaAttention::plan(const Batch& batch) const {
  batch.validate(kv_pool_.desc().page_size, kv_pool_.desc().num_pages);
  const DispatchPolicy policy = options_.policy.with_env();
  Plan plan = plan_batch(batch, config_, kv_pool_.layout(), backend_.capabilities(), policy,
                         options_.sparse_form);
  // kAuto never trades a call that fits max_workspace_bytes for one that does not: the masked
  // form holds every position's K/V, MLA only the selected rows.
  if (options_.sparse_form == SparseForm::kAuto && plan.sparse_form == SparseForm::kMaskedMha &&
      options_.max_workspace_bytes > 0 &&
      workspace_bytes(batch, plan) > options_.max_workspace_bytes) {
    plan = plan_batch(batch, config_, kv_pool_.layout(), backend_.capabilities(), policy,
                      SparseForm::kMla);
    plan.reason += " (masked-mha form over max_workspace_bytes)";
  }
  return plan;
}

int64_t DsaAttention::workspace_bytes(const Batch& batch, AttentionPath path) const {
  DSAKIT_CHECK_ARG(path != AttentionPath::kMixed,
                   "workspace_bytes: a mixed plan's workspace depends on its segments; pass the "
                   "Plan");
  if (path == AttentionPath::kSparseMla && options_.sparse_form == SparseForm::kAuto)
    return std::max(workspace_bytes(batch, path, SparseForm::kMla),
                    workspace_bytes(batch, path, SparseForm::kMaskedMha));
  return workspace_bytes(batch, path, options_.sparse_form);
}

int64_t DsaAttention::workspace_bytes(const Batch& batch, AttentionPath path,
                                      SparseForm form) const {
  const auto& c = config_;
  const int64_t t = batch.num_new_tokens(), n = batch.total_kv_len(), h = c.num_heads;
  const int64_t mid = int64_t(dtype_size(backend_.capabilities().intermediate_dtype));
  // Outputs o, lse; the index arrays.
  const int64_t outputs_and_index =
      t * h * c.v_head_dim * int64_t(dtype_size(options_.output_dtype)) + 4 * t * h +
      index_bytes(batch);
  int64_t bytes = outputs_and_index;
  const Backend& be = backend_;
  if (path == AttentionPath::kDenseMha) {
    // c_kv (or the FP8 up-projection's own scratch), k_pe of every position; k_nope, v
    // up-projected per head; the kernel's scratch.
    const int64_t up_rows = h * (c.qk_nope_head_dim + c.v_head_dim);
    bytes += (detail::fp8_up_proj_weights(be, kv_pool_, options_) != nullptr
                  ? be.up_proj_kv_fp8_scratch_bytes(n, up_rows, c.kv_lora_rank)
                  : mid * n * c.kv_lora_rank) +
             mid * n * c.qk_rope_head_dim + mid * n * up_rows +
             be.dense_mha_scratch_bytes(n, h, c.qk_nope_head_dim, c.v_head_dim);
    return bytes;
  }
  // Top-k positions [T, k]; the indexer's blocks; then per form: locations [T, k], q_abs and
  // o_lat [T, H, d_c] and the staged rows, or the mask [T, W] and the dense path's K/V.
  const int64_t k = c.index_topk;
  bytes += 4 * t * k + IndexerBlocks::plan(t, c.index_n_heads, c.index_head_dim, n, c.index_topk,
                                           indexer_block_bytes())
                           .bytes;
  if (form == SparseForm::kMaskedMha)
    return bytes + 4 * t * detail::kv_mask_words(batch.max_kv_len()) +
           workspace_bytes(batch, AttentionPath::kDenseMha, form) - outputs_and_index;
  bytes += 4 * t * k + 2 * mid * t * h * c.kv_lora_rank;
  if (detail::stage_sparse_rows(be, kv_pool_, options_.sparse_rows, batch, c))
    bytes += detail::staged_rows_bytes(kv_pool_.desc(), n);
  return bytes;
}

int64_t DsaAttention::workspace_bytes(const Batch& batch, const Plan& plan) const {
  if (plan.path != AttentionPath::kMixed)
    return workspace_bytes(batch, plan.path, plan.sparse_form);
  // Segments run one after another: the largest one's intermediates, plus the whole batch's
  // outputs and the top-k array (-1 rows for the dense segments), plus the index arrays of the
  // batch and of every segment (uploaded together before the first segment runs).
  const auto& c = config_;
  const int64_t t = batch.num_new_tokens();
  int64_t seg_max = 0, indexes = index_bytes(batch);
  for (const auto& s : plan.segments) {
    const Batch sub = batch.slice(s.first_request, s.num_requests);
    seg_max = std::max(seg_max, workspace_bytes(sub, s.path, plan.sparse_form) - index_bytes(sub));
    indexes += index_bytes(sub);
  }
  return seg_max + indexes +
         t * c.num_heads * c.v_head_dim * int64_t(dtype_size(options_.output_dtype)) +
         4 * t * c.num_heads + 4 * t * c.index_topk;
}

void DsaAttention::run_path(AttentionPath path, SparseForm form, const Batch& batch,
                            const BatchIndex& bi, const detail::DeviceBatchIndex& dev,
                            const LayerInputs& in, const TensorView& o, const TensorView& lse,
                            const TensorView& topk, const detail::StageFn& stage) {
  switch (path) {
    case AttentionPath::kDenseMha: {
      // Dense MHA re-reads every position (prefix included) through the pool format; where that
      // format returns the inputs bit for bit (bf16 pool, no prefix) it reads the inputs.
      detail::KvRows stored;
      if (detail::pool_rows_are_inputs(backend_, kv_pool_, bi.cu_q, bi.cu_kv))
        stored = {in.c_kv, in.k_pe};
      detail::dense_path(backend_, config_, sm_scale_, kv_pool_, dev.kv_locs, in.q_nope, in.q_pe,
                         kv_b_proj_, bi.cu_q, bi.cu_kv, dev.cu_q, dev.cu_kv, nullptr, {}, o, lse,
                         stage, stored, detail::fp8_up_proj_weights(backend_, kv_pool_, options_));
      return;
    }
    case AttentionPath::kSparseMla:
      detail::sparse_path(
          backend_, config_, sm_scale_, kv_pool_, index_pool_, bi, dev, in, kv_b_proj_, o, lse,
          topk, stage, form,
          detail::stage_sparse_rows(backend_, kv_pool_, options_.sparse_rows, batch, config_),
          detail::fp8_up_proj_weights(backend_, kv_pool_, options_));
      return;
    case AttentionPath::kMixed:
      break;
  }
  DSAKIT_FAIL(kInternal, "run_path: a mixed plan runs each segment through its own path");
}

// The index arrays of a planned batch on the device: the whole batch's and, for a mixed plan,
// those of each run of requests with new tokens (all uploaded in one copy).
struct PreparedBatch::State {
  const DsaAttention* layer = nullptr;
  Batch batch;
  Plan plan;
  BatchIndex bi;
  std::vector<const PlanSegment*> runs;  // into plan.segments
  std::vector<Batch> run_batch;          // the requests of each run
  std::vector<BatchIndex> run_bi;
  std::vector<detail::DeviceBatchIndex> dev;

  State(const DsaAttention* owner, const Batch& b, Plan p, Backend& be, int page_size)
      : layer(owner), batch(b), plan(std::move(p)) {
    if (batch.num_new_tokens() == 0) return;  // nothing runs
    bi = BatchIndex::build(batch, page_size);
    if (plan.path == AttentionPath::kMixed)
      for (const PlanSegment& s : plan.segments) {
        if (bi.cu_q[size_t(s.first_request)] == bi.cu_q[size_t(s.first_request + s.num_requests)])
          continue;  // no new tokens
        runs.push_back(&s);
        run_batch.push_back(batch.slice(s.first_request, s.num_requests));
        run_bi.push_back(BatchIndex::build(run_batch.back(), page_size));
      }
    std::vector<const BatchIndex*> host_index{&bi};
    for (const BatchIndex& x : run_bi) host_index.push_back(&x);
    dev = detail::DeviceBatchIndex::upload(be, host_index);
  }
  State(const State&) = delete;  // runs point into plan.segments
  State& operator=(const State&) = delete;
};

const Batch& PreparedBatch::batch() const {
  DSAKIT_CHECK_ARG(state_ != nullptr, "prepared batch: empty (made by DsaAttention::prepare)");
  return state_->batch;
}

const Plan& PreparedBatch::plan() const {
  DSAKIT_CHECK_ARG(state_ != nullptr, "prepared batch: empty (made by DsaAttention::prepare)");
  return state_->plan;
}

void check_layer_outputs(const ModelConfig& c, Device dev, DType output_dtype,
                         const LayerOutputs& out, int64_t t) {
  if (out.o.ndim != 0) check_tensor(out.o, "o", output_dtype, dev, {t, c.num_heads, c.v_head_dim});
  if (out.lse.ndim != 0) check_tensor(out.lse, "lse", DType::kF32, dev, {t, c.num_heads});
  if (out.topk.ndim != 0) check_tensor(out.topk, "topk", DType::kI32, dev, {t, c.index_topk});
}

void DsaAttention::check_call(const Batch& batch, const Plan& plan, const LayerInputs& in,
                              const LayerOutputs& out) const {
  const int64_t t = batch.num_new_tokens();
  check_layer_inputs(config_, backend_.device(), in, t);
  check_layer_outputs(config_, backend_.device(), options_.output_dtype, out, t);
  if (options_.max_workspace_bytes > 0) {
    const int64_t need = workspace_bytes(batch, plan);
    DSAKIT_CHECK(need <= options_.max_workspace_bytes, kResource, "max_workspace_bytes: the ",
                 to_string(plan.path), " path over ", t, " new tokens and ", batch.total_kv_len(),
                 " positions needs ", need, " bytes of workspace, over the ", "limit of ",
                 options_.max_workspace_bytes, " bytes");
  }
}

LayerResult DsaAttention::forward(const Batch& batch, const LayerInputs& in) {
  return forward(batch, in, LayerOutputs{});
}

LayerResult DsaAttention::forward(const Batch& batch, const LayerInputs& in,
                                  const LayerOutputs& out) {
  // ---- validation: nothing is written before all of it passes ----------------------------
  Plan plan = this->plan(batch);
  check_call(batch, plan, in, out);
  const PreparedBatch::State state(this, batch, std::move(plan), backend_,
                                   kv_pool_.desc().page_size);
  return run(state, in, out);
}

PreparedBatch DsaAttention::prepare(const Batch& batch) const {
  PreparedBatch p;
  p.state_ = std::make_shared<const PreparedBatch::State>(this, batch, plan(batch), backend_,
                                                          kv_pool_.desc().page_size);
  return p;
}

LayerResult DsaAttention::forward(const PreparedBatch& prepared, const LayerInputs& in,
                                  const LayerOutputs& out) {
  DSAKIT_CHECK_ARG(prepared.defined(), "forward: the prepared batch is empty");
  DSAKIT_CHECK_ARG(prepared.state_->layer == this,
                   "forward: the batch was prepared by another layer");
  check_call(prepared.state_->batch, prepared.state_->plan, in, out);
  return run(*prepared.state_, in, out);
}

LayerResult DsaAttention::run(const PreparedBatch::State& state, const LayerInputs& in,
                              const LayerOutputs& out) {
  LayerResult res;
  res.plan = state.plan;
  const int64_t t = state.batch.num_new_tokens();
  const auto& c = config_;
  Backend& be = backend_;

  const detail::StageFn stage = [&](const char* name, const std::function<void()>& fn) {
    if (!options_.time_stages) return fn();
    res.stages.push_back({name, be.time_ms(fn)});
  };
  // A given output is viewed (no storage of its own), a missing one allocated.
  const auto output = [&](const TensorView& given, DType dtype, std::vector<int64_t> shape) {
    return given.ndim != 0 ? Tensor(nullptr, given) : be.empty(dtype, shape);
  };

  res.o = output(out.o, options_.output_dtype, {t, c.num_heads, c.v_head_dim});
  res.lse = output(out.lse, DType::kF32, {t, c.num_heads});
  if (t == 0) return res;

  // Every index array below was built from the validated batch (or by our own kernels): the
  // backend's host-side value checks would only repeat that validation with a sync per op.
  const IndexValueChecksOff checks_off(be);

  // ---- store the new tokens ---------------------------------------------------------------
  const auto store = [&] {
    stage("store", [&] {
      be.store_tokens(kv_pool_, index_pool_, state.dev[0].new_locs, in.c_kv, in.k_pe, in.idx_k);
    });
  };
  // Dense MHA over a fresh batch whose pool rows are its inputs (pool_rows_are_inputs) reads no
  // pool: its launches go first and the store after them, so that on a short batch, whose time
  // is the host's enqueue, the GPU runs the attention while the host enqueues the store.
  const bool store_last = res.plan.path == AttentionPath::kDenseMha &&
                          detail::pool_rows_are_inputs(be, kv_pool_, state.bi.cu_q, state.bi.cu_kv);
  if (!store_last) store();

  const bool any_sparse =
      std::any_of(res.plan.segments.begin(), res.plan.segments.end(),
                  [](const PlanSegment& s) { return s.path == AttentionPath::kSparseMla; });
  if (any_sparse) res.topk = output(out.topk, DType::kI32, {t, c.index_topk});
  if (res.plan.path != AttentionPath::kMixed) {
    run_path(res.plan.path, res.plan.sparse_form, state.batch, state.bi, state.dev[0], in, res.o,
             res.lse, res.topk, stage);
    if (store_last) store();
    return res;
  }
  // ---- mixed: each run of requests through its own path over its rows of the batch --------
  be.fill_bytes(res.topk, 0xFF);  // -1: dense rows select nothing
  for (size_t i = 0; i < state.runs.size(); ++i) {
    const PlanSegment& s = *state.runs[i];
    const int64_t r0 = state.bi.cu_q[size_t(s.first_request)],
                  r1 = state.bi.cu_q[size_t(s.first_request + s.num_requests)];
    LayerInputs rows;
    rows.q_nope = slice_rows(in.q_nope, r0, r1);
    rows.q_pe = slice_rows(in.q_pe, r0, r1);
    rows.c_kv = slice_rows(in.c_kv, r0, r1);
    rows.k_pe = slice_rows(in.k_pe, r0, r1);
    rows.idx_q = slice_rows(in.idx_q, r0, r1);
    rows.idx_k = slice_rows(in.idx_k, r0, r1);
    rows.idx_w = slice_rows(in.idx_w, r0, r1);
    run_path(s.path, res.plan.sparse_form, state.run_batch[i], state.run_bi[i], state.dev[i + 1],
             rows, slice_rows(res.o, r0, r1), slice_rows(res.lse, r0, r1),
             s.path == AttentionPath::kSparseMla ? slice_rows(res.topk, r0, r1) : TensorView{},
             stage);
  }
  return res;
}

}  // namespace dsakit
