#include "src/cuda/common/workspace.h"

#include <algorithm>
#include <cstring>

#include "dsakit/error.h"
#include "src/cuda/common/check.h"

namespace dsakit::cuda {

DeviceArena::~DeviceArena() {
  // Errors are ignored: at process exit the CUDA context may already be gone.
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  for (auto& [size, blocks] : free_blocks_)
    for (void* block : blocks) cudaFree(block);
  cudaSetDevice(previous);
}

size_t DeviceArena::size_class(size_t bytes) {
  constexpr size_t kSmallStep = 512, kLargeStep = size_t(2) << 20, kSmallLimit = size_t(1) << 20;
  if (bytes == 0) return kSmallStep;
  const size_t step = bytes <= kSmallLimit ? kSmallStep : kLargeStep;
  return (bytes + step - 1) / step * step;
}

std::shared_ptr<void> DeviceArena::allocate(size_t bytes) {
  const size_t cls = size_class(bytes);
  void* block = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_blocks_.find(cls);
    if (it != free_blocks_.end() && !it->second.empty()) {
      block = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= cls;
    }
  }
  if (block == nullptr) {
    // cudaMalloc touches no stream, but a stream capture in global or thread-local mode refuses
    // it as a potentially synchronizing call: relax the mode around it (a graph captured after
    // the cache ran dry then still gets memory of its own).
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    const cudaError_t status = cudaMalloc(&block, cls);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it so the next launch check does not report it
      DSAKIT_FAIL(kResource, "cuda device ", device_, ": out of memory allocating ", cls, " bytes");
    }
    DSAKIT_CUDA_CHECK(status);
    std::lock_guard<std::mutex> lock(mutex_);
    ++mallocs_;
    held_bytes_ += cls;
  }
  std::shared_ptr<DeviceArena> self = shared_from_this();
  return std::shared_ptr<void>(block, [self, cls](void* p) { self->recycle(p, cls); });
}

void DeviceArena::recycle(void* block, size_t cls) {
  std::lock_guard<std::mutex> lock(mutex_);
  free_blocks_[cls].push_back(block);
  cached_bytes_ += cls;
}

void DeviceArena::add_stats(MemoryStats& stats) const {
  std::lock_guard<std::mutex> lock(mutex_);
  stats.device_mallocs += mallocs_;
  stats.arena_bytes += held_bytes_;
  stats.arena_cached_bytes += cached_bytes_;
}

Workspace::~Workspace() {
  if (data_) cudaFree(data_);
}

void* Workspace::ensure(size_t bytes, cudaStream_t stream) {
  if (bytes <= capacity_ && data_ != nullptr) return data_;
  DSAKIT_CHECK(!stream_is_capturing(stream), kResource, "cuda workspace: ", bytes,
               " bytes needed but only ", capacity_,
               " reserved while the stream is capturing a CUDA graph; run the same shapes once "
               "before capture");
  // Grow geometrically (x1.5, 2 MiB granularity) so a slowly growing shape settles quickly.
  constexpr size_t kGranule = size_t(2) << 20;
  size_t target = bytes > capacity_ + capacity_ / 2 ? bytes : capacity_ + capacity_ / 2;
  target = (target + kGranule - 1) / kGranule * kGranule;
  DSAKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (data_) DSAKIT_CUDA_CHECK(cudaFree(data_));
  data_ = nullptr;
  capacity_ = 0;
  const cudaError_t status = cudaMalloc(&data_, target);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    data_ = nullptr;
    DSAKIT_FAIL(kResource, "cuda workspace: out of memory allocating ", target, " bytes");
  }
  DSAKIT_CUDA_CHECK(status);
  capacity_ = target;
  ++mallocs_;
  return data_;
}

void Workspace::add_stats(MemoryStats& stats) const {
  stats.device_mallocs += mallocs_;
  stats.workspace_bytes += capacity_;
}

PinnedStaging::~PinnedStaging() {
  // Errors are ignored: at process exit the CUDA context may already be gone.
  for (Slot& slot : slots_) {
    if (slot.done) {
      cudaEventSynchronize(slot.done);
      cudaEventDestroy(slot.done);
    }
    if (slot.host) cudaFreeHost(slot.host);
  }
}

void PinnedStaging::copy_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  Slot& slot = slots_[next_];
  next_ = (next_ + 1) % kSlots;
  if (slot.done == nullptr) {
    DSAKIT_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
  } else {
    DSAKIT_CUDA_CHECK(cudaEventSynchronize(slot.done));  // its previous DMA has finished
  }
  if (slot.capacity < bytes) {
    if (slot.host) DSAKIT_CUDA_CHECK(cudaFreeHost(slot.host));
    slot.host = nullptr;
    slot.capacity = 0;
    const size_t capacity = std::max<size_t>(bytes, size_t(64) << 10);
    DSAKIT_CUDA_CHECK(cudaMallocHost(&slot.host, capacity));
    slot.capacity = capacity;
  }
  std::memcpy(slot.host, src, bytes);
  DSAKIT_CUDA_CHECK(cudaMemcpyAsync(dst, slot.host, bytes, cudaMemcpyHostToDevice, stream));
  DSAKIT_CUDA_CHECK(cudaEventRecord(slot.done, stream));
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  DSAKIT_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace dsakit::cuda
