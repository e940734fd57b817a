#include "src/layer/paths.h"

#include <algorithm>
#include <cstdlib>

#include "dsakit/cost_model.h"
#include "dsakit/error.h"

namespace dsakit::detail {

PackedI32 upload_i32(Backend& be, const std::vector<const std::vector<int32_t>*>& arrays) {
  std::vector<int32_t> packed;
  size_t total = 0;
  for (const auto* a : arrays) total += a->size();
  packed.reserve(total);
  for (const auto* a : arrays) packed.insert(packed.end(), a->begin(), a->end());
  PackedI32 out;
  out.storage =
      be.to_device(make_view(packed.data(), DType::kI32, Device::kCpu, {int64_t(packed.size())}));
  int64_t offset = 0;
  for (const auto* a : arrays) {
    const auto n = int64_t(a->size());
    out.views.push_back(slice_rows(out.storage, offset, offset + n));
    offset += n;
  }
  return out;
}

std::vector<DeviceBatchIndex> DeviceBatchIndex::upload(
    Backend& be, const std::vector<const BatchIndex*>& indexes) {
  std::vector<const std::vector<int32_t>*> arrays;
  for (const BatchIndex* bi : indexes)
    arrays.insert(arrays.end(), {&bi->new_locs, &bi->kv_locs, &bi->token_kv_start,
                                 &bi->token_ctx_len, &bi->cu_q, &bi->cu_kv});
  const PackedI32 packed = upload_i32(be, arrays);
  std::vector<DeviceBatchIndex> out(indexes.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const TensorView* v = packed.views.data() + 6 * i;
    out[i] = {packed.storage, v[0], v[1], v[2], v[3], v[4], v[5]};
  }
  return out;
}

void dense_path(Backend& be, const ModelConfig& c, double sm_scale, const PagedKvPool& pool,
                const TensorView& kv_locs, const TensorView& q_nope, const TensorView& q_pe,
                const TensorView& kv_b_proj, const std::vector<int32_t>& cu_q,
                const std::vector<int32_t>& cu_kv, const TensorView& d_cu_q,
                const TensorView& d_cu_kv, const std::vector<int32_t>* kv_visible,
                const TensorView& d_kv_visible, const TensorView& o, const TensorView& lse,
                const StageFn& stage, const KvRows& stored, const Fp8BlockWeights* kv_b_proj_fp8,
                const TensorView& kv_mask) {
  const DType mid = be.capabilities().intermediate_dtype;
  const int64_t n = kv_locs.shape[0], h = c.num_heads;
  const bool fp8 = kv_b_proj_fp8 != nullptr && stored.empty();
  Tensor gathered_c, gathered_pe;
  TensorView c_all = stored.c_kv, kpe_all = stored.k_pe;
  if (stored.empty()) {
    gathered_pe = be.empty(mid, {n, c.qk_rope_head_dim});
    kpe_all = gathered_pe;
  }
  if (stored.empty() && !fp8) {
    gathered_c = be.empty(mid, {n, c.kv_lora_rank});
    c_all = gathered_c;
    stage("gather", [&] { be.gather_kv(pool, kv_locs, c_all, kpe_all); });
  }
  // K and V up-projected into one [N, H, d_nope + d_v] buffer (one GEMM) where the backend
  // takes its halves, else into two tensors.
  Tensor kv_up, k_nope_t, v_t;
  TensorView k_nope, v;
  if (be.capabilities().kv_halves) {
    kv_up = be.empty(mid, {n, h, c.qk_nope_head_dim + c.v_head_dim});
    const KvHalves halves = kv_halves(kv_up, c.qk_nope_head_dim);
    k_nope = halves.k_nope;
    v = halves.v;
  } else {
    k_nope_t = be.empty(mid, {n, h, c.qk_nope_head_dim});
    v_t = be.empty(mid, {n, h, c.v_head_dim});
    k_nope = k_nope_t;
    v = v_t;
  }
  // The FP8 form reads the pool rows itself (codes, scales and k_pe): no gather stage.
  if (fp8)
    stage("up_proj_kv",
          [&] { be.up_proj_kv_fp8(pool, kv_locs, *kv_b_proj_fp8, k_nope, v, kpe_all); });
  else
    stage("up_proj_kv", [&] { be.up_proj_kv(c_all, kv_b_proj, k_nope, v); });
  DenseMhaArgs a;
  a.q_nope = q_nope;
  a.q_pe = q_pe;
  a.k_nope = k_nope;
  a.k_pe = kpe_all;
  a.v = v;
  a.cu_q = d_cu_q;
  a.cu_kv = d_cu_kv;
  a.cu_q_host = cu_q.data();
  a.cu_kv_host = cu_kv.data();
  if (kv_visible) {
    a.kv_visible = d_kv_visible;
    a.kv_visible_host = kv_visible->data();
  }
  a.kv_mask = kv_mask;
  a.num_requests = int(cu_q.size()) - 1;
  a.sm_scale = sm_scale;
  a.o = o;
  a.lse = lse;
  stage("dense_mha", [&] { be.dense_mha(a); });
}

const Fp8BlockWeights* fp8_up_proj_weights(const Backend& be, const PagedKvPool& pool,
                                           const LayerOptions& options) {
  const bool fp8 = options.kv_b_proj_fp8.defined() && pool.layout() != KvLayout::kBf16 &&
                   be.capabilities().fp8_up_proj;
  return fp8 ? &options.kv_b_proj_fp8 : nullptr;
}

bool pool_rows_are_inputs(const Backend& be, const PagedKvPool& pool,
                          const std::vector<int32_t>& cu_q, const std::vector<int32_t>& cu_kv) {
  return pool.layout() == KvLayout::kBf16 && be.capabilities().intermediate_dtype == DType::kBF16 &&
         cu_q == cu_kv;
}

bool stage_sparse_rows(const Backend& be, const PagedKvPool& pool, SparseRows option, double rows,
                       double reads, int64_t num_heads) {
  if (pool.layout() == KvLayout::kBf16 || option == SparseRows::kPool) return false;
  if (option == SparseRows::kStaged) return true;  // resolve_sparse_rows() checked the pool
  const Capabilities& caps = be.capabilities();
  if (pool.layout() == KvLayout::kFp8Raw && num_heads <= caps.sparse_reads_fp8_raw_heads)
    return false;
  return caps.sparse_prefers_bf16_rows && bf16_holds_pool_values(pool.desc()) && rows > 0 &&
         reads >= kStagedRowMinReads * rows;
}

bool stage_sparse_rows(const Backend& be, const PagedKvPool& pool, SparseRows option,
                       const Batch& batch, const ModelConfig& c) {
  return stage_sparse_rows(be, pool, option, double(batch.total_kv_len()),
                           CostFeatures::of(batch, c).ctx_topk, c.num_heads);
}

namespace {
// A bf16 pool of max(n, 1) rows (a pool has at least one page), location r = row r.
KvPoolDesc staged_rows_desc(const KvPoolDesc& pool, int64_t n) {
  KvPoolDesc d;
  d.layout = KvLayout::kBf16;
  d.page_size = 1;
  d.num_pages = std::max<int64_t>(n, 1);
  d.d_c = pool.d_c;
  d.d_rope = pool.d_rope;
  return d;
}
}  // namespace

int64_t staged_rows_bytes(const KvPoolDesc& pool, int64_t n) {
  const KvPoolDesc d = staged_rows_desc(pool, n);
  return d.num_locations() * d.bytes_per_token();
}

SparseRows resolve_sparse_rows(const PagedKvPool& pool, SparseRows option) {
  if (const char* v = std::getenv("DSAKIT_SPARSE_ROWS"); v && *v) {
    try {
      option = parse_sparse_rows(v);
    } catch (const Error& e) {
      DSAKIT_FAIL(kInvalidArgument, "DSAKIT_SPARSE_ROWS: ", e.what());
    }
  }
  DSAKIT_CHECK_ARG(option != SparseRows::kStaged || bf16_holds_pool_values(pool.desc()),
                   "sparse_rows staged: a bf16 copy holds this pool's values only for pow2 "
                   "tile scales or a power-of-two k_scale; the pool is ",
                   pool.desc().summary(), " (use 'pool' or 'auto')");
  return option;
}

PagedKvPool stage_rows(Backend& be, const PagedKvPool& pool, const TensorView& kv_locs,
                       const StageFn& stage) {
  const int64_t n = kv_locs.shape[0];
  const KvPoolDesc d = staged_rows_desc(pool.desc(), n);
  PagedKvPool rows(d, be.empty(DType::kU8, {d.num_locations(), d.bytes_per_token()}));
  // c_kv and k_pe: the two column ranges of the first n rows (bf16 [n, d_c + d_rope]).
  TensorView c_kv =
      make_view(rows.storage().data, DType::kBF16, be.device(), {n, int64_t(d.d_c) + d.d_rope});
  TensorView k_pe = c_kv;
  c_kv.shape[1] = d.d_c;
  k_pe.shape[1] = d.d_rope;
  k_pe.data = static_cast<bf16_t*>(c_kv.data) + d.d_c;
  stage("stage_rows", [&] { be.gather_kv(pool, kv_locs, c_kv, k_pe); });
  return rows;
}

SparseForm sparse_form_from_env(SparseForm option) {
  if (const char* v = std::getenv("DSAKIT_SPARSE_FORM"); v && *v) {
    try {
      return parse_sparse_form(v);
    } catch (const Error& e) {
      DSAKIT_FAIL(kInvalidArgument, "DSAKIT_SPARSE_FORM: ", e.what());
    }
  }
  return option;
}

SparseForm resolve_sparse_form(const Backend& be, const ModelConfig& c, SparseForm option) {
  option = sparse_form_from_env(option);
  const Capabilities& caps = be.capabilities();
  if (option == SparseForm::kAuto && !masked_mha_available(caps, c)) return SparseForm::kMla;
  DSAKIT_CHECK(option != SparseForm::kMaskedMha || masked_mha_available(caps, c), kUnsupported,
               "sparse form masked-mha: the ", caps.device_name,
               " backend has no masked dense MHA kernel for head dims (", c.qk_nope_head_dim, ", ",
               c.qk_rope_head_dim, ", ", c.v_head_dim,
               ") (Capabilities::dense_kv_mask); use 'mla' or 'auto'");
  return option;
}

int64_t kv_mask_words(int64_t max_kv_len) {
  return std::max<int64_t>(1, (max_kv_len + 31) / 32);
}

void sparse_path(Backend& be, const ModelConfig& c, double sm_scale, const PagedKvPool& kv_pool,
                 const IndexKeyPool& index_pool, const BatchIndex& bi, const DeviceBatchIndex& dev,
                 const LayerInputs& in, const TensorView& kv_b_proj, const TensorView& o,
                 const TensorView& lse, const TensorView& topk, const StageFn& stage,
                 SparseForm form, bool staged_rows, const Fp8BlockWeights* kv_b_proj_fp8) {
  const int64_t t = in.q_nope.shape[0], h = c.num_heads;
  const int k = c.index_topk;
  const DType mid = be.capabilities().intermediate_dtype;
  IndexerArgs layout;
  layout.keys = &index_pool;
  layout.kv_locs = dev.kv_locs;
  layout.kv_start = dev.kv_start;
  layout.ctx_len = dev.ctx_len;
  stage("indexer_topk", [&] { be.indexer_topk(in.idx_q, in.idx_w, layout, k, topk); });
  if (form == SparseForm::kMaskedMha) {
    int32_t longest = 0;
    for (size_t r = 0; r + 1 < bi.cu_kv.size(); ++r)
      longest = std::max(longest, bi.cu_kv[r + 1] - bi.cu_kv[r]);
    Tensor mask = be.empty(DType::kI32, {t, kv_mask_words(longest)});
    stage("topk_to_kv_mask", [&] { be.topk_to_kv_mask(topk, mask); });
    dense_path(be, c, sm_scale, kv_pool, dev.kv_locs, in.q_nope, in.q_pe, kv_b_proj, bi.cu_q,
               bi.cu_kv, dev.cu_q, dev.cu_kv, nullptr, {}, o, lse, stage, {}, kv_b_proj_fp8, mask);
    return;
  }
  // Staged: the context rows in kv_locs order; the positions then map to their rows by the
  // identity (kv_start + pos).
  PagedKvPool rows;
  if (staged_rows) rows = stage_rows(be, kv_pool, dev.kv_locs, stage);
  Tensor locs = be.empty(DType::kI32, {t, k});
  stage("topk_to_locations", [&] {
    be.positions_to_locations(topk, staged_rows ? TensorView{} : dev.kv_locs, dev.kv_start,
                              dev.ctx_len, locs);
  });
  Tensor q_abs = be.empty(mid, {t, h, c.kv_lora_rank});
  stage("absorb_q", [&] { be.absorb_q(in.q_nope, kv_b_proj, c.v_head_dim, q_abs); });
  Tensor o_lat = be.empty(mid, {t, h, c.kv_lora_rank});
  // The indexer's rows hold min(ctx_len, k) valid slots first (ascending, -1 padded): ctx_len as
  // topk_length stops each token there instead of scanning all k slots (the kernels clamp to k).
  sparse_attention(be, sm_scale, staged_rows ? rows : kv_pool, q_abs, in.q_pe, locs, o_lat, lse,
                   stage, dev.ctx_len);
  stage("up_proj_v", [&] { be.up_proj_v(o_lat, kv_b_proj, c.qk_nope_head_dim, o); });
}

void sparse_attention(Backend& be, double sm_scale, const PagedKvPool& pool,
                      const TensorView& q_abs, const TensorView& q_pe, const TensorView& indices,
                      const TensorView& o_lat, const TensorView& lse, const StageFn& stage,
                      const TensorView& topk_length) {
  SparseMlaArgs a;
  a.q_abs = q_abs;
  a.q_pe = q_pe;
  a.kv = &pool;
  a.indices = indices;
  a.topk_length = topk_length;
  a.sm_scale = sm_scale;
  a.o_lat = o_lat;
  a.lse = lse;
  stage("sparse_mla", [&] { be.sparse_mla(a); });
}

}  // namespace dsakit::detail
