// Host side of TMA: tensor maps (CUtensorMap) for the sm90 kernels' tile loads. The driver's
// encoder is reached through the runtime (cudaGetDriverEntryPointByVersion), so nothing links
// libcuda directly.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsakit::cuda {

// A bf16 tensor of `rank` (2..5) dims, dims[0] innermost and contiguous, byte strides of dims
// 1..rank-1 in strides_bytes[0..rank-2], loaded in boxes of box[0..rank-1] elements with the
// 128-byte swizzle (box[0] * 2 must be 128: one swizzled row per box row). Boxes reaching past
// the tensor's extent read zeros there.
// Returns cudaErrorInvalidValue when TMA cannot address the tensor (base not 16-byte aligned,
// a stride not a multiple of 16 bytes, or an extent beyond 2^32), so the caller can use another
// kernel; other failures of the encoder as cudaErrorUnknown.
cudaError_t make_tensor_map_bf16_sw128(CUtensorMap* map, const void* base, int rank,
                                       const uint64_t* dims, const uint64_t* strides_bytes,
                                       const uint32_t* box);

// The same for bytes (e4m3 codes): box[0] must be 128.
cudaError_t make_tensor_map_u8_sw128(CUtensorMap* map, const void* base, int rank,
                                     const uint64_t* dims, const uint64_t* strides_bytes,
                                     const uint32_t* box);

}  // namespace dsakit::cuda
