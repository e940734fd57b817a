// indexer_logits on FP8 tensor cores (docs/design.md#lightning-indexer), the same contract as
// logits.cu:
//   logits[t, p] = s_k[loc] · Σ_h gate[t,h] · ReLU(q8[t,h,:] · k8[loc,:]),  loc =
//   kv_locs[kv_start[t] + p]
// for d_i = 128 (kDim). S[h, n] = q8[t] · k8^T is mma.sync m16n8k32 e4m3 x e4m3 on the raw
// codes; ReLU, the gate-weighted head sum and the key scale follow in registers.
//
// Tiling. A CTA owns kTokens consecutive rows x kKeys consecutive positions; its 4 warps split
// the positions, 32 each (4 n-tiles of 8). Per token:
//   M = heads (h_pad = H_i rounded up to 16; padded rows are zero codes with gate 0),
//   N = the warp's 32 positions, K = d_i = 128 = 4 k-steps of 32.
// A warp keeps its keys' B fragments in registers (4 n-tiles x 4 k-steps x 2 = 32 registers)
// for all kTokens tokens and streams each token's query A fragments from shared memory, one
// m-tile (16 heads) at a time: per m-tile 16 ldmatrix.x4-equivalent A loads feed 16 MMAs.
//
// Shared memory (dynamic, 128-byte aligned):
//   q      u8  [kTokens][h_pad][128]  query codes, SwizzledTile<8> per token (16-byte chunks,
//                                     chunk c of row r at r*8 + (c ^ (r & 7)))
//   keys   u8  [kKeys][128]           key codes of the tile's positions, SwizzledTile<8>
//   gate   f32 [kTokens][h_pad]
//   scale  f32 [kKeys]                key scale s_k (0 for an invalid location)
//   loc    i32 [kKeys]                pool location (-1: none or out of range)
//
// Fragment index math (lane = 4g + q, g in [0, 8), q in [0, 4); warp_mma.cuh): for m-tile mt,
// k-step ks the A fragment is heads 16mt + {g, g+8} x code bytes 32ks + {4q..4q+3,
// 16+4q..16+4q+3}; the B fragment of n-tile j is position 32w + 8j + g x the same code bytes;
// the result d[0..1] is heads 16mt + g at positions 32w + 8j + 2q + {0, 1}, d[2..3] heads
// 16mt + g + 8 at the same positions.
//
// Head sum: each lane folds ReLU(d) · gate of its two heads per m-tile into 8 partial scores
// (its 8 positions), then a 3-step reduce-scatter over g (xor 16, 8, 4) leaves lane (g, q) with
// the full sum for position 32w + 8(g >> 1) + 2q + (g & 1): one position per lane, coalesced
// stores. All sums run in a fixed order (same bits every run). Each k-step's MMA starts from a
// zero accumulator and is added in fp32 (warp_mma.cuh), so results differ from the scalar
// kernel only by summation order and the MMA's internal alignment of the 32 products.
//
// Causality: a token whose context ends before a warp's positions skips that warp's MMAs. Rows
// of one CTA normally share kv_start (one request); when it changes the key tile is re-staged.
#include <cmath>

#include "src/cuda/common/device_utils.cuh"
#include "src/cuda/common/warp_mma.cuh"
#include "src/cuda/indexer/indexer_kernels.h"

