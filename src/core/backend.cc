// Backend methods shared by every device (pool construction, copies to and from the host,
// wall-time timing, kv_halves) and the planner's view of the CUDA backend, cuda_capabilities().
// The run-time backend choice, make_backend(), is in src/layer/backend_select.cc.
#include "dsakit/backend.h"

#include <chrono>

#include "dsakit/error.h"
#include "src/core/validate.h"
#include "src/cuda/attention/dispatch.h"  // the instance table: plain C++, no CUDA

namespace dsakit {

PagedKvPool Backend::make_kv_pool(const KvPoolDesc& desc) {
  desc.validate();
  Tensor storage = empty(DType::kU8, {desc.num_locations(), desc.bytes_per_token()});
  fill_bytes(storage.view(), 0);
  return PagedKvPool(desc, std::move(storage));
}

IndexKeyPool Backend::make_index_pool(const IndexKeyPoolDesc& desc) {
  desc.validate();
  Tensor storage = empty(DType::kU8, {desc.num_pages, desc.page_bytes()});
  fill_bytes(storage.view(), 0);
  return IndexKeyPool(desc, std::move(storage));
}

static std::vector<int64_t> shape_of(const TensorView& t) {
  return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim);
}

Capabilities cuda_capabilities(int sm_arch) {
  Capabilities c;
  c.device = Device::kCuda;
  c.device_name = "cuda sm_" + std::to_string(sm_arch);
  c.sm_arch = sm_arch;
  c.dense_mha = sm_arch == 90 || sm_arch == 100;  // docs/dispatch.md, rule 3
  c.dense_kv_visible = false;
  // The wgmma kernel takes kv_mask (its head dims only: dense_mha names them when refusing).
  c.dense_kv_mask = sm_arch == 90;
  c.kv_halves = true;
  c.fp8_up_proj = sm_arch == 90;  // cuBLASLt's block-scaled FP8 GEMM: Hopper only
  c.intermediate_dtype = DType::kBF16;
  c.sparse_prefers_bf16_rows = sm_arch == 90;  // the wgmma kernels (docs/layer.md#staged-rows)
  c.sparse_reads_fp8_raw_heads = sm_arch == 90 ? cuda::attention::kSparseMlaSm90FewHeadsFp8 : 0;
  // Every figure below comes from the one table of compiled instances.
#define DSAKIT_X(kNope, kRope, kV) c.dense_head_dims.push_back({kNope, kRope, kV});
  DSAKIT_DENSE_MHA_SM80_INSTANCES(DSAKIT_X)
#undef DSAKIT_X
  c.kernel_instances = {
      "sparse MLA (d_qk 576, d_v 512), wgmma: " + cuda::attention::sparse_mla_sm90_supported(),
      "sparse MLA (d_qk 576, d_v 512), mma.sync: " + cuda::attention::sparse_mla_sm80_supported(),
      "dense MHA (d_nope, d_rope, d_v), wgmma: " + cuda::attention::dense_mha_sm90_supported(),
      "dense MHA (d_nope, d_rope, d_v), mma.sync: " + cuda::attention::dense_mha_sm80_supported(),
      "indexer logits (H_i), wgmma: " + cuda::attention::indexer_logits_sm90_supported()};
  return c;
}

KvHalves kv_halves(const TensorView& kv, int64_t d_nope) {
  DSAKIT_CHECK_ARG(kv.ndim == 3 && kv.is_contiguous() && d_nope >= 1 && d_nope < kv.shape[2],
                   "kv_halves: expected a contiguous [N, H, d_nope + d_v] buffer with 1 <= d_nope "
                   "< its last extent, got shape ",
                   kv.shape_str(), " and d_nope ", d_nope);
  KvHalves h{kv, kv};
  h.k_nope.shape[2] = d_nope;
  h.v.shape[2] = kv.shape[2] - d_nope;
  if (kv.data) h.v.data = static_cast<char*>(kv.data) + d_nope * int64_t(dtype_size(kv.dtype));
  return h;
}

