// libFuzzer target: DsaAttention::forward on the CPU backend (one thread) with a small MLA config
// and everything else drawn from the input: pool layout, page size and count, index_topk,
// dispatch mode, output dtype, workspace limit, the batch (mode, prefix/extend lengths, page
// tables, shared-prefix flag), one corrupted input tensor (dtype, shape, stride, device, null
// data, row count) and NaN/Inf planted in one request's inputs.
//
// Invariants checked (docs/reliability.md); a violation aborts:
//   * a rejected call throws dsakit::Error of an input kind with a message, and leaves both pools
//     byte-identical;
//   * an accepted call returns o [T, H, d_v] and lse [T, H]; requests without planted NaN/Inf
//     have finite o and lse that is finite (or +inf for a query with nothing to attend to);
//     every top-k row lists distinct ascending positions inside its context, then -1.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/error.h"
#include "dsakit/layer.h"

namespace {

using namespace dsakit;

void require(bool cond) {
  if (!cond) std::abort();
}

// DeepSeek-shaped but tiny: 2 heads, d_c 128 (one fp8 tile), d_rope 16, index heads 2 x 16.
ModelConfig tiny_config(int index_topk) {
  ModelConfig c;
  c.name = "fuzz";
  c.num_heads = c.num_heads_total = 2;
  c.tp_size = 1;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 16;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 16;
  c.q_lora_rank = 0;
  c.index_n_heads = 2;
  c.index_head_dim = 16;
  c.index_topk = index_topk;
  c.hidden_size = 64;
  return c;
}

Backend& backend() {
  static const std::unique_ptr<Backend> be = make_cpu_backend(1);
  return *be;
}

uint64_t fnv1a(const TensorView& t) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = t.ptr<const uint8_t>();
  for (size_t i = 0; i < t.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// A host tensor of normal(0, 1) values (bf16-rounded for bf16).
Tensor random_tensor(std::mt19937_64& gen, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t = Tensor::host(dtype, shape);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::kBF16)
      t.ptr<bf16_t>()[i] = f32_to_bf16(normal(gen));
    else
      t.ptr<float>()[i] = normal(gen);
  }
  return t;
}

// Page tables: disjoint shuffled pages sized to each request (the valid case), or raw ids.
std::vector<std::vector<int32_t>> make_tables(FuzzedDataProvider& fdp, const Batch& b,
                                              int page_size, int64_t num_pages,
                                              std::mt19937_64& gen) {
  std::vector<std::vector<int32_t>> tables(size_t(b.num_requests()));
  if (fdp.ConsumeBool()) {
    std::vector<int32_t> free_pages(static_cast<size_t>(num_pages));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), gen);
    size_t next = 0;
    for (int r = 0; r < b.num_requests(); ++r) {
      const int64_t need =
          (int64_t(b.prefix_lens[size_t(r)]) + b.extend_lens[size_t(r)] + page_size - 1) /
          page_size;
      for (int64_t i = 0; i < need && next < free_pages.size(); ++i)
        tables[size_t(r)].push_back(free_pages[next++]);
    }
    return tables;
  }
  for (auto& t : tables) {
    const int n = fdp.ConsumeIntegralInRange(0, 12);
    for (int i = 0; i < n; ++i)
      t.push_back(fdp.ConsumeIntegralInRange<int32_t>(-2, int32_t(num_pages) + 1));
  }
  return tables;
}

