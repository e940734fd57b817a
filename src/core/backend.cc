// Backend methods shared by every device, and the run-time backend choice.
#include "dsakit/backend.h"

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

#if !defined(DSAKIT_WITH_CUDA)
bool cuda_backend_compiled() { return false; }
int cuda_device_count() { return 0; }
std::unique_ptr<Backend> make_cuda_backend(int) {
  DSAKIT_FAIL(kUnsupported, "device cuda: this dsakit build has no CUDA backend "
                            "(configure with CUDA available to build it)");
}
#endif

std::unique_ptr<Backend> make_backend(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend(0);
  if (device == "auto") return cuda_device_count() > 0 ? make_cuda_backend(0) : make_cpu_backend();
  DSAKIT_FAIL(kInvalidArgument, "device: expected cpu, cuda or auto, got '", device, "'");
}

}  // namespace dsakit
