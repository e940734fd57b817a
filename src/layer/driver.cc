#include "dsakit/driver.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "dsakit/error.h"

namespace dsakit {

int64_t TokenStore::rows() const {
  return std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
}

int64_t TokenStore::offset(int r) const {
  return std::accumulate(lengths.begin(), lengths.begin() + r, int64_t(0));
}

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

Tensor gather_rows(Backend& be, const Tensor& src, const std::vector<int64_t>& rows) {
  const TensorView& v = src.view();
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  const size_t row_bytes = v.nbytes() / size_t(std::max<int64_t>(shape[0], 1));
  shape[0] = int64_t(rows.size());
  Tensor host = Tensor::host(v.dtype, shape);
  auto* dst = static_cast<uint8_t*>(host.view().data);
  const auto* s = static_cast<const uint8_t*>(v.data);
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy_n(s + size_t(rows[i]) * row_bytes, row_bytes, dst + i * row_bytes);
  if (be.device() == Device::kCpu) return host;
  return be.to_device(host);
}

}  // namespace

TokenStore TokenStore::random(const ModelConfig& c, const std::vector<int32_t>& lengths,
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
  fill_normal(s.q_nope, gen, 1.0f);
  fill_normal(s.q_pe, gen, 1.0f);
  fill_normal(s.c_kv, gen, 1.0f);
  fill_normal(s.k_pe, gen, 1.0f);
  fill_normal(s.idx_q, gen, 1.0f);
  fill_normal(s.idx_k, gen, 1.0f);
  fill_normal(s.idx_w, gen, 1.0f);
  return s;
}

LayerInputs TokenStore::DeviceInputs::view() const {
  return {q_nope.view(), q_pe.view(),  c_kv.view(), k_pe.view(),
          idx_q.view(),  idx_k.view(), idx_w.view()};
}

TokenStore::DeviceInputs TokenStore::slice(Backend& be, const std::vector<int64_t>& rows) const {
  return {gather_rows(be, q_nope, rows), gather_rows(be, q_pe, rows),  gather_rows(be, c_kv, rows),
          gather_rows(be, k_pe, rows),   gather_rows(be, idx_q, rows), gather_rows(be, idx_k, rows),
          gather_rows(be, idx_w, rows)};
}

