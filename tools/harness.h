// Inputs the command line, the tests and the benchmarks fabricate for the layer: random
// per-position inputs, a random kv_b_proj and shuffled page tables, all deterministic in a seed.
// Not library API (an engine brings its own tensors and page tables); linked as dsakit_harness.
#pragma once

#include <cstdint>
#include <vector>

#include "dsakit/config.h"
#include "dsakit/driver.h"
#include "dsakit/tensor.h"
#include "src/layer/page_tables.h"  // allocate_pages (the DCP simulation uses it too)

namespace dsakit {

// Random inputs for `lengths` (normal(0,1) bf16 queries and keys, c_kv scaled like an RMS-
// normalized latent, fp32 idx_w), deterministic in `seed`.
TokenStore random_token_store(const ModelConfig& config, const std::vector<int32_t>& lengths,
                              uint64_t seed);

// Uniform in [-scale, scale) (bf16 or f32), never all zeros; counter-based, filled by every
// OpenMP thread: fast enough for the multi-GB inputs of long prompts.
Tensor uniform_host(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale);

// As random_token_store with uniform values of unit variance (uniform_host): for long prompts.
TokenStore uniform_token_store(const ModelConfig& config, const std::vector<int32_t>& lengths,
                               uint64_t seed);

// Random kv_b_proj bf16 [H*(d_nope+d_v), d_c] on the host, scaled ~1/sqrt(d_c).
Tensor random_kv_b_proj(const ModelConfig& config, uint64_t seed);

// A random kv_b_proj in its FP8 checkpoint form (Fp8BlockWeights, on the host) and the same
// weights in bf16: power-of-two block scales (~1/sqrt(d_c) over e4m3's range), so every
// e4m3(code) · scale is a bf16 value and `bf16` holds W exactly.
struct Fp8KvBProj {
  Tensor codes;   // u8  [H*(d_nope+d_v), d_c]
  Tensor scales;  // f32 [ceil(rows / 128), d_c / 128]
  Tensor bf16;    // bf16 [H*(d_nope+d_v), d_c], = e4m3(codes) · scales exactly
};
Fp8KvBProj random_fp8_kv_b_proj(const ModelConfig& config, uint64_t seed);
// FP8 block weights decoded: e4m3(codes[r, c]) · scales[r / 128, c / 128] as an f32 product,
// in `dtype` f32, or bf16 (that product rounded to nearest even: kv_b_proj's bf16 form, exact
// where the scales are powers of two).
Tensor decode_fp8_kv_b_proj(const Tensor& codes, const Tensor& scales, DType dtype);

}  // namespace dsakit
