// Host-side launch helpers shared by the kernel launchers.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace dsakit::cuda {

// Raises `kernel`'s dynamic shared memory limit to `bytes` on the current device, once per
// device: the attribute stays with the function in the device's context, and setting it costs
// a driver call on every launch otherwise. `done` is the launcher's own per-kernel device mask
// (devices 0..63 remembered; others set it every time). Invariant: one kernel, one `bytes`.
inline cudaError_t opt_in_dynamic_smem(const void* kernel, int bytes, std::atomic<uint64_t>& done) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  const cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

}  // namespace dsakit::cuda