bool are_kv_halves(const TensorView& k_nope, const TensorView& v) {
  if (k_nope.ndim != 3 || v.ndim != 3 || k_nope.dtype != v.dtype || k_nope.device != v.device)
    return false;
  const int64_t dn = k_nope.shape[2], dv = v.shape[2], h = k_nope.shape[1];
  return k_nope.shape[0] == v.shape[0] && v.shape[1] == h && dn >= 1 && dv >= 1 &&
         k_nope.stride[2] == 1 && v.stride[2] == 1 && k_nope.stride[1] == dn + dv &&
         v.stride[1] == dn + dv && k_nope.stride[0] == h * (dn + dv) &&
         v.stride[0] == h * (dn + dv) && k_nope.data != nullptr &&
         reinterpret_cast<uintptr_t>(v.data) ==
             reinterpret_cast<uintptr_t>(k_nope.data) + uintptr_t(dn) * dtype_size(k_nope.dtype);
}

double Backend::time_ms(const std::function<void()>& fn) {
  synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  synchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

Tensor Backend::to_device(const TensorView& host) {
  Tensor t = empty(host.dtype, shape_of(host));
  copy(t.view(), host);
  return t;
}

Tensor Backend::to_host(const TensorView& src) {
  Tensor t = Tensor::host(src.dtype, shape_of(src));
  copy(t.view(), src);
  return t;
}

Backend::HostIndexValues Backend::host_index_values(const TensorView& t) const {
  HostIndexValues h;
  // Host memory is read in place; a view that is not a contiguous i32 tensor is left to the
  // shape checks to reject.
  if (t.device == Device::kCpu && t.dtype == DType::kI32 && t.is_contiguous())
    h.data = t.ptr<const int32_t>();
  return h;
}

void Backend::store_tokens(PagedKvPool& kv, IndexKeyPool& index, const TensorView& locs,
                           const TensorView& c_kv, const TensorView& k_pe,
                           const TensorView& idx_k) {
  const HostIndexValues host_locs = host_index_values(locs);
  validate::store_kv(kv, locs, c_kv, k_pe, device(), host_locs.data);
  validate::store_index_keys(index, locs, idx_k, device(), host_locs.data);
  store_kv(kv, locs, c_kv, k_pe);
  store_index_keys(index, locs, idx_k);
}

void Backend::up_proj_kv_fp8(const PagedKvPool&, const TensorView&, const Fp8BlockWeights&,
                             const TensorView&, const TensorView&, const TensorView&) {
  DSAKIT_FAIL(kUnsupported, "up_proj_kv_fp8: not implemented by the ", to_string(device()),
              " backend");
}

void Backend::select_rows(const TensorView&, const TensorView&, const TensorView&) {
  DSAKIT_FAIL(kUnsupported, "select_rows: not implemented by the ", to_string(device()),
              " backend");
}

void Backend::merge_topk(const TensorView&, const TensorView&, int, const TensorView&) {
  DSAKIT_FAIL(kUnsupported, "merge_topk: not implemented by the ", to_string(device()), " backend");
}

void Backend::positions_to_locations(const TensorView&, const TensorView&, const TensorView&,
                                     const TensorView&, const TensorView&) {
  DSAKIT_FAIL(kUnsupported, "positions_to_locations: not implemented by the ", to_string(device()),
              " backend");
}

void Backend::topk_to_kv_mask(const TensorView& positions, const TensorView& mask) {
  validate::topk_to_kv_mask(positions, mask, device(), nullptr);
  const Tensor pos = to_host(positions);
  validate::topk_to_kv_mask(positions, mask, device(), pos.ptr<const int32_t>());
  const int64_t t = positions.shape[0], k = positions.shape[1], words = mask.shape[1];
  std::vector<uint32_t> bits(size_t(t * words), 0u);
  for (int64_t i = 0; i < t * k; ++i) {
    const int32_t p = pos.ptr<const int32_t>()[i];
    if (p >= 0) bits[size_t((i / k) * words + p / 32)] |= 1u << (p % 32);
  }
  copy(mask, make_view(bits.data(), DType::kI32, Device::kCpu, {t, words}));
}

}  // namespace dsakit