// One corruption of one input view; the layer must reject it before touching the pools.
void corrupt(FuzzedDataProvider& fdp, TensorView& v) {
  switch (fdp.ConsumeIntegralInRange(0, 5)) {
    case 0:
      v.dtype = v.dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
      break;
    case 1:
      v.shape[size_t(fdp.ConsumeIntegralInRange(0, v.ndim - 1))] += fdp.ConsumeBool() ? 1 : -1;
      break;
    case 2:
      v.stride[0] += 1;  // not contiguous
      break;
    case 3:
      v.device = Device::kCuda;
      break;
    case 4:
      v.data = nullptr;
      break;
    default:
      v.ndim = std::max(1, v.ndim - 1);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  Backend& be = backend();
  std::mt19937_64 gen(fdp.ConsumeIntegral<uint32_t>());

  const ModelConfig cfg = tiny_config(fdp.ConsumeIntegralInRange(1, 48));
  KvPoolDesc kd;
  kd.layout = fdp.PickValueInArray({KvLayout::kBf16, KvLayout::kFp8Scaled, KvLayout::kFp8Raw});
  kd.page_size = fdp.PickValueInArray({1, 2, 4, 8, 16});
  kd.num_pages = fdp.ConsumeIntegralInRange(1, 24);
  kd.d_c = cfg.kv_lora_rank;
  kd.d_rope = cfg.qk_rope_head_dim;
  kd.scale_policy = fdp.ConsumeBool() ? ScalePolicy::kAmax : ScalePolicy::kPow2;
  PagedKvPool kv = be.make_kv_pool(kd);
  IndexKeyPool ix = be.make_index_pool({kd.page_size, kd.num_pages, cfg.index_head_dim});

  // Every location holds a finite token first, so prefixes read back real values.
  const int64_t n_loc = kd.num_locations();
  std::vector<int32_t> all_locs(static_cast<size_t>(n_loc));
  std::iota(all_locs.begin(), all_locs.end(), 0);
  const TensorView locs_view = make_view(all_locs.data(), DType::kI32, Device::kCpu, {n_loc});
  be.store_kv(kv, locs_view, random_tensor(gen, DType::kBF16, {n_loc, cfg.kv_lora_rank}),
              random_tensor(gen, DType::kBF16, {n_loc, cfg.qk_rope_head_dim}));
  be.store_index_keys(ix, locs_view, random_tensor(gen, DType::kBF16, {n_loc, cfg.index_head_dim}));

  LayerOptions lo;
  lo.policy.mode = fdp.PickValueInArray(
      {DispatchMode::kRule, DispatchMode::kDense, DispatchMode::kSparse, DispatchMode::kCost});
  lo.policy.allow_approximation = fdp.ConsumeBool();
  lo.output_dtype = fdp.ConsumeBool() ? DType::kF32 : DType::kBF16;
  if (fdp.ConsumeIntegralInRange(0, 7) == 0)
    lo.max_workspace_bytes = fdp.ConsumeIntegralInRange<int64_t>(1, int64_t(1) << 20);
  const int64_t w_rows = int64_t(cfg.num_heads) * (cfg.qk_nope_head_dim + cfg.v_head_dim);
  const Tensor w = random_tensor(gen, DType::kBF16, {w_rows, cfg.kv_lora_rank});
  DsaAttention layer(cfg, be, kv, ix, w, lo);

  Batch b;
  b.mode = fdp.PickValueInArray({ForwardMode::kExtend, ForwardMode::kDecode,
                                 ForwardMode::kTargetVerify, ForwardMode::kDraftExtend});
  const int num_requests = fdp.ConsumeIntegralInRange(1, 4);
  for (int r = 0; r < num_requests; ++r) {
    b.prefix_lens.push_back(fdp.ConsumeIntegralInRange<int32_t>(-1, 48));
    b.extend_lens.push_back(fdp.ConsumeIntegralInRange<int32_t>(-1, 24));
  }
  if (fdp.ConsumeIntegralInRange(0, 15) == 0) b.extend_lens.pop_back();  // size mismatch
  b.shared_prefix_pages = fdp.ConsumeBool();
  b.cuda_graph = fdp.ConsumeBool();
  b.speculative = fdp.ConsumeBool();
  b.page_tables = make_tables(fdp, b, kd.page_size, kd.num_pages, gen);

  // Inputs for T rows (the batch's T unless a row-count corruption is drawn).
  int64_t t = 0;
  for (int32_t e : b.extend_lens) t += std::max(e, 0);
  if (fdp.ConsumeIntegralInRange(0, 15) == 0) t += fdp.ConsumeBool() ? 1 : -1;
  t = std::max<int64_t>(t, 0);
  const int64_t h = cfg.num_heads, hi = cfg.index_n_heads, di = cfg.index_head_dim;
  Tensor q_nope = random_tensor(gen, DType::kBF16, {t, h, cfg.qk_nope_head_dim});
  Tensor q_pe = random_tensor(gen, DType::kBF16, {t, h, cfg.qk_rope_head_dim});
  Tensor c_kv = random_tensor(gen, DType::kBF16, {t, cfg.kv_lora_rank});
  Tensor k_pe = random_tensor(gen, DType::kBF16, {t, cfg.qk_rope_head_dim});
  Tensor idx_q = random_tensor(gen, DType::kBF16, {t, hi, di});
  Tensor idx_k = random_tensor(gen, DType::kBF16, {t, di});
  Tensor idx_w = random_tensor(gen, DType::kF32, {t, hi});
  Tensor* tensors[] = {&q_nope, &q_pe, &c_kv, &k_pe, &idx_q, &idx_k, &idx_w};

  // NaN or Inf in one element of one tensor; `poisoned_row` is its token row.
  int64_t poisoned_row = -1;
  if (t > 0 && fdp.ConsumeBool()) {
    Tensor& target = *tensors[fdp.ConsumeIntegralInRange(0, 6)];
    const int64_t i = fdp.ConsumeIntegralInRange<int64_t>(0, target.numel() - 1);
    const float bad = fdp.PickValueInArray({std::numeric_limits<float>::quiet_NaN(),
                                            std::numeric_limits<float>::infinity(),
                                            -std::numeric_limits<float>::infinity()});
    if (target.dtype() == DType::kBF16)
      target.ptr<bf16_t>()[i] = f32_to_bf16(bad);
    else
      target.ptr<float>()[i] = bad;
    poisoned_row = i / (target.numel() / t);
  }

  LayerInputs in{q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w};
  if (fdp.ConsumeIntegralInRange(0, 7) == 0) {
    TensorView* views[] = {&in.q_nope, &in.q_pe,  &in.c_kv, &in.k_pe,
                           &in.idx_q,  &in.idx_k, &in.idx_w};
    corrupt(fdp, *views[fdp.ConsumeIntegralInRange(0, 6)]);
  }

  const uint64_t kv_before = fnv1a(kv.storage()), ix_before = fnv1a(ix.storage());
  LayerResult res;
  try {
    res = layer.forward(b, in);
  } catch (const Error& e) {
    require(e.kind() == ErrorKind::kInvalidArgument || e.kind() == ErrorKind::kResource ||
            e.kind() == ErrorKind::kUnsupported || e.kind() == ErrorKind::kLayoutMismatch);
    require(e.what()[0] != 0);
    require(fnv1a(kv.storage()) == kv_before && fnv1a(ix.storage()) == ix_before);
    return 0;
  }

  // Accepted: shapes, then per-request finiteness away from the planted value, then top-k.
  require(res.o.numel() == t * h * cfg.v_head_dim && res.lse.numel() == t * h);
  const Tensor o = be.to_host(res.o), lse = be.to_host(res.lse);
  const Tensor topk = res.topk.defined() ? be.to_host(res.topk) : Tensor();
  int64_t row = 0;
  for (int r = 0; r < b.num_requests(); ++r) {
    const int64_t first = row, last = row + b.extend_lens[size_t(r)];
    const bool poisoned = poisoned_row >= first && poisoned_row < last;
    for (; row < last; ++row) {
      const int32_t pos = b.prefix_lens[size_t(r)] + int32_t(row - first);
      for (int64_t j = 0; j < h && !poisoned; ++j) {
        const float l = lse.ptr<float>()[row * h + j];
        require(std::isfinite(l) || l == std::numeric_limits<float>::infinity());
        for (int64_t d = 0; d < cfg.v_head_dim; ++d) {
          const int64_t e = (row * h + j) * cfg.v_head_dim + d;
          const float x =
              o.dtype() == DType::kF32 ? o.ptr<float>()[e] : bf16_to_f32(o.ptr<bf16_t>()[e]);
          require(std::isfinite(x));
        }
      }
      if (!topk.defined()) continue;
      int32_t prev = -1;
      bool padding = false;
      for (int64_t j = 0; j < cfg.index_topk; ++j) {
        const int32_t p = topk.ptr<int32_t>()[row * cfg.index_topk + j];
        if (p == -1) {
          padding = true;
          continue;
        }
        require(!padding && p > prev && p <= pos);
        prev = p;
      }
    }
  }
  return 0;
}
