#include "src/layer/paths.h"

namespace dsakit::detail {

namespace {

Tensor i32_on_device(Backend& be, const std::vector<int32_t>& v) {
  return be.to_device(
      make_view(const_cast<int32_t*>(v.data()), DType::kI32, Device::kCpu, {int64_t(v.size())}));
}

}  // namespace

void dense_path(Backend& be, const ModelConfig& c, double sm_scale, const PagedKvPool& pool,
                const TensorView& kv_locs, const TensorView& q_nope, const TensorView& q_pe,
                const TensorView& kv_b_proj, const std::vector<int32_t>& cu_q,
                const std::vector<int32_t>& cu_kv, const std::vector<int32_t>* kv_visible,
                const TensorView& o, const TensorView& lse, const StageFn& stage) {
  const DType mid = be.capabilities().intermediate_dtype;
  const int64_t n = kv_locs.shape[0], h = c.num_heads;
  Tensor c_all = be.empty(mid, {n, c.kv_lora_rank});
  Tensor kpe_all = be.empty(mid, {n, c.qk_rope_head_dim});
  stage("gather", [&] { be.gather_kv(pool, kv_locs, c_all, kpe_all); });
  Tensor k_nope = be.empty(mid, {n, h, c.qk_nope_head_dim});
  Tensor v = be.empty(mid, {n, h, c.v_head_dim});
  stage("up_proj_kv", [&] { be.up_proj_kv(c_all, kv_b_proj, k_nope, v); });
  const Tensor d_cu_q = i32_on_device(be, cu_q), d_cu_kv = i32_on_device(be, cu_kv);
  Tensor d_visible;
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
