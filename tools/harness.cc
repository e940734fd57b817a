#include "tools/harness.h"

#include <cmath>
#include <random>

#include "dsakit/formats.h"

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

Tensor random_kv_b_proj(const ModelConfig& c, uint64_t seed) {
  Tensor w = Tensor::host(
      DType::kBF16, {int64_t(c.num_heads) * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
  std::mt19937_64 gen(seed);
  fill_normal(w, gen, 1.0f / std::sqrt(float(c.kv_lora_rank)));
  return w;
}

}  // namespace dsakit
