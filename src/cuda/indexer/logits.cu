// indexer_logits (docs/design.md#lightning-indexer):
//   logits[t, p] = s_k[loc] · Σ_h gate[t,h] · ReLU(q8[t,h,:] · k8[loc,:]),  loc =
//   kv_locs[kv_start[t] + p]
//
// Design (correctness first; fp32 CUDA cores, not FP8 tensor cores):
//   grid  (rows, ceil(width / kTile)); block kTile = 128 threads; one thread per position.
//   smem  q    f32 [h_pad, d_i]       the token's dequantized e4m3 query codes (h_pad = h_i
//                                     rounded up to kHeadChunk; padded heads are 0 with gate 0)
//         keys f32 [kTile, d_i + 4]   the tile's dequantized key codes; +4 floats of row
//                                     padding keeps each quarter-warp's 16-byte reads conflict-free
//         gate f32 [h_pad], key scale f32 [kTile], location i32 [kTile] (-1: invalid)
//   Each thread keeps its key row in smem and kHeadChunk head accumulators in registers; the
//   query is read as a shared-memory broadcast. The head sum runs in a fixed order: same bits
//   every run. e4m3 × e4m3 products are exact in fp32; only the sums round.
// A position whose location is out of range (never after validation) scores -inf.
#include <cmath>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kTile = 128;  // positions per block == threads per block
constexpr int kHeadChunk = 16;

__host__ __device__ inline int padded_heads(int h_i) {
  return (h_i + kHeadChunk - 1) / kHeadChunk * kHeadChunk;
}

// Four e4m3 codes (any alignment) as floats.
__device__ __forceinline__ float4 load_e4m3x4(const uint8_t* p) {
  uint32_t u;
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) {
    u = *reinterpret_cast<const uint32_t*>(p);
  } else {
    u = uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
  }
  return make_float4(e4m3_to_f32(uint8_t(u)), e4m3_to_f32(uint8_t(u >> 8)),
                     e4m3_to_f32(uint8_t(u >> 16)), e4m3_to_f32(uint8_t(u >> 24)));
}

