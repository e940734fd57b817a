// The binding's backends (docs/python.md): one per device for the whole process, each serving
// one call at a time, on the caller's CUDA stream; and the strided row copies some ops need.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "dsakit/backend.h"
#include "python/src/convert.h"

namespace dsakit::py {

struct BackendSlot {
  DeviceRef device;
  std::unique_ptr<Backend> backend;
  std::mutex mutex;  // one call at a time: a backend has one stream and one workspace
};

// The process's backend for `device`, made on first use (throws kUnsupported for cuda in a build
// without CUDA or without that GPU). Backends live until the process exits.
BackendSlot& backend_for(const DeviceRef& device);

// One call on a backend: takes its lock and, on CUDA, points it at the caller's stream (a
// cudaStream_t as an integer; 0 or none: the legacy default stream, as CUDA reads a null
// stream). Changing streams synchronizes the previous one (CudaBackend::set_stream), so memory
// the backend freed under it is safe to reuse. Construct it with the GIL released.
class Call {
 public:
  Call(BackendSlot& slot, std::optional<uint64_t> stream);
  Backend& be;

 private:
  std::unique_lock<std::mutex> lock_;
};

// True while the backend's current stream is capturing a CUDA graph (false on the CPU).
bool capturing(Backend& be);

// Rows of a view whose outer dims collapse into one row pitch and whose last dim is unit-stride
// (a column range of a larger tensor): what copy_rows moves.
struct Rows {
  void* data = nullptr;
  int64_t rows = 0, row_bytes = 0, pitch_bytes = 0;
  Device device = Device::kCpu;
};
Rows rows_of(const TensorView& v, const char* name);
// dst <- src row by row (equal rows and row bytes), on the backend's stream: cudaMemcpy2DAsync
// on CUDA (synchronizing when one side is host memory), memcpy on the CPU.
void copy_rows(Backend& be, const Rows& dst, const Rows& src);

}  // namespace dsakit::py
