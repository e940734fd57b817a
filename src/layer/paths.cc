#include "src/layer/paths.h"

#include <iterator>

namespace dsakit::detail {

namespace {

Tensor i32_on_device(Backend& be, const std::vector<int32_t>& v) {
  return be.to_device(
      make_view(const_cast<int32_t*>(v.data()), DType::kI32, Device::kCpu, {int64_t(v.size())}));
}

}  // namespace

DeviceBatchIndex DeviceBatchIndex::upload(Backend& be, const BatchIndex& bi) {
  const std::vector<int32_t>* parts[] = {&bi.new_locs,      &bi.kv_locs, &bi.token_kv_start,
                                         &bi.token_ctx_len, &bi.cu_q,    &bi.cu_kv};
  std::vector<int32_t> packed;
  size_t total = 0;
  for (const auto* p : parts) total += p->size();
  packed.reserve(total);
  for (const auto* p : parts) packed.insert(packed.end(), p->begin(), p->end());
  DeviceBatchIndex d;
  d.storage = i32_on_device(be, packed);
  TensorView* views[] = {&d.new_locs, &d.kv_locs, &d.kv_start, &d.ctx_len, &d.cu_q, &d.cu_kv};
  int64_t offset = 0;
  for (size_t i = 0; i < std::size(parts); ++i) {
    const auto n = int64_t(parts[i]->size());
    *views[i] = slice_rows(d.storage, offset, offset + n);
    offset += n;
  }
  return d;
}

void dense_path(Backend& be, const ModelConfig& c, double sm_scale, const PagedKvPool& pool,
                const TensorView& kv_locs, const TensorView& q_nope, const TensorView& q_pe,
                const TensorView& kv_b_proj, const std::vector<int32_t>& cu_q,
                const std::vector<int32_t>& cu_kv, const TensorView& d_cu_q,
                const TensorView& d_cu_kv, const std::vector<int32_t>* kv_visible,
                const TensorView& o, const TensorView& lse, const StageFn& stage) {
  const DType mid = be.capabilities().intermediate_dtype;
  const int64_t n = kv_locs.shape[0], h = c.num_heads;
  Tensor c_all = be.empty(mid, {n, c.kv_lora_rank});
  Tensor kpe_all = be.empty(mid, {n, c.qk_rope_head_dim});
  stage("gather", [&] { be.gather_kv(pool, kv_locs, c_all, kpe_all); });
  Tensor k_nope = be.empty(mid, {n, h, c.qk_nope_head_dim});
  Tensor v = be.empty(mid, {n, h, c.v_head_dim});
  stage("up_proj_kv", [&] { be.up_proj_kv(c_all, kv_b_proj, k_nope, v); });
  Tensor uploaded_cu_q, uploaded_cu_kv;
  if (d_cu_q.ndim == 0) uploaded_cu_q = i32_on_device(be, cu_q);
  if (d_cu_kv.ndim == 0) uploaded_cu_kv = i32_on_device(be, cu_kv);
  Tensor d_visible;
  DenseMhaArgs a;
  a.q_nope = q_nope;
  a.q_pe = q_pe;
  a.k_nope = k_nope;
  a.k_pe = kpe_all;
  a.v = v;
  a.cu_q = d_cu_q.ndim ? d_cu_q : uploaded_cu_q.view();
  a.cu_kv = d_cu_kv.ndim ? d_cu_kv : uploaded_cu_kv.view();
  a.cu_q_host = cu_q.data();
  a.cu_kv_host = cu_kv.data();
  if (kv_visible) {
    d_visible = i32_on_device(be, *kv_visible);
    a.kv_visible = d_visible;
    a.kv_visible_host = kv_visible->data();
  }
  a.num_requests = int(cu_q.size()) - 1;
  a.sm_scale = sm_scale;
  a.o = o;
  a.lse = lse;
  stage("dense_mha", [&] { be.dense_mha(a); });
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