__global__ void __launch_bounds__(kTile) indexer_logits_kernel(const IndexerLogitsParams p) {
  const int64_t out_row = blockIdx.x;
  const int64_t t = p.row_begin + out_row;
  const int64_t ctx = min(max(int64_t(p.ctx_len[t]), int64_t(0)), p.width);
  if (ctx <= p.skip_ctx_at_most) return;
  const int64_t tile_begin = int64_t(blockIdx.y) * kTile;
  const int64_t pos = tile_begin + threadIdx.x;
  float* out = p.logits + out_row * p.width;
  if (tile_begin >= ctx) {  // nothing visible in this tile
    if (p.fill_masked && pos < p.width) out[pos] = -INFINITY;
    return;
  }

  const int d_i = p.d_i, h_pad = padded_heads(p.h_i), key_stride = d_i + 4;
  extern __shared__ float4 smem_f4[];
  float* q_s = reinterpret_cast<float*>(smem_f4);                    // [h_pad, d_i]
  float* keys_s = q_s + h_pad * d_i;                                 // [kTile, key_stride]
  float* gate_s = keys_s + kTile * key_stride;                       // [h_pad]
  float* key_scale_s = gate_s + h_pad;                               // [kTile]
  int32_t* loc_s = reinterpret_cast<int32_t*>(key_scale_s + kTile);  // [kTile]

  const int64_t page_bytes = int64_t(p.page_size) * (d_i + 4);
  {  // this thread's position -> pool location (bound-checked), and its key scale
    int32_t loc = -1;
    if (pos < ctx) {
      const int64_t j = int64_t(p.kv_start[t]) + pos;
      if (j >= 0 && j < p.n_kv) loc = p.kv_locs[j];
      if (loc >= p.num_locations) loc = -1;
    }
    loc_s[threadIdx.x] = loc < 0 ? -1 : loc;
    key_scale_s[threadIdx.x] = loc < 0
                                   ? 0.0f
                                   : load_f32(p.key_pages + (loc / p.page_size) * page_bytes +
                                              int64_t(p.page_size) * d_i + 4 * (loc % p.page_size));
  }
  const int groups = d_i / 4;  // 4-byte groups per vector
  for (int i = threadIdx.x; i < h_pad * groups; i += kTile) {
    const int h = i / groups, g = i % groups;
    const float4 v = h < p.h_i ? load_e4m3x4(p.q8 + (t * p.h_i + h) * d_i + 4 * g)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
    reinterpret_cast<float4*>(q_s + h * d_i)[g] = v;
  }
  for (int h = threadIdx.x; h < h_pad; h += kTile)
    gate_s[h] = h < p.h_i ? p.gate[t * p.h_i + h] : 0.f;
  __syncthreads();  // loc_s complete
  for (int i = threadIdx.x; i < kTile * groups; i += kTile) {
    const int r = i / groups, g = i % groups;
    const int32_t loc = loc_s[r];
    const float4 v = loc < 0 ? make_float4(0.f, 0.f, 0.f, 0.f)
                             : load_e4m3x4(p.key_pages + (loc / p.page_size) * page_bytes +
                                           int64_t(loc % p.page_size) * d_i + 4 * g);
    reinterpret_cast<float4*>(keys_s + r * key_stride)[g] = v;
  }
  __syncthreads();
  if (pos >= p.width) return;
  if (pos >= ctx || loc_s[threadIdx.x] < 0) {
    if (pos < ctx || p.fill_masked) out[pos] = -INFINITY;
    return;
  }

  const float4* key = reinterpret_cast<const float4*>(keys_s + threadIdx.x * key_stride);
  float score = 0.0f;
  for (int h0 = 0; h0 < h_pad; h0 += kHeadChunk) {
    float acc[kHeadChunk];
#pragma unroll
    for (int j = 0; j < kHeadChunk; ++j) acc[j] = 0.0f;
    for (int g = 0; g < groups; ++g) {
      const float4 k4 = key[g];
#pragma unroll
      for (int j = 0; j < kHeadChunk; ++j) {
        const float4 q4 = reinterpret_cast<const float4*>(q_s + (h0 + j) * d_i)[g];
        acc[j] = fmaf(q4.x, k4.x, acc[j]);
        acc[j] = fmaf(q4.y, k4.y, acc[j]);
        acc[j] = fmaf(q4.z, k4.z, acc[j]);
        acc[j] = fmaf(q4.w, k4.w, acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kHeadChunk; ++j) {
      const float relu = acc[j] < 0.0f ? 0.0f : acc[j];  // NaN propagates
      score = fmaf(gate_s[h0 + j], relu, score);
    }
  }
  out[pos] = score * key_scale_s[threadIdx.x];
}

}  // namespace

size_t indexer_logits_smem_bytes(int h_i, int d_i) {
  const size_t h_pad = size_t(padded_heads(h_i));
  return sizeof(float) * (h_pad * d_i + size_t(kTile) * (d_i + 4) + h_pad + kTile) +
         sizeof(int32_t) * kTile;
}

cudaError_t launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream) {
  const int64_t rows = p.row_end - p.row_begin;
  if (rows <= 0 || p.width <= 0) return cudaSuccess;
  const int64_t tiles = ceil_div(p.width, kTile);
  if (rows > INT32_MAX || tiles > 65535 || p.d_i % 4 != 0 || p.h_i < 1 || p.page_size < 1)
    return cudaErrorInvalidValue;
  const size_t smem = indexer_logits_smem_bytes(p.h_i, p.d_i);
  int device = 0, smem_optin = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess)
    status = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (status != cudaSuccess) return status;
  if (smem > size_t(smem_optin)) return cudaErrorInvalidConfiguration;
  status = cudaFuncSetAttribute(indexer_logits_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(smem));
  if (status != cudaSuccess) return status;
  indexer_logits_kernel<<<dim3(unsigned(rows), unsigned(tiles)), kTile, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
