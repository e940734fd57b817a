#include "python/src/backends.h"

#include <cstring>
#include <map>

#include "dsakit/error.h"

namespace dsakit::py {

#if defined(DSAKIT_WITH_CUDA)
// python/src/cuda_glue.cc
void cuda_use_stream(Backend& be, uint64_t stream);
bool cuda_capturing(Backend& be);
void cuda_copy_rows(Backend& be, const Rows& dst, const Rows& src);
#endif

BackendSlot& backend_for(const DeviceRef& device) {
  // Leaked on purpose: backends outlive every Python object that may still free into them, and
  // CUDA's own teardown at exit must not race their destructors.
  static std::mutex mu;
  static auto* slots = new std::map<std::pair<int, int>, std::unique_ptr<BackendSlot>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*slots)[{int(device.type), device.index}];
  if (!slot) {
    auto s = std::make_unique<BackendSlot>();
    s->device = device;
    s->backend = device.type == Device::kCpu ? make_cpu_backend() : make_cuda_backend(device.index);
    slot = std::move(s);
  }
  return *slot;
}

Call::Call(BackendSlot& slot, std::optional<uint64_t> stream)
    : be(*slot.backend), lock_(slot.mutex) {
#if defined(DSAKIT_WITH_CUDA)
  if (slot.device.type == Device::kCuda) cuda_use_stream(be, stream.value_or(0));
#else
  (void)stream;
#endif
}

bool capturing(Backend& be) {
#if defined(DSAKIT_WITH_CUDA)
  if (be.device() == Device::kCuda) return cuda_capturing(be);
#endif
  (void)be;
  return false;
}

Rows rows_of(const TensorView& v, const char* name) {
  const int n = v.ndim;
  DSAKIT_CHECK_ARG(n >= 1 && v.stride[size_t(n - 1)] == 1, name,
                   ": expected unit stride in the last dim, got shape ", v.shape_str());
  Rows r;
  r.data = v.data;
  r.device = v.device;
  const int64_t elem = int64_t(dtype_size(v.dtype));
  r.row_bytes = v.shape[size_t(n - 1)] * elem;
  r.rows = 1;
  for (int d = 0; d + 1 < n; ++d) r.rows *= v.shape[size_t(d)];
  r.pitch_bytes = n >= 2 ? v.stride[size_t(n - 2)] * elem : r.row_bytes;
  bool ok = r.pitch_bytes >= r.row_bytes;
  for (int d = 0; d + 2 < n; ++d)
    ok = ok && (v.shape[size_t(d)] == 1 ||
                v.stride[size_t(d)] == v.shape[size_t(d + 1)] * v.stride[size_t(d + 1)]);
  DSAKIT_CHECK_ARG(ok, name, ": expected rows of one pitch (a column range of a contiguous ",
                   "tensor), got shape ", v.shape_str());
  return r;
}

void copy_rows(Backend& be, const Rows& dst, const Rows& src) {
  DSAKIT_CHECK(dst.rows == src.rows && dst.row_bytes == src.row_bytes, kInternal,
               "copy_rows: ", dst.rows, " x ", dst.row_bytes, " B <- ", src.rows, " x ",
               src.row_bytes, " B");
  if (dst.rows == 0 || dst.row_bytes == 0) return;
#if defined(DSAKIT_WITH_CUDA)
  if (dst.device == Device::kCuda || src.device == Device::kCuda)
    return cuda_copy_rows(be, dst, src);
#endif
  (void)be;
  auto* d = static_cast<uint8_t*>(dst.data);
  const auto* s = static_cast<const uint8_t*>(src.data);
  for (int64_t r = 0; r < dst.rows; ++r)
    std::memcpy(d + r * dst.pitch_bytes, s + r * src.pitch_bytes, size_t(dst.row_bytes));
}

}  // namespace dsakit::py
