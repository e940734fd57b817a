#include "tools/measure.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <numeric>

#include "dsakit/error.h"
#include "dsakit/formats.h"
#include "tools/cli_common.h"
#include "tools/harness.h"

namespace dsakit::cli {

std::string BenchShape::label() const {
  if (kind == "fresh" && extend.size() == 1) return "T=" + std::to_string(extend[0]);
  if (kind == "prefix" && extend.size() == 1)
    return "P=" + std::to_string(prefix[0]) + " E=" + std::to_string(extend[0]);
  std::string s = "[";
  for (size_t r = 0; r < extend.size(); ++r) {
    if (r) s += ",";
    s += prefix[r] ? std::to_string(prefix[r]) + "+" + std::to_string(extend[r])
                   : std::to_string(extend[r]);
  }
  return s + "]";
}

int64_t BenchShape::tokens() const {
  return std::accumulate(extend.begin(), extend.end(), int64_t(0));
}

int64_t BenchShape::max_len() const {
  int64_t m = 0;
  for (size_t r = 0; r < extend.size(); ++r) m = std::max(m, int64_t(prefix[r]) + extend[r]);
  return m;
}

double layer_flops(const ModelConfig& c, AttentionPath path, const CostFeatures& f) {
  const double h = c.num_heads, dn = c.qk_nope_head_dim, dr = c.qk_rope_head_dim, dv = c.v_head_dim,
               dc = c.kv_lora_rank;
  if (path == AttentionPath::kDenseMha)
    return 2 * h * f.ctx * (dn + dr + dv) + 2 * f.positions * h * dc * (dn + dv);
  return 2 * h * f.ctx_topk * (dc + dr + dc) + 2.0 * c.index_n_heads * c.index_head_dim * f.ctx +
         2 * f.tokens * h * dn * dc + 2 * f.tokens * h * dc * dv;
}

double plan_flops(const ModelConfig& c, const Batch& b, const Plan& plan) {
  double flops = 0;
  for (const auto& s : plan.segments)
    flops += layer_flops(c, s.path, CostFeatures::of(b, c, s.first_request, s.num_requests));
  return flops;
}

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

}  // namespace

struct LayerBench::State {
  struct Set {
    Set(PagedKvPool kv_pool, IndexKeyPool index_pool)
        : kv(std::move(kv_pool)), ix(std::move(index_pool)) {}
    PagedKvPool kv;
    IndexKeyPool ix;
    Tensor q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w;
    // The bench's layers, then (has_masked_form()) layers fixed to the masked-MHA form; the
    // "staged" ones time their stages.
    std::unique_ptr<DsaAttention> layer, staged, masked, masked_staged;
    LayerInputs view() const { return {q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w}; }
  };
  BenchShape shape;
  Batch batch;
  Tensor w, w_codes, w_scales;  // kv_b_proj: bf16; its FP8 form (fp8_weights() only)
  std::vector<std::unique_ptr<Set>> sets;
};

LayerBench::LayerBench(Backend& backend, ModelConfig config, KvLayout layout, uint64_t seed,
                       LayerBenchOptions options)
    : be_(backend), config_(std::move(config)), layout_(layout), seed_(seed), options_(options) {
  config_.validate();
}

LayerBench::~LayerBench() = default;

SparseRows LayerBench::sparse_rows() const {
  return state_ ? state_->sets.front()->layer->options().sparse_rows : options_.sparse_rows;
}

SparseForm LayerBench::sparse_form() const {
  return state_ ? state_->sets.front()->layer->options().sparse_form : options_.sparse_form;
}

std::string LayerBench::group() const {
  const SparseRows rows = sparse_rows();
  return fmt::format(
      "{} H={} {}{}{}{}", config_.name, config_.num_heads, to_string(layout_),
      fp8_weights() ? " w8" : "",
      layout_ == KvLayout::kBf16 || rows == SparseRows::kAuto ? std::string()
                                                              : std::string(" ") + to_string(rows),
      sparse_form() == SparseForm::kAuto ? std::string()
                                         : std::string(" ") + to_string(sparse_form()));
}

const Batch& LayerBench::batch() const {
  DSAKIT_CHECK(state_ != nullptr, kInternal, "LayerBench: prepare() a shape first");
  return state_->batch;
}

