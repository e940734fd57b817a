// CPU pool kernels (docs/formats.md): store_kv quantizes bf16 tokens into latent-pool rows,
// gather_kv dequantizes rows back to bf16 / f32, store_index_keys quantizes indexer keys into
// the index-key pool. Arguments arrive validated (shapes, dtypes, distinct in-range locations).
//
// Every format rule (rounding, saturation, scales) comes from dsakit/formats.h and every byte
// offset from KvRowLayout / IndexKeyPoolDesc; this file only moves values between them.
//
// Non-finite inputs: a tile's amax skips NaN (fmaxf), so a NaN value is stored as the e4m3 NaN
// code and its tile neighbours keep their finite scale. An infinite value makes its tile's scale
// infinite, so that tile reads back as NaN. Either way only the affected token's row changes.
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "src/cpu/kernels.h"

namespace dsakit::cpu {
namespace {

// Rows are stored little-endian; this backend only runs on little-endian hosts.
static_assert(std::endian::native == std::endian::little);

float abs_max(const bf16_t* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(bf16_to_f32(x[i])));
  return amax;
}

void quantize_values(const bf16_t* x, int n, float scale, uint8_t* codes) {
  for (int i = 0; i < n; ++i) codes[i] = quantize_e4m3(bf16_to_f32(x[i]), scale);
}

// Output element of a gather: f32 as computed, bf16 rounded to nearest even.
template <typename Out>
Out to_out(float v) {
  if constexpr (std::is_same_v<Out, float>) {
    return v;
  } else {
    return f32_to_bf16(v);
  }
}

// value = e4m3(code) * scale, the product rounded to fp32 (then to Out).
template <typename Out>
void dequantize_values(const uint8_t* codes, int n, float scale, Out* out) {
  const std::array<float, 256>& value = e4m3_values();
  for (int i = 0; i < n; ++i) out[i] = to_out<Out>(value[codes[i]] * scale);
}

template <typename Out>
void copy_bf16(const bf16_t* in, int n, Out* out) {
  if constexpr (std::is_same_v<Out, bf16_t>) {
    std::memcpy(out, in, size_t(n) * sizeof(bf16_t));
  } else {
    for (int i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
  }
}

// One latent token: c_kv bf16 [d_c], k_pe bf16 [d_rope] -> row [bytes_per_token].
void encode_kv_row(const KvPoolDesc& d, const bf16_t* c_kv, const bf16_t* k_pe, uint8_t* row) {
  const KvRowLayout layout = d.row();
  switch (d.layout) {
    case KvLayout::kBf16:
      std::memcpy(row, c_kv, size_t(d.d_c) * sizeof(bf16_t));
      break;
    case KvLayout::kFp8Scaled:
      for (int tile = 0; tile < d.d_c / kFp8TileSize; ++tile) {
        const bf16_t* x = c_kv + tile * kFp8TileSize;
        const float scale = fp8_tile_scale(abs_max(x, kFp8TileSize), d.scale_policy);
        quantize_values(x, kFp8TileSize, scale, row + tile * kFp8TileSize);
        std::memcpy(row + layout.scales_offset() + 4 * tile, &scale, 4);
      }
      break;
    case KvLayout::kFp8Raw:
      quantize_values(c_kv, d.d_c, d.k_scale, row);
      quantize_values(k_pe, d.d_rope, d.k_scale, row + layout.rope_offset());
      return;
  }
  // bf16 and fp8 keep k_pe as bf16.
  std::memcpy(row + layout.rope_offset(), k_pe, size_t(d.d_rope) * sizeof(bf16_t));
}

// One latent token: row [bytes_per_token] -> c_kv [d_c], k_pe [d_rope] (each bf16 or f32).
template <typename OutC, typename OutR>
void decode_kv_row(const KvPoolDesc& d, const uint8_t* row, OutC* c_kv, OutR* k_pe) {
  const KvRowLayout layout = d.row();
  switch (d.layout) {
    case KvLayout::kBf16:
      copy_bf16(reinterpret_cast<const bf16_t*>(row), d.d_c, c_kv);
      break;
    case KvLayout::kFp8Scaled:
      for (int tile = 0; tile < d.d_c / kFp8TileSize; ++tile) {
        float scale;
        std::memcpy(&scale, row + layout.scales_offset() + 4 * tile, 4);
        dequantize_values(row + tile * kFp8TileSize, kFp8TileSize, scale,
                          c_kv + tile * kFp8TileSize);
      }
      break;
    case KvLayout::kFp8Raw:
      dequantize_values(row, d.d_c, d.k_scale, c_kv);
      dequantize_values(row + layout.rope_offset(), d.d_rope, d.k_scale, k_pe);
      return;
  }
  copy_bf16(reinterpret_cast<const bf16_t*>(row + layout.rope_offset()), d.d_rope, k_pe);
}

// Row i of the outputs starts c_stride / r_stride elements after row i - 1.
template <typename OutC, typename OutR>
void gather_rows(const CpuContext& ctx, const PagedKvPool& pool, const int32_t* locs, int64_t n,
                 OutC* c_kv, int64_t c_stride, OutR* k_pe, int64_t r_stride) {
  const KvPoolDesc& d = pool.desc();
  const uint8_t* rows = pool.storage().ptr<const uint8_t>();
  const int64_t row_bytes = d.bytes_per_token();
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    decode_kv_row(d, rows + int64_t(locs[i]) * row_bytes, c_kv + i * c_stride, k_pe + i * r_stride);
}

}  // namespace

void store_kv(const CpuContext& ctx, PagedKvPool& pool, const TensorView& locs,
              const TensorView& c_kv, const TensorView& k_pe) {
  const KvPoolDesc& d = pool.desc();
  const int32_t* loc = locs.ptr<const int32_t>();
  const bf16_t* c = c_kv.ptr<const bf16_t>();
  const bf16_t* r = k_pe.ptr<const bf16_t>();
  uint8_t* rows = pool.storage().ptr<uint8_t>();
  const int64_t n = locs.numel(), row_bytes = d.bytes_per_token();
  const int64_t c_stride = c_kv.stride[0], r_stride = k_pe.stride[0];  // rows may be strided
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    encode_kv_row(d, c + i * c_stride, r + i * r_stride, rows + int64_t(loc[i]) * row_bytes);
}

void gather_kv(const CpuContext& ctx, const PagedKvPool& pool, const TensorView& locs,
               const TensorView& c_kv, const TensorView& k_pe) {
  const int32_t* loc = locs.ptr<const int32_t>();
  const int64_t n = locs.numel();
  // The two outputs may differ in dtype (each bf16 or f32); their rows may be strided.
  const int64_t c_stride = c_kv.stride[0], r_stride = k_pe.stride[0];
  auto with_rope = [&](auto* c) {
    if (k_pe.dtype == DType::kF32) {
      gather_rows(ctx, pool, loc, n, c, c_stride, k_pe.ptr<float>(), r_stride);
    } else {
      gather_rows(ctx, pool, loc, n, c, c_stride, k_pe.ptr<bf16_t>(), r_stride);
    }
  };
  if (c_kv.dtype == DType::kF32) {
    with_rope(c_kv.ptr<float>());
  } else {
    with_rope(c_kv.ptr<bf16_t>());
  }
}

void store_index_keys(const CpuContext& ctx, IndexKeyPool& pool, const TensorView& locs,
                      const TensorView& idx_k) {
  const IndexKeyPoolDesc& d = pool.desc();
  const int32_t* loc = locs.ptr<const int32_t>();
  const bf16_t* keys = idx_k.ptr<const bf16_t>();
  uint8_t* pages = pool.storage().ptr<uint8_t>();
  const int64_t n = locs.numel();
#pragma omp parallel for num_threads(ctx.threads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // Page of location l: [page_size, d_i] e4m3 codes, then [page_size] fp32 scales.
    const int64_t page = loc[i] / d.page_size, slot = loc[i] % d.page_size;
    uint8_t* page_base = pages + page * d.page_bytes();
    const bf16_t* x = keys + i * d.d_i;
    const float scale = indexer_fp8_scale(abs_max(x, d.d_i));
    quantize_values(x, d.d_i, scale, page_base + slot * d.d_i);
    std::memcpy(page_base + int64_t(d.page_size) * d.d_i + slot * 4, &scale, 4);
  }
}

}  // namespace dsakit::cpu