Tensor random_kv_b_proj(const ModelConfig& c, uint64_t seed) {
  Tensor w = Tensor::host(
      DType::kBF16, {int64_t(c.num_heads) * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
  std::mt19937_64 gen(seed);
  fill_normal(w, gen, 1.0f / std::sqrt(float(c.kv_lora_rank)));
  return w;
}

std::vector<std::vector<int32_t>> allocate_pages(const std::vector<int32_t>& lengths, int page_size,
                                                 int64_t num_pages, uint64_t seed) {
  DSAKIT_CHECK_ARG(page_size >= 1, "page_size: expected >= 1, got ", page_size);
  int64_t needed = 0;
  for (int32_t l : lengths) needed += (int64_t(l) + page_size - 1) / page_size;
  DSAKIT_CHECK(needed <= num_pages, kResource, "the requests need ", needed, " pages of ",
               page_size, " tokens but the pool has ", num_pages);
  std::vector<int32_t> ids(static_cast<size_t>(num_pages));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 gen(seed);
  std::shuffle(ids.begin(), ids.end(), gen);
  std::vector<std::vector<int32_t>> tables(lengths.size());
  size_t next = 0;
  for (size_t r = 0; r < lengths.size(); ++r) {
    const int64_t pages = (int64_t(lengths[r]) + page_size - 1) / page_size;
    tables[r].assign(ids.begin() + int64_t(next), ids.begin() + int64_t(next) + pages);
    next += size_t(pages);
  }
  return tables;
}

void run_schedule(DsaAttention& layer, const std::vector<std::vector<int32_t>>& page_tables,
                  const TokenStore& tokens, const RunSchedule& s, RunOutputs& out,
                  const std::function<void(int64_t, int64_t)>& progress) {
  const ModelConfig& c = layer.config();
  const int b = int(tokens.lengths.size());
  DSAKIT_CHECK_ARG(
      int(s.begin.size()) == b && int(s.end.size()) == b && int(page_tables.size()) == b,
      "run_schedule: begin/end/page_tables need one entry per request (", b, ")");
  for (int r = 0; r < b; ++r)
    DSAKIT_CHECK_ARG(0 <= s.begin[size_t(r)] && s.begin[size_t(r)] <= s.end[size_t(r)] &&
                         s.end[size_t(r)] <= tokens.lengths[size_t(r)],
                     "request ", r, ": positions [", s.begin[size_t(r)], ", ", s.end[size_t(r)],
                     ") are not within its ", tokens.lengths[size_t(r)], " tokens");
  const int64_t rows = tokens.rows();
  const int64_t h = c.num_heads, dv = c.v_head_dim, k = c.index_topk;
  if (!out.o.defined()) {
    out.o = Tensor::host(DType::kF32, {rows, h, dv});
    out.lse = Tensor::host(DType::kF32, {rows, h});
    out.topk = Tensor::host(DType::kI32, {rows, k});
    std::fill_n(out.o.ptr<float>(), out.o.numel(), std::numeric_limits<float>::quiet_NaN());
    std::fill_n(out.lse.ptr<float>(), out.lse.numel(), std::numeric_limits<float>::quiet_NaN());
    std::fill_n(out.topk.ptr<int32_t>(), out.topk.numel(), -1);
    out.ran.assign(size_t(rows), 0);
  }
  int64_t total = 0, done = 0;
  for (int r = 0; r < b; ++r) total += s.end[size_t(r)] - s.begin[size_t(r)];
  std::vector<int32_t> pos = s.begin;
  Backend& be = layer.backend();
  while (true) {
    StepRecord step;
    step.batch.mode = s.mode;
    for (int r = 0; r < b; ++r) {
      const int32_t left = s.end[size_t(r)] - pos[size_t(r)];
      if (left <= 0) continue;
      const int32_t e = s.chunk > 0 ? std::min(s.chunk, left) : left;
      step.batch.prefix_lens.push_back(pos[size_t(r)]);
      step.batch.extend_lens.push_back(e);
      step.batch.page_tables.push_back(page_tables[size_t(r)]);
      for (int32_t i = 0; i < e; ++i) step.rows.push_back(tokens.offset(r) + pos[size_t(r)] + i);
      pos[size_t(r)] += e;
    }
    if (step.batch.prefix_lens.empty()) break;
    const auto inputs = tokens.slice(be, step.rows);
    LayerResult res = layer.forward(step.batch, inputs.view());
    const Tensor o = be.to_host(res.o);
    const Tensor lse = be.to_host(res.lse);
    const int64_t t = int64_t(step.rows.size());
    for (int64_t i = 0; i < t; ++i) {
      const int64_t row = step.rows[size_t(i)];
      for (int64_t j = 0; j < h * dv; ++j)
        out.o.ptr<float>()[row * h * dv + j] = load_as_float(o.view(), i * h * dv + j);
      std::copy_n(lse.ptr<float>() + i * h, h, out.lse.ptr<float>() + row * h);
      out.ran[size_t(row)] = 1;
    }
    if (res.topk.defined()) {
      const Tensor topk = be.to_host(res.topk);
      for (int64_t i = 0; i < t; ++i)
        std::copy_n(topk.ptr<int32_t>() + i * k, k,
                    out.topk.ptr<int32_t>() + step.rows[size_t(i)] * k);
    }
    step.plan = res.plan;
    step.stages = std::move(res.stages);
    out.steps.push_back(std::move(step));
    done += t;
    if (progress) progress(done, total);
  }
}

}  // namespace dsakit