void LayerBench::prepare(const BenchShape& shape) {
  DSAKIT_CHECK_ARG(!shape.extend.empty() && shape.prefix.size() == shape.extend.size(),
                   "bench shape: expected one prefix per request");
  state_.reset();  // free the previous shape's memory first
  auto st = std::make_unique<State>();
  const auto& c = config_;
  const int page = 64;
  const int64_t h = c.num_heads, t = shape.tokens();
  std::vector<int32_t> lengths;
  int64_t pages = 1, prefix_total = 0;
  for (size_t r = 0; r < shape.extend.size(); ++r) {
    DSAKIT_CHECK_ARG(shape.prefix[r] >= 0 && shape.extend[r] >= 1, "bench shape ", shape.label(),
                     ": prefixes must be >= 0 and extends >= 1");
    lengths.push_back(shape.prefix[r] + shape.extend[r]);
    pages += (lengths.back() + page - 1) / page;
    prefix_total += shape.prefix[r];
  }
  st->shape = shape;
  st->batch.prefix_lens = shape.prefix;
  st->batch.extend_lens = shape.extend;
  st->batch.page_tables = allocate_pages(lengths, page, pages, seed_ + 1);
  if (fp8_weights()) {
    const Fp8KvBProj w = random_fp8_kv_b_proj(c, seed_ + 2);
    st->w = be_.to_device(w.bf16);
    st->w_codes = be_.to_device(w.codes);
    st->w_scales = be_.to_device(w.scales);
  } else {
    st->w = be_.to_device(uniform_host(
        DType::kBF16, {h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, seed_ + 2, 0.08f));
  }

  KvPoolDesc kd;
  kd.layout = layout_;
  kd.page_size = page;
  kd.num_pages = pages;
  kd.d_c = c.kv_lora_rank;
  kd.d_rope = c.qk_rope_head_dim;
  kd.scale_policy = ScalePolicy::kPow2;  // as dsakit run writes its pools (docs/formats.md)
  const int64_t row_bytes =
      2 * (h * (c.qk_nope_head_dim + c.qk_rope_head_dim) + c.kv_lora_rank + c.qk_rope_head_dim +
           int64_t(c.index_n_heads) * c.index_head_dim + c.index_head_dim) +
      4 * c.index_n_heads;
  const int64_t set_bytes = t * row_bytes + pages * page * (kd.bytes_per_token() + 132);
  const int nsets = set_bytes < (int64_t(1) << 30) ? 3 : 1;

  // Locations of the cached prefixes, stored once per set.
  std::vector<int32_t> prefix_locs;
  for (size_t r = 0; r < shape.extend.size(); ++r)
    for (int32_t p = 0; p < shape.prefix[r]; ++p)
      prefix_locs.push_back(int32_t(location_of(st->batch.page_tables[r], page, p)));

  for (int s = 0; s < nsets; ++s) {
    const uint64_t seed = seed_ + 100 * uint64_t(s + 1);
    auto set = std::make_unique<State::Set>(be_.make_kv_pool(kd),
                                            be_.make_index_pool({page, pages, c.index_head_dim}));
    auto dev = [&](DType dt, std::vector<int64_t> shape_, uint64_t k, float scale = 1.0f) {
      return be_.to_device(uniform_host(dt, shape_, seed + k, scale));
    };
    set->q_nope = dev(DType::kBF16, {t, h, c.qk_nope_head_dim}, 1);
    set->q_pe = dev(DType::kBF16, {t, h, c.qk_rope_head_dim}, 2);
    set->c_kv = dev(DType::kBF16, {t, c.kv_lora_rank}, 3);
    set->k_pe = dev(DType::kBF16, {t, c.qk_rope_head_dim}, 4);
    set->idx_q = dev(DType::kBF16, {t, c.index_n_heads, c.index_head_dim}, 5);
    set->idx_k = dev(DType::kBF16, {t, c.index_head_dim}, 6);
    set->idx_w = dev(DType::kF32, {t, c.index_n_heads}, 7);
    if (prefix_total > 0) {
      const Tensor locs =
          be_.to_device(make_view(prefix_locs.data(), DType::kI32, Device::kCpu, {prefix_total}));
      be_.store_kv(set->kv, locs, dev(DType::kBF16, {prefix_total, c.kv_lora_rank}, 8),
                   dev(DType::kBF16, {prefix_total, c.qk_rope_head_dim}, 9));
      be_.store_index_keys(set->ix, locs, dev(DType::kBF16, {prefix_total, c.index_head_dim}, 10));
    }
    LayerOptions o;
    if (fp8_weights()) o.kv_b_proj_fp8 = {st->w_codes, st->w_scales};
    o.sparse_rows = options_.sparse_rows;
    o.sparse_form = options_.sparse_form;
    set->layer = std::make_unique<DsaAttention>(c, be_, set->kv, set->ix, st->w, o);
    o.time_stages = true;
    set->staged = std::make_unique<DsaAttention>(c, be_, set->kv, set->ix, st->w, o);
    if (has_masked_form()) {
      o.sparse_form = SparseForm::kMaskedMha;
      set->masked_staged = std::make_unique<DsaAttention>(c, be_, set->kv, set->ix, st->w, o);
      o.time_stages = false;
      set->masked = std::make_unique<DsaAttention>(c, be_, set->kv, set->ix, st->w, o);
    }
    st->sets.push_back(std::move(set));
  }
  be_.synchronize();
  state_ = std::move(st);
}

bool LayerBench::has_masked_form() const {
  return masked_mha_available(be_.capabilities(), config_);
}

std::vector<PolicyTiming> LayerBench::time(const std::vector<TimedPolicy>& policies, int runs,
                                           int min_runs, double budget_ms, bool stages,
                                           const std::atomic<bool>* stop) {
  DSAKIT_CHECK(state_ != nullptr, kInternal, "LayerBench: prepare() a shape first");
  using clock = std::chrono::steady_clock;
  auto& sets = state_->sets;
  const Batch& b = state_->batch;
  const size_t np = policies.size();
  for (const TimedPolicy& p : policies)
    DSAKIT_CHECK(!p.masked_form || has_masked_form(), kInternal,
                 "LayerBench: no masked-MHA layers for ", config_.name, " on this backend");
  std::vector<PolicyTiming> out(np);
  std::vector<std::vector<double>> ms(np), enqueue_ms(np);
  auto stopped = [&] { return stop && stop->load(); };

  struct Call {
    double ms, enqueue_ms;
    std::map<std::string, double> stages;  // same-named stages summed (staged calls only)
  };
  auto call = [&](size_t p, int round, bool staged) {
    auto& set = *sets[size_t(round) % sets.size()];
    DsaAttention& layer = policies[p].masked_form ? (staged ? *set.masked_staged : *set.masked)
                                                  : (staged ? *set.staged : *set.layer);
    layer.set_policy(policies[p].policy);
    LayerResult res;
    double enqueue = 0;
    const double elapsed = be_.time_ms([&] {
      const auto t0 = clock::now();
      res = layer.forward(b, set.view());
      enqueue = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    });
    out[p].plan = res.plan;
    Call c{elapsed, enqueue, {}};
    for (const auto& s : res.stages) c.stages[s.stage] += s.ms;
    return c;
  };

  // One warm-up round (allocator caches, cuBLAS heuristics, first-touch pages). Then rounds of
  // blocks: each policy runs kBlock calls in a row and the first is dropped, so every timed call
  // follows a call of its own path, as consecutive layers of one forward do (a call right after
  // the other path pays for the allocator's and caches' switch: 3-10% on small shapes).
  constexpr int kBlock = 4;
  for (size_t p = 0; p < np && !stopped(); ++p) call(p, 0, false);
  const auto start = clock::now();
  int round = 0, timed = 0;
  while (!stopped()) {
    for (size_t p = 0; p < np; ++p)
      for (int i = 0; i < kBlock; ++i) {
        const Call c = call(p, round * kBlock + i, false);
        if (i > 0) {
          ms[p].push_back(c.ms);
          enqueue_ms[p].push_back(c.enqueue_ms);
        }
      }
    ++round;
    timed += kBlock - 1;
    const double spent = std::chrono::duration<double, std::milli>(clock::now() - start).count();
    if (timed >= runs || (timed >= min_runs && spent >= budget_ms)) break;
  }
  for (size_t p = 0; p < np; ++p) {
    out[p].ms = median(ms[p]);
    out[p].enqueue_ms = median(enqueue_ms[p]);
    out[p].runs = int(ms[p].size());
  }
  if (stages) {
    const int srounds = std::clamp(timed / 6, 1, 5);
    std::vector<std::map<std::string, std::vector<double>>> per(np);
    for (int r = 0; r < srounds && !stopped(); ++r)
      for (size_t p = 0; p < np; ++p)
        for (const auto& [name, v] : call(p, r, true).stages) per[p][name].push_back(v);
    for (size_t p = 0; p < np; ++p)
      for (const auto& [name, v] : per[p]) out[p].stages[name] = median(v);
  }
  return out;
}

std::vector<ModelConfig> parse_model_list(const std::string& text) {
  std::vector<ModelConfig> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    DSAKIT_CHECK_ARG(!item.empty(), "--models: empty entry in '", text,
                     "' (expected e.g. deepseek-v3.2:8,glm-5:4)");
    std::string name = item;
    int tp = 1;
    if (const size_t colon = item.rfind(':'); colon != std::string::npos) {
      const std::string digits = item.substr(colon + 1);
      DSAKIT_CHECK_ARG(!digits.empty() && digits.size() <= 4 &&
                           std::all_of(digits.begin(), digits.end(),
                                       [](char ch) { return ch >= '0' && ch <= '9'; }),
                       "--models: '", item, "': expected NAME or NAME:TP with TP a number");
      tp = std::stoi(digits);
      name = item.substr(0, colon);
    }
    out.push_back(load_model(name, tp));
    pos = comma + 1;
  }
  return out;
}

}  // namespace dsakit::cli
