// Host-side bulk decodes of e4m3 data: the 256-entry value table, and an FP8 checkpoint's
// block-scaled weights (Fp8BlockWeights) to f32. Shared by the CPU backend's hot loops and the
// tools that read checkpoints.
#pragma once

#include <array>
#include <cstdint>

#include "dsakit/formats.h"

namespace dsakit {

// e4m3 code -> fp32 value for all 256 codes (0x7F, 0xFF -> NaN), built once from e4m3_to_f32 and
// immutable afterwards: one load per value instead of the branchy field decode.
inline const std::array<float, 256>& e4m3_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_to_f32(uint8_t(c));
    return t;
  }();
  return table;
}

// Rows [row_begin, row_end) of out f32 [rows, cols] = e4m3(codes[r, c]) · scales[r / 128, c / 128]
// (f32 products); codes u8 [rows, cols], scales f32 [ceil(rows / 128), cols / 128], cols a
// multiple of 128 (Fp8BlockWeights' layout).
inline void decode_fp8_block_rows(const uint8_t* codes, const float* scales, int64_t cols,
                                  int64_t row_begin, int64_t row_end, float* out) {
  const std::array<float, 256>& value = e4m3_values();
  const int64_t blocks = cols / kFp8TileSize;
  for (int64_t r = row_begin; r < row_end; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float scale = scales[(r / kFp8TileSize) * blocks + b];
      const uint8_t* in = codes + r * cols + b * kFp8TileSize;
      float* o = out + r * cols + b * kFp8TileSize;
      for (int c = 0; c < kFp8TileSize; ++c) o[c] = value[in[c]] * scale;
    }
}

}  // namespace dsakit
