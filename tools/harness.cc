#include "tools/harness.h"

#include <cmath>
#include <random>

#include "dsakit/error.h"
#include "dsakit/formats.h"
#include "src/core/fp8_decode.h"

namespace dsakit {

namespace {

void fill_normal(Tensor& t, std::mt19937_64& gen, float stddev) {
  std::normal_distribution<float> dist(0.f, stddev);
  const int64_t n = t.numel();
  if (t.dtype() == DType::kBF16) {
    for (int64_t i = 0; i < n; ++i) t.ptr<bf16_t>()[i] = f32_to_bf16(dist(gen));
  } else {
    for (int64_t i = 0; i < n; ++i) t.ptr<float>()[i] = dist(gen);
  }
}

uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

TokenStore random_token_store(const ModelConfig& c, const std::vector<int32_t>& lengths,
                              uint64_t seed) {
  TokenStore s;
  s.lengths = lengths;
  const int64_t n = s.rows();
  std::mt19937_64 gen(seed);
  s.q_nope = Tensor::host(DType::kBF16, {n, c.num_heads, c.qk_nope_head_dim});
  s.q_pe = Tensor::host(DType::kBF16, {n, c.num_heads, c.qk_rope_head_dim});
  s.c_kv = Tensor::host(DType::kBF16, {n, c.kv_lora_rank});
  s.k_pe = Tensor::host(DType::kBF16, {n, c.qk_rope_head_dim});
  s.idx_q = Tensor::host(DType::kBF16, {n, c.index_n_heads, c.index_head_dim});
  s.idx_k = Tensor::host(DType::kBF16, {n, c.index_head_dim});
  s.idx_w = Tensor::host(DType::kF32, {n, c.index_n_heads});
  for (Tensor* t : {&s.q_nope, &s.q_pe, &s.c_kv, &s.k_pe, &s.idx_q, &s.idx_k, &s.idx_w})
    fill_normal(*t, gen, 1.0f);
  return s;
}

Tensor uniform_host(DType dtype, const std::vector<int64_t>& shape, uint64_t seed, float scale) {
  Tensor t = Tensor::host(dtype, shape);
  const int64_t n = t.numel();
  const uint64_t base = splitmix64(seed);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t z = splitmix64(base + uint64_t(i));
    const float u = float(int32_t(uint32_t(z >> 32))) * (scale / 2147483648.0f);
    if (dtype == DType::kBF16)
      t.ptr<bf16_t>()[i] = f32_to_bf16(u);
    else
      t.ptr<float>()[i] = u;
  }
  return t;
}

TokenStore uniform_token_store(const ModelConfig& c, const std::vector<int32_t>& lengths,
                               uint64_t seed) {
  TokenStore s;
  s.lengths = lengths;
  const int64_t n = s.rows();
  const float unit = std::sqrt(3.0f);  // uniform [-sqrt 3, sqrt 3): variance 1
  s.q_nope = uniform_host(DType::kBF16, {n, c.num_heads, c.qk_nope_head_dim}, seed, unit);
  s.q_pe = uniform_host(DType::kBF16, {n, c.num_heads, c.qk_rope_head_dim}, seed + 1, unit);
  s.c_kv = uniform_host(DType::kBF16, {n, c.kv_lora_rank}, seed + 2, unit);
  s.k_pe = uniform_host(DType::kBF16, {n, c.qk_rope_head_dim}, seed + 3, unit);
  s.idx_q = uniform_host(DType::kBF16, {n, c.index_n_heads, c.index_head_dim}, seed + 4, unit);
  s.idx_k = uniform_host(DType::kBF16, {n, c.index_head_dim}, seed + 5, unit);
  s.idx_w = uniform_host(DType::kF32, {n, c.index_n_heads}, seed + 6, unit);
  return s;
}

Tensor random_kv_b_proj(const ModelConfig& c, uint64_t seed) {
  Tensor w = Tensor::host(
      DType::kBF16, {int64_t(c.num_heads) * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
  std::mt19937_64 gen(seed);
  fill_normal(w, gen, 1.0f / std::sqrt(float(c.kv_lora_rank)));
  return w;
}

Fp8KvBProj random_fp8_kv_b_proj(const ModelConfig& c, uint64_t seed) {
  const int64_t rows = int64_t(c.num_heads) * (c.qk_nope_head_dim + c.v_head_dim);
  const int64_t d_c = c.kv_lora_rank, tiles = d_c / kFp8TileSize;
  const int64_t row_blocks = (rows + kFp8TileSize - 1) / kFp8TileSize;
  Fp8KvBProj w{Tensor::host(DType::kU8, {rows, d_c}),
               Tensor::host(DType::kF32, {row_blocks, tiles}), Tensor()};
  std::mt19937_64 gen(seed);
  // Block scales 2^-e with e spread over three binades around 448 · 2^-e ~ 3/sqrt(d_c).
  const int e0 = int(std::lround(std::log2(kE4m3Max * std::sqrt(float(d_c)) / 3.0f)));
  for (int64_t i = 0; i < row_blocks * tiles; ++i)
    w.scales.ptr<float>()[i] = std::ldexp(1.0f, -(e0 + int(gen() % 3)));
  std::uniform_real_distribution<float> code_value(-kE4m3Max, kE4m3Max);
  for (int64_t i = 0; i < rows * d_c; ++i) w.codes.ptr<uint8_t>()[i] = f32_to_e4m3(code_value(gen));
  w.bf16 = decode_fp8_kv_b_proj(w.codes, w.scales, DType::kBF16);
  return w;
}

Tensor decode_fp8_kv_b_proj(const Tensor& codes, const Tensor& scales, DType dtype) {
  DSAKIT_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kBF16,
                   "decode_fp8_kv_b_proj: expected f32 or bf16, got ", to_string(dtype));
  const int64_t rows = codes.view().shape[0], d_c = codes.view().shape[1];
  Tensor w = Tensor::host(DType::kF32, {rows, d_c});
  decode_fp8_block_rows(codes.ptr<uint8_t>(), scales.ptr<float>(), d_c, 0, rows, w.ptr<float>());
  if (dtype == DType::kF32) return w;
  Tensor b = Tensor::host(DType::kBF16, {rows, d_c});
  for (int64_t i = 0; i < rows * d_c; ++i) b.ptr<bf16_t>()[i] = f32_to_bf16(w.ptr<float>()[i]);
  return b;
}

}  // namespace dsakit
