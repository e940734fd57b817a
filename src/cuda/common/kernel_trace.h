// Kernel event traces, for a diagnostic build only (CMake -DDSAKIT_KERNEL_TRACE=ON): a traced
// kernel stamps %globaltimer (ns) at the events it names into
//   trace[blockIdx.x * kTraceSlots + slot],
// and its launcher appends each call's stamps to the file that DSAKIT_KERNEL_TRACE_FILE names
// (at most DSAKIT_KERNEL_TRACE_CALLS calls, default 64; tools/trace_report.py reads it). In any
// other build trace_stamp compiles to nothing and trace_begin returns null.
//
// File record (little-endian): int64 header[8] = {kernel tag, ctas, then six of the kernel's own
// values}, then ctas * kTraceSlots uint64 stamps (0: the event did not happen).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda {

inline constexpr int kTraceSlots = 256;

#ifdef __CUDACC__
__device__ __forceinline__ void trace_stamp(uint64_t* trace, int slot) {
#ifdef DSAKIT_KERNEL_TRACE
  if (trace != nullptr && slot >= 0 && slot < kTraceSlots) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    trace[uint64_t(blockIdx.x) * kTraceSlots + slot] = t;
  }
#else
  (void)trace;
  (void)slot;
#endif
}
#endif

// A zeroed device buffer for `ctas` CTAs' stamps when this is a trace build, a file is named and
// fewer calls than the limit were traced; else null (the kernel then stamps nothing).
uint64_t* trace_begin(int ctas, cudaStream_t stream);
// After the traced launch: waits for it, appends {header, stamps} to the file. No-op for null.
void trace_end(uint64_t* trace, const int64_t (&header)[8], cudaStream_t stream);

}  // namespace dsakit::cuda