namespace dsakit::cuda {
namespace {

constexpr int kDim = 128;           // d_i: code bytes per vector
constexpr int kChunks = kDim / 16;  // 16-byte chunks per vector
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * kWarpSize;
constexpr int kKeysPerWarp = 32;
constexpr int kKeys = kWarps * kKeysPerWarp;  // positions per CTA
constexpr int kNTiles = kKeysPerWarp / 8;     // n-tiles of 8 positions per warp
constexpr int kKSteps = kDim / 32;            // k-steps of 32 codes
constexpr int kTokens = 8;                    // rows per CTA
constexpr int kMTile = 16;

using Tile = SwizzledTile<kChunks>;
static_assert(Tile::kRowBytes == kDim);

__host__ __device__ inline int padded_heads_tc(int h_i) {
  return (h_i + kMTile - 1) / kMTile * kMTile;
}

// Byte offsets of the shared-memory regions (all multiples of 128).
struct SmemLayout {
  int q, keys, gate, scale, loc, total;
  __host__ __device__ explicit SmemLayout(int h_pad) {
    q = 0;
    keys = q + kTokens * h_pad * kDim;
    gate = keys + kKeys * kDim;
    scale = gate + kTokens * h_pad * 4;
    loc = scale + kKeys * 4;
    total = loc + kKeys * 4;
  }
};

// Copies one 16-byte chunk global -> shared, or zero-fills it when !valid. cp.async needs a
// 16-byte aligned source; pool rows of an odd page size are only 4-byte aligned (pages of
// page_size * 132 bytes), and those take four 4-byte loads instead.
// src must be a mapped address even when !valid (callers pass a base pointer then).
__device__ __forceinline__ void stage_chunk(uint8_t* smem_base, uint32_t offset, const uint8_t* src,
                                            bool valid) {
  if (!valid || (reinterpret_cast<uintptr_t>(src) & 15u) == 0) {
    cp_async_16(smem_addr(smem_base + offset), src, valid);
    return;
  }
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  *reinterpret_cast<uint4*>(smem_base + offset) = make_uint4(s[0], s[1], s[2], s[3]);
}

// The CTA's rows as read once from kv_start / ctx_len (shared memory, block-uniform).
struct RowPlan {
  int64_t start[kTokens];  // kv_start of the row's request
  int64_t ctx[kTokens];    // visible positions, clamped to [0, width]; -1: row not computed
                           // (identity shortcut, or past the batch)
  __device__ bool computed(int r) const { return ctx[r] >= 0; }
};

// Stages the key codes, scales and locations of positions [tile_begin, tile_begin + kKeys) of a
// request starting at kv_start; positions at or beyond `limit` are staged as invalid.
__device__ void stage_keys(const IndexerLogitsParams& p, uint8_t* smem, const SmemLayout& L,
                           int64_t tile_begin, int64_t kv_start, int64_t limit) {
  int32_t* loc_s = reinterpret_cast<int32_t*>(smem + L.loc);
  float* scale_s = reinterpret_cast<float*>(smem + L.scale);
  const int64_t page_bytes = int64_t(p.page_size) * (kDim + 4);
  for (int i = threadIdx.x; i < kKeys; i += kThreads) {
    const int64_t pos = tile_begin + i, j = kv_start + pos;
    int32_t loc = -1;
    if (pos < limit && j >= 0 && j < p.n_kv) loc = p.kv_locs[j];
    if (loc >= p.num_locations) loc = -1;
    loc = loc < 0 ? -1 : loc;
    loc_s[i] = loc;
    scale_s[i] = loc < 0 ? 0.f
                         : load_f32(p.key_pages + (loc / p.page_size) * page_bytes +
                                    int64_t(p.page_size) * kDim + 4 * (loc % p.page_size));
  }
  __syncthreads();  // loc_s complete
  for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const int32_t loc = loc_s[row];
    const uint8_t* src = loc < 0 ? p.key_pages
                                 : p.key_pages + (loc / p.page_size) * page_bytes +
                                       int64_t(loc % p.page_size) * kDim + 16 * chunk;
    stage_chunk(smem, L.keys + Tile::offset(row, chunk), src, loc >= 0);
  }
}

// Writes one position's score (the lane's position `pos` of row out_row): the value where the
// position is visible and its location valid, else -inf where the contract asks for it.
__device__ __forceinline__ void store_score(const IndexerLogitsParams& p, int64_t out_row,
                                            int64_t pos, int64_t ctx, bool valid, float score) {
  if (pos >= p.width) return;
  float* out = p.logits + out_row * p.width + pos;
  if (pos < ctx && valid) {
    *out = score;
  } else if (pos < ctx || p.fill_masked) {
    *out = -INFINITY;
  }
}

__global__ void __launch_bounds__(kThreads, 2)
    indexer_logits_tc_kernel(const IndexerLogitsParams p) {
  const int64_t row0 = int64_t(blockIdx.x) * kTokens;
  const int64_t tile_begin = int64_t(blockIdx.y) * kKeys;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int g = lane / 4, q = lane % 4;

  __shared__ RowPlan rows;
  if (threadIdx.x < kTokens) {
    const int r = threadIdx.x;
    const int64_t out_row = row0 + r, t = p.row_begin + out_row;
    const bool in_batch = out_row < p.row_end - p.row_begin;
    const int64_t ctx = in_batch ? min(max(int64_t(p.ctx_len[t]), int64_t(0)), p.width) : -1;
    rows.ctx[r] = ctx > p.skip_ctx_at_most ? ctx : -1;
    rows.start[r] = in_batch ? int64_t(p.kv_start[t]) : 0;
  }
  __syncthreads();
  bool any_visible = false;
  for (int r = 0; r < kTokens; ++r) any_visible |= rows.ctx[r] > tile_begin;
  if (!any_visible) {  // the tile is past every row's context: only the -inf fill remains
    if (!p.fill_masked) return;
    for (int r = 0; r < kTokens; ++r) {
      if (!rows.computed(r)) continue;
      for (int i = threadIdx.x; i < kKeys; i += kThreads)
        store_score(p, row0 + r, tile_begin + i, rows.ctx[r], false, 0.f);
    }
    return;
  }

  const int h_pad = padded_heads_tc(p.h_i), m_tiles = h_pad / kMTile;
  const SmemLayout L(h_pad);
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_base = smem_addr(smem + L.q), keys_base = smem_addr(smem + L.keys);
  float* gate_s = reinterpret_cast<float*>(smem + L.gate);
  const float* scale_s = reinterpret_cast<const float*>(smem + L.scale);
  const int32_t* loc_s = reinterpret_cast<const int32_t*>(smem + L.loc);

  // Query codes and gates of every computed row (zero rows elsewhere: padded heads, skipped rows).
  for (int i = threadIdx.x; i < kTokens * h_pad * kChunks; i += kThreads) {
    const int r = i / (h_pad * kChunks), h = (i / kChunks) % h_pad, chunk = i % kChunks;
    const bool valid = rows.computed(r) && h < p.h_i;
    const uint8_t* src =
        valid ? p.q8 + ((p.row_begin + row0 + r) * p.h_i + h) * kDim + 16 * chunk : p.q8;
    stage_chunk(smem, L.q + r * h_pad * kDim + Tile::offset(h, chunk), src, valid);
  }
  for (int i = threadIdx.x; i < kTokens * h_pad; i += kThreads) {
    const int r = i / h_pad, h = i % h_pad;
    gate_s[i] = rows.computed(r) && h < p.h_i ? p.gate[(p.row_begin + row0 + r) * p.h_i + h] : 0.f;
  }

  uint32_t b[kNTiles][kKSteps][2];  // this warp's key fragments
  int64_t staged_start = -1;
  bool staged = false;
  const int warp_key0 = warp * kKeysPerWarp;

  for (int r = 0; r < kTokens; ++r) {
    if (!rows.computed(r)) continue;
    const int64_t start = rows.start[r], ctx = rows.ctx[r];
    if (!staged || start != staged_start) {
      // Stage the tile for this request: positions up to the farthest context among the CTA's
      // remaining rows of the same request.
      int64_t limit = 0;
      for (int s = r; s < kTokens; ++s)
        if (rows.start[s] == start) limit = max(limit, rows.ctx[s]);
      __syncthreads();  // every warp is done with the previous tile
      stage_keys(p, smem, L, tile_begin, start, limit);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();  // keys (and, the first time, queries and gates) visible to all warps
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks)
#pragma unroll
        for (int jp = 0; jp < kNTiles / 2; ++jp) {
          uint32_t x[4];
          load_bt_frag_x2n<kChunks>(x, keys_base, warp_key0 + 16 * jp, 2 * ks, lane);
          b[2 * jp][ks][0] = x[0];
          b[2 * jp][ks][1] = x[1];
          b[2 * jp + 1][ks][0] = x[2];
          b[2 * jp + 1][ks][1] = x[3];
        }
      staged_start = start;
      staged = true;
    }

    const int64_t out_row = row0 + r;
    // The position this lane stores after the reduce-scatter below.
    const int key = warp_key0 + 8 * (g >> 1) + 2 * q + (g & 1);
    if (tile_begin + warp_key0 >= ctx) {  // warp-uniform: none of its positions visible
      store_score(p, out_row, tile_begin + key, ctx, false, 0.f);
      continue;
    }

    float part[2 * kNTiles];  // part[2j + c]: position warp_key0 + 8j + 2q + c, heads g, g+8
#pragma unroll
    for (int i = 0; i < 2 * kNTiles; ++i) part[i] = 0.f;
    const uint32_t q_tile = q_base + uint32_t(r * h_pad * kDim);
    for (int mt = 0; mt < m_tiles; ++mt) {
      float acc[kNTiles][4];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t a[4];
        load_a_frag<kChunks>(a, q_tile, kMTile * mt, 2 * ks, lane);
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
          float d[4];
          mma_e4m3_16832(d, a, b[j][ks][0], b[j][ks][1]);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] += d[e];
        }
      }
      const float* gate_row = gate_s + r * h_pad + kMTile * mt;
      const float gate_lo = gate_row[g], gate_hi = gate_row[g + 8];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float lo = acc[j][c] < 0.f ? 0.f : acc[j][c];  // ReLU; NaN propagates
          const float hi = acc[j][2 + c] < 0.f ? 0.f : acc[j][2 + c];
          part[2 * j + c] = fmaf(gate_hi, hi, fmaf(gate_lo, lo, part[2 * j + c]));
        }
    }

    // Reduce-scatter over g: at lane bit `mask` (16, 8, 4 = g bits 2, 1, 0) a lane keeps the
    // half of its partials selected by that bit and adds its partner's copy of that half.
    // Afterwards part[0] is the sum over all heads for partial index i = g, i.e. position
    // warp_key0 + 8 (g >> 1) + 2q + (g & 1) = key.
