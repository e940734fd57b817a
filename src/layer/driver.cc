#include "dsakit/driver.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "dsakit/error.h"

namespace dsakit {

int64_t TokenStore::rows() const {
  return std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
}

int64_t TokenStore::offset(int r) const {
  return std::accumulate(lengths.begin(), lengths.begin() + r, int64_t(0));
}

namespace {

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

LayerInputs TokenStore::DeviceInputs::view() const {
  return {q_nope.view(), q_pe.view(),  c_kv.view(), k_pe.view(),
          idx_q.view(),  idx_k.view(), idx_w.view()};
}

TokenStore::DeviceInputs TokenStore::slice(Backend& be, const std::vector<int64_t>& rows) const {
  return {gather_rows(be, q_nope, rows), gather_rows(be, q_pe, rows),  gather_rows(be, c_kv, rows),
          gather_rows(be, k_pe, rows),   gather_rows(be, idx_q, rows), gather_rows(be, idx_k, rows),
          gather_rows(be, idx_w, rows)};
}

void run_schedule(DsaAttention& layer, const std::vector<std::vector<int32_t>>& page_tables,
                  const TokenStore& tokens, const RunSchedule& s, RunOutputs& out,
                  const std::function<void(int64_t, int64_t)>& progress) {
  const LayerForward forward = [&](const Batch& batch, const std::vector<int32_t>&,
                                   const LayerInputs& inputs) {
    return layer.forward(batch, inputs);
  };
  run_schedule(layer.config(), layer.backend(), forward, page_tables, tokens, s, out, progress);
}

void run_schedule(const ModelConfig& c, Backend& be, const LayerForward& forward,
                  const std::vector<std::vector<int32_t>>& page_tables, const TokenStore& tokens,
                  const RunSchedule& s, RunOutputs& out,
                  const std::function<void(int64_t, int64_t)>& progress) {
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
  while (true) {
    StepRecord step;
    std::vector<int32_t> requests;
    step.batch.mode = s.mode;
    for (int r = 0; r < b; ++r) {
      const int32_t left = s.end[size_t(r)] - pos[size_t(r)];
      if (left <= 0) continue;
      const int32_t e = s.chunk > 0 ? std::min(s.chunk, left) : left;
      step.batch.prefix_lens.push_back(pos[size_t(r)]);
      step.batch.extend_lens.push_back(e);
      step.batch.page_tables.push_back(page_tables[size_t(r)]);
      requests.push_back(r);
      for (int32_t i = 0; i < e; ++i) step.rows.push_back(tokens.offset(r) + pos[size_t(r)] + i);
      pos[size_t(r)] += e;
    }
    if (step.batch.prefix_lens.empty()) break;
    const auto inputs = tokens.slice(be, step.rows);
    LayerResult res = forward(step.batch, requests, inputs.view());
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
