#include "src/cuda/common/tma.h"

#include <cudaTypedefs.h>

namespace dsakit::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// A 128-byte-swizzled map of elements of `elem_bytes` bytes (box[0] of them make one 128-byte row).
cudaError_t make_tensor_map_sw128(CUtensorMap* map, CUtensorMapDataType type, uint32_t elem_bytes,
                                  const void* base, int rank, const uint64_t* dims,
                                  const uint64_t* strides_bytes, const uint32_t* box) {
  if (rank < 2 || rank > 5 || box[0] * elem_bytes != 128 ||
      reinterpret_cast<uintptr_t>(base) % 16 != 0)
    return cudaErrorInvalidValue;
  uint32_t element_strides[5];
  for (int i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t(1) << 32) || box[i] == 0 || box[i] > 256)
      return cudaErrorInvalidValue;
    if (i > 0 && (strides_bytes[i - 1] % 16 != 0 || strides_bytes[i - 1] >= (uint64_t(1) << 40)))
      return cudaErrorInvalidValue;
    element_strides[i] = 1;
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const CUresult r =
      encode(map, type, cuuint32_t(rank), const_cast<void*>(base), dims, strides_bytes, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

}  // namespace

cudaError_t make_tensor_map_bf16_sw128(CUtensorMap* map, const void* base, int rank,
                                       const uint64_t* dims, const uint64_t* strides_bytes,
                                       const uint32_t* box) {
  return make_tensor_map_sw128(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rank, dims,
                               strides_bytes, box);
}

cudaError_t make_tensor_map_u8_sw128(CUtensorMap* map, const void* base, int rank,
                                     const uint64_t* dims, const uint64_t* strides_bytes,
                                     const uint32_t* box) {
  return make_tensor_map_sw128(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rank, dims,
                               strides_bytes, box);
}

}  // namespace dsakit::cuda