#pragma unroll
    for (int half = kNTiles; half >= 1; half /= 2) {
      const bool upper = lane & (4 * half);
#pragma unroll
      for (int i = 0; i < half; ++i) {
        const float send = upper ? part[i] : part[i + half];
        const float keep = upper ? part[i + half] : part[i];
        part[i] = keep + __shfl_xor_sync(0xFFFFFFFFu, send, 4 * half);
      }
    }
    store_score(p, out_row, tile_begin + key, ctx, loc_s[key] >= 0, part[0] * scale_s[key]);
  }
}

}  // namespace

size_t indexer_logits_tc_smem_bytes(int h_i) {
  return size_t(SmemLayout(padded_heads_tc(h_i)).total);
}

bool indexer_logits_tc_supported(int h_i, int d_i, size_t smem_optin) {
  return d_i == kDim && h_i >= 1 && indexer_logits_tc_smem_bytes(h_i) <= smem_optin;
}

cudaError_t launch_indexer_logits_tc(const IndexerLogitsParams& p, cudaStream_t stream) {
  const int64_t rows = p.row_end - p.row_begin;
  if (rows <= 0 || p.width <= 0) return cudaSuccess;
  const int64_t row_blocks = ceil_div(rows, kTokens), tiles = ceil_div(p.width, kKeys);
  if (row_blocks > INT32_MAX || tiles > 65535 || p.h_i < 1 || p.page_size < 1)
    return cudaErrorInvalidValue;
  int device = 0, smem_optin = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess)
    status = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (status != cudaSuccess) return status;
  if (!indexer_logits_tc_supported(p.h_i, p.d_i, size_t(smem_optin)))
    return cudaErrorInvalidConfiguration;
  const size_t smem = indexer_logits_tc_smem_bytes(p.h_i);
  status = cudaFuncSetAttribute(indexer_logits_tc_kernel,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (status != cudaSuccess) return status;
  indexer_logits_tc_kernel<<<dim3(unsigned(row_blocks), unsigned(tiles)), kThreads, smem, stream>>>(
      p);
  return cudaGetLastError();
}

}  // namespace dsakit::cuda
