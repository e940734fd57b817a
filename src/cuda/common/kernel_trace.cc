#include "src/cuda/common/kernel_trace.h"

#ifdef DSAKIT_KERNEL_TRACE
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <vector>
#endif

namespace dsakit::cuda {

#ifdef DSAKIT_KERNEL_TRACE
namespace {
std::mutex trace_mutex;
int traced_calls = 0;
uint64_t* trace_buffer = nullptr;
int trace_buffer_ctas = 0;
}  // namespace

uint64_t* trace_begin(int ctas, cudaStream_t stream) {
  const char* path = std::getenv("DSAKIT_KERNEL_TRACE_FILE");
  const char* limit = std::getenv("DSAKIT_KERNEL_TRACE_CALLS");
  std::lock_guard<std::mutex> lock(trace_mutex);
  if (path == nullptr || traced_calls >= (limit ? std::atoi(limit) : 64) || ctas < 1)
    return nullptr;
  if (ctas > trace_buffer_ctas) {
    if (trace_buffer) cudaFree(trace_buffer);
    trace_buffer = nullptr;
    if (cudaMalloc(&trace_buffer, size_t(ctas) * kTraceSlots * 8) != cudaSuccess) return nullptr;
    trace_buffer_ctas = ctas;
  }
  if (cudaMemsetAsync(trace_buffer, 0, size_t(ctas) * kTraceSlots * 8, stream) != cudaSuccess)
    return nullptr;
  return trace_buffer;
}

void trace_end(uint64_t* trace, const int64_t (&header)[8], cudaStream_t stream) {
  if (trace == nullptr) return;
  const int64_t ctas = header[1];
  std::vector<uint64_t> stamps(size_t(ctas) * kTraceSlots);
  if (cudaStreamSynchronize(stream) != cudaSuccess ||
      cudaMemcpy(stamps.data(), trace, stamps.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess)
    return;
  std::lock_guard<std::mutex> lock(trace_mutex);
  if (FILE* f = std::fopen(std::getenv("DSAKIT_KERNEL_TRACE_FILE"), "ab")) {
    std::fwrite(header, 8, 8, f);
    std::fwrite(stamps.data(), 8, stamps.size(), f);
    std::fclose(f);
  }
  ++traced_calls;
}
#else
uint64_t* trace_begin(int, cudaStream_t) {
  return nullptr;
}
void trace_end(uint64_t*, const int64_t (&)[8], cudaStream_t) {}
#endif

}  // namespace dsakit::cuda
