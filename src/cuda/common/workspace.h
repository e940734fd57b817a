// Device memory of the CUDA backend.
//
// DeviceArena backs Backend::empty(): a caching allocator. A freed tensor's block goes back to a
// free list keyed by its size class and is handed to the next empty() of that class, so a
// steady-state layer call (same shapes every step) does no cudaMalloc. Blocks handed out while
// the backend's stream captures a graph stay with the backend, never recycled: the graph writes
// them on every replay. Blocks are reused in
// stream order: the backend issues all work on one stream, so a block freed on the host after
// its last kernel was enqueued can be reused by a later kernel on that stream.
//
// Workspace is the op-internal scratch buffer (quantized queries, logits chunks, GEMM staging):
// one device buffer that only grows. An op sizes its scratch from tensor shapes only (never from
// device values), so a warmed-up workspace serves the same shapes again without allocating,
// inside CUDA-graph capture too. Growing it while the stream is capturing is an error
// (kResource) rather than a silent cudaMalloc in the graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace dsakit::cuda {

struct MemoryStats {
  int64_t device_mallocs = 0;     // cudaMalloc calls so far (arena + workspace)
  size_t arena_bytes = 0;         // bytes held by the arena (in use + cached)
  size_t arena_cached_bytes = 0;  // of which free for reuse
  size_t workspace_bytes = 0;     // capacity of the scratch workspace
};

class DeviceArena : public std::enable_shared_from_this<DeviceArena> {
 public:
  explicit DeviceArena(int device) : device_(device) {}
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A block of at least `bytes` (256-byte aligned); freeing the returned pointer's last owner
  // puts the block back in the cache. Zero bytes still yields a distinct valid block.
  std::shared_ptr<void> allocate(size_t bytes);
  void add_stats(MemoryStats& stats) const;

  // Blocks are grouped by size class: multiples of 512 B up to 1 MiB, of 2 MiB above.
  static size_t size_class(size_t bytes);

 private:
  void recycle(void* block, size_t bytes);

  int device_;
  mutable std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_blocks_;  // size class -> blocks
  int64_t mallocs_ = 0;
  size_t held_bytes_ = 0;
  size_t cached_bytes_ = 0;
};

class Workspace {
 public:
  Workspace() = default;
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // A buffer of at least `bytes`, valid until the next ensure(). Growing synchronizes `stream`
  // (pending kernels may still read the old buffer) and throws kResource while it is capturing.
  void* ensure(size_t bytes, cudaStream_t stream);
  void add_stats(MemoryStats& stats) const;

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
  int64_t mallocs_ = 0;
};

// Carves one workspace buffer into 256-byte aligned slices. Run an op's layout once on a null
// base to size it, then again on the buffer Workspace::ensure() returned.
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* take(int64_t count) {
    char* p = base_ ? base_ + offset_ : nullptr;
    offset_ += (size_t(count) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
    return reinterpret_cast<T*>(p);
  }
  size_t bytes() const { return offset_; }

 private:
  static constexpr size_t kAlign = 256;
  char* base_;
  size_t offset_ = 0;
};

// Host -> device copies without a stream synchronization: the host bytes are first copied into
// page-locked staging memory (so the caller may reuse or free its buffer as soon as stage()
// returns), then a DMA from there is queued on the stream. Slots form a ring; a slot is reused
// only after the event recorded behind its DMA has completed (waiting for it when the host runs
// a whole ring ahead of the GPU). A pageable-memory cudaMemcpyAsync instead returns only after
// the stream drained, so every layer call's index upload stalled the host behind the GPU.
class PinnedStaging {
 public:
  PinnedStaging() = default;
  ~PinnedStaging();
  PinnedStaging(const PinnedStaging&) = delete;
  PinnedStaging& operator=(const PinnedStaging&) = delete;

  static constexpr size_t kMaxBytes = size_t(8) << 20;  // larger copies go the pageable way

  // Copies bytes [src, src + bytes) to device `dst` in stream order. bytes <= kMaxBytes.
  void copy_to_device(void* dst, const void* src, size_t bytes, cudaStream_t stream);

 private:
  struct Slot {
    void* host = nullptr;
    size_t capacity = 0;
    cudaEvent_t done = nullptr;  // recorded after the slot's last DMA
  };
  static constexpr int kSlots = 8;
  std::mutex mutex_;
  Slot slots_[kSlots];
  int next_ = 0;
};

// True while `stream` is being captured into a CUDA graph (no host sync, no cudaMalloc then).
bool stream_is_capturing(cudaStream_t stream);

}  // namespace dsakit::cuda
