// Backend methods shared by every device, and the run-time backend choice.
#include "dsakit/backend.h"

#include <chrono>

#include "dsakit/error.h"

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
  c.dense_mha = sm_arch == 90 || sm_arch == 100;  // DESIGN.md §5 rule 3
  c.dense_kv_visible = false;
  c.kv_halves = true;
  c.intermediate_dtype = DType::kBF16;
  // The compiled dense instances: src/cuda/sm90/prefill/dense_mha/instantiations/*.cu, dispatched
  // by dispatch_dense_dims (src/cuda/attention/dispatch.h); keep the two lists equal
  // (tests/cuda/test_cuda_attention.cc runs both shapes).
  c.dense_head_dims = {{128, 64, 128}, {192, 64, 128}, {192, 64, 256}};
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

}  // namespace dsakit

namespace dsakit {

void Backend::positions_to_locations(const TensorView&, const TensorView&, const TensorView&,
                                     const TensorView&, const TensorView&) {
  DSAKIT_FAIL(kUnsupported, "positions_to_locations: not implemented by the ", to_string(device()),
              " backend");
}

}  // namespace dsakit
