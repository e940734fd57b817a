// Hostile input at the layer and backend boundary (docs/reliability.md), on every backend under
// test: random invalid calls are rejected with an error naming the argument and leave the pools
// byte-identical; invalid top-k entries (negative, past the context, reaching into another
// request's locations, past the pool) are skipped, never read; NaN/Inf in one request's inputs
// stays in that request; the workspace limit refuses a call before anything is written; two
// layers on two threads give the results they give one after the other.
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <thread>

#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "src/reference/reference.h"
#include "tests/common/test_util.h"
#include "tools/harness.h"

namespace dsakit {
namespace {

using testing::fresh_seed;

// DeepSeek-V3.2 at TP8 (16 heads, the CUDA kernels' head count) with a small top-k, so contexts
// of a few dozen tokens already take the sparse path's selection.
ModelConfig small_model(int index_topk = 16) {
  ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
  c.index_topk = index_topk;
  return c;
}

// A layer over its own pools (two spare pages nobody owns) and random tokens for `lengths`.
struct Rig {
  ModelConfig cfg;
  std::unique_ptr<Backend> be;
  KvPoolDesc kd;
  PagedKvPool kv;
  IndexKeyPool ix;
  Tensor w;
  TokenStore tokens;
  std::vector<std::vector<int32_t>> tables;
  std::unique_ptr<DsaAttention> layer;

  Rig(const ModelConfig& c, const std::string& backend, KvLayout layout,
      const std::vector<int32_t>& lengths, uint64_t seed, LayerOptions options = {})
      : cfg(c), be(make_backend(backend)) {
    kd.layout = layout;
    kd.page_size = 16;
    kd.d_c = c.kv_lora_rank;
    kd.d_rope = c.qk_rope_head_dim;
    kd.num_pages = 2;
    for (int32_t l : lengths) kd.num_pages += (l + kd.page_size - 1) / kd.page_size;
    kv = be->make_kv_pool(kd);
    ix = be->make_index_pool({kd.page_size, kd.num_pages, c.index_head_dim});
    w = be->to_device(random_kv_b_proj(c, seed + 1));
    tokens = random_token_store(c, lengths, seed);
    tables = allocate_pages(lengths, kd.page_size, kd.num_pages, seed + 2);
    layer = std::make_unique<DsaAttention>(c, *be, kv, ix, w, options);
  }

  RunOutputs run(const RunSchedule& schedule) {
    RunOutputs out;
    run_schedule(*layer, tables, tokens, schedule, out);
    return out;
  }
  std::vector<int32_t> zeros() const { return std::vector<int32_t>(tokens.lengths.size(), 0); }
  uint64_t pool_checksum() {
    return testing::checksum(be->to_host(kv.storage())) ^
           (testing::checksum(be->to_host(ix.storage())) * 31);
  }
};

// Every output value of the rows of request `r` (o, then lse) from a run over `lengths`.
std::vector<double> request_outputs(const RunOutputs& out, const std::vector<int32_t>& lengths,
                                    int r) {
  int64_t first = 0;
  for (int i = 0; i < r; ++i) first += lengths[size_t(i)];
  const int64_t rows = int64_t(out.ran.size());
  const int64_t od = out.o.numel() / rows, ld = out.lse.numel() / rows;
  std::vector<double> v;
  for (int64_t row = first; row < first + lengths[size_t(r)]; ++row) {
    for (int64_t j = 0; j < od; ++j) v.push_back(out.o.ptr<float>()[row * od + j]);
    for (int64_t j = 0; j < ld; ++j) v.push_back(out.lse.ptr<float>()[row * ld + j]);
  }
  return v;
}

std::vector<int64_t> all_rows(int64_t n) {
  std::vector<int64_t> rows(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rows[size_t(i)] = i;
  return rows;
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.device == b.device && a.ndim == b.ndim &&
         a.shape == b.shape && a.stride == b.stride;
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
  return true;
}

class HostileTest : public ::testing::TestWithParam<std::string> {};

// One way to break a valid call, and a fragment the error message must contain.
struct Breakage {
  const char* what;
  const char* needle;
  std::function<void(Batch&, LayerInputs&, testing::Rng&)> apply;
};

// random invalid calls (which breakage, which request, which tensor, which value) are all
// rejected before the first write, with a message naming the argument.
TEST_P(HostileTest, RandomInvalidCallsLeaveThePoolsByteIdentical) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  testing::Rng rng(seed);
  const std::vector<int32_t> lengths = {40, 30, 20};
  Rig rig(small_model(), GetParam(), KvLayout::kFp8Scaled, lengths, seed);
  rig.run({rig.zeros(), {20, 10, 5}, 0, ForwardMode::kExtend});  // something in the pools
  const uint64_t before = rig.pool_checksum();

  const std::vector<int32_t> prefix = {20, 10, 5};
  std::vector<int64_t> rows;
  for (int r = 0, first = 0; r < 3; first += lengths[size_t(r)], ++r)
    for (int p = prefix[size_t(r)]; p < lengths[size_t(r)]; ++p) rows.push_back(first + p);
  const auto inputs = rig.tokens.slice(*rig.be, rows);
  const auto good_batch = [&] {
    Batch b;
    b.prefix_lens = prefix;
    for (int r = 0; r < 3; ++r) b.extend_lens.push_back(lengths[size_t(r)] - prefix[size_t(r)]);
    b.page_tables = rig.tables;
    return b;
  };
  const auto any_request = [](testing::Rng& g) { return size_t(g.randint(0, 2)); };
  const auto input_view = [](LayerInputs& in, int i) -> std::pair<TensorView*, const char*> {
    switch (i) {
      case 0:
        return {&in.q_nope, "q_nope"};
      case 1:
        return {&in.q_pe, "q_pe"};
      case 2:
        return {&in.c_kv, "c_kv"};
      case 3:
        return {&in.k_pe, "k_pe"};
      case 4:
        return {&in.idx_q, "idx_q"};
      case 5:
        return {&in.idx_k, "idx_k"};
      default:
        return {&in.idx_w, "idx_w"};
    }
  };
  const int64_t pages = rig.kd.num_pages;
  const std::vector<Breakage> breakages = {
      {"page id out of range", "page_table[",
       [&](Batch& b, LayerInputs&, testing::Rng& g) {
         auto& t = b.page_tables[any_request(g)];
         t[size_t(g.randint(0, 1))] =
             int32_t(g.randint(0, 1) ? g.randint(pages, INT32_MAX) : g.randint(INT32_MIN, -1));
       }},
      {"negative prefix", "prefix_len",
       [&](Batch& b, LayerInputs&, testing::Rng& g) {
         b.prefix_lens[any_request(g)] = int32_t(g.randint(INT32_MIN, -1));
       }},
      {"negative extend", "extend_len",
       [&](Batch& b, LayerInputs&, testing::Rng& g) {
         b.extend_lens[any_request(g)] = int32_t(g.randint(-1000, -1));
       }},
      {"length beyond the table", "page table has",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.page_tables[any_request(g)].resize(1); }},
      {"length past int32", "int32",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.prefix_lens[any_request(g)] = INT32_MAX; }},
      {"page shared without declaration", "also used by request",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.page_tables[1][0] = b.page_tables[0][0]; }},
      {"shared page that would be written", "would be written",
       [&](Batch& b, LayerInputs&, testing::Rng& g) {
         b.shared_prefix_pages = true;
         b.page_tables[2][1] = b.page_tables[0][2];  // request 0 writes positions 32..39 there
       }},
      {"page listed twice", "listed twice",
       [&](Batch& b, LayerInputs&, testing::Rng& g) {
         auto& t = b.page_tables[0];
         t[1] = t[0];
       }},
      {"fewer extend_lens than requests", "extend_lens",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.extend_lens.pop_back(); }},
      {"fewer page tables than requests", "page_tables",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.page_tables.pop_back(); }},
      {"no requests", "at least one request",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b = Batch{}; }},
      {"decode with several new tokens", "decode expects 1",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.mode = ForwardMode::kDecode; }},
      {"inputs for another T", "expected shape",
       [&](Batch& b, LayerInputs&, testing::Rng& g) { b.extend_lens[any_request(g)] -= 1; }},
      {"wrong dtype", "expected dtype",
       [&](Batch&, LayerInputs& in, testing::Rng& g) {
         TensorView* v = input_view(in, int(g.randint(0, 6))).first;
         v->dtype = v->dtype == DType::kF32 ? DType::kBF16 : DType::kF32;
       }},
      {"wrong inner extent", "expected shape",
       [&](Batch&, LayerInputs& in, testing::Rng& g) {
         TensorView* v = input_view(in, int(g.randint(0, 6))).first;
         v->shape[size_t(v->ndim - 1)] -= 1;
       }},
      {"not contiguous", "contiguous",
       [&](Batch&, LayerInputs& in, testing::Rng& g) {
         input_view(in, int(g.randint(0, 6))).first->stride[0] += 1;
       }},
      {"null data", "null data",
       [&](Batch&, LayerInputs& in, testing::Rng& g) {
         input_view(in, int(g.randint(0, 6))).first->data = nullptr;
       }},
      {"tensor on another device", "tensor, got a",
       [&](Batch&, LayerInputs& in, testing::Rng& g) {
         TensorView* v = input_view(in, int(g.randint(0, 6))).first;
         v->device = v->device == Device::kCpu ? Device::kCuda : Device::kCpu;
       }},
  };

  for (int trial = 0; trial < 48; ++trial) {
    const Breakage& br = breakages[size_t(rng.randint(0, int64_t(breakages.size()) - 1))];
    Batch b = good_batch();
    LayerInputs in = inputs.view();
    const LayerInputs clean = in;
    br.apply(b, in, rng);
    // Tensor breakages must be reported under the broken tensor's name.
    std::string name;
    for (int i = 0; i < 7; ++i) {
      LayerInputs a = in, c = clean;
      if (!same_view(*input_view(a, i).first, *input_view(c, i).first))
        name = input_view(c, i).second;
    }
    try {
      rig.layer->forward(b, in);
      ADD_FAILURE() << br.what << ": expected an error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << br.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(br.needle), std::string::npos)
          << br.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << br.what << ": " << e.what();
    }
    ASSERT_EQ(rig.pool_checksum(), before) << br.what;
  }
  EXPECT_NO_THROW(rig.layer->forward(good_batch(), inputs.view()));  // the layer still works
  EXPECT_NE(rig.pool_checksum(), before);
}

// a call over LayerOptions::max_workspace_bytes fails with kResource before any write; the
// same call at exactly its estimate runs.
TEST_P(HostileTest, WorkspaceLimitRefusesBeforeAnyWrite) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<int32_t> lengths = {50, 20};
  for (DispatchMode mode : {DispatchMode::kDense, DispatchMode::kSparse}) {
    SCOPED_TRACE(to_string(mode));
    LayerOptions o;
    o.policy.mode = mode;
    o.policy.allow_approximation = true;
    Rig probe(small_model(), GetParam(), KvLayout::kBf16, lengths, seed, o);
    Batch b;
    b.prefix_lens = {0, 0};
    b.extend_lens = lengths;
    b.page_tables = probe.tables;
    const AttentionPath path = probe.layer->plan(b).path;
    const int64_t need = probe.layer->workspace_bytes(b, path);
    // At least the outputs and the path's largest intermediates.
    const auto& c = probe.cfg;
    const int64_t t = 70;
    EXPECT_GT(need, t * c.num_heads * c.v_head_dim * 2 + t * c.num_heads * 4);
    if (path == AttentionPath::kDenseMha)
      EXPECT_GT(need, int64_t(70) * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim) * 2);
    else
      EXPECT_GT(need, int64_t(70) * c.num_heads * c.kv_lora_rank * 2 * 2);
    b.extend_lens = {50, 10};
    EXPECT_LT(probe.layer->workspace_bytes(b, path), need) << "fewer tokens, less workspace";
    b.extend_lens = lengths;

    o.max_workspace_bytes = need - 1;
    Rig tight(small_model(), GetParam(), KvLayout::kBf16, lengths, seed, o);
    const auto in = tight.tokens.slice(*tight.be, all_rows(70));
    const uint64_t before = tight.pool_checksum();
    try {
      tight.layer->forward(b, in.view());
      ADD_FAILURE() << "expected a workspace error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kResource);
      EXPECT_NE(std::string(e.what()).find("max_workspace_bytes"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::to_string(need)), std::string::npos) << e.what();
    }
    EXPECT_EQ(tight.pool_checksum(), before);

    o.max_workspace_bytes = need;
    Rig exact(small_model(), GetParam(), KvLayout::kBf16, lengths, seed, o);
    const LayerResult r =
        exact.layer->forward(b, exact.tokens.slice(*exact.be, all_rows(70)).view());
    EXPECT_EQ(r.o.size(0), 70);
  }
  LayerOptions negative;
  negative.max_workspace_bytes = -1;
  try {
    Rig bad(small_model(), GetParam(), KvLayout::kBf16, lengths, seed, negative);
    ADD_FAILURE() << "expected an error for a negative limit";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_workspace_bytes"), std::string::npos) << e.what();
  }
}

// top-k entries that are -1, negative, at or past the token's context (including offsets
// that would land in the next request's locations) or past the pool are skipped: pool rows they
// would reach hold NaN, and the result equals the reference over the valid entries alone.
TEST_P(HostileTest, InvalidTopkEntriesAreSkippedNeverRead) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  testing::Rng rng(seed);
  auto be = make_backend(GetParam());
  const ModelConfig c = small_model();
  const int h = c.num_heads, d_c = c.kv_lora_rank, d_r = c.qk_rope_head_dim, k = 24;
  const int d_qk = d_c + d_r;
  // Two requests of 12 and 20 positions on pages of 4: request 0 on pages 0-2, request 1 on 3-7.
  KvPoolDesc kd;
  kd.layout = KvLayout::kBf16;
  kd.page_size = 4;
  kd.num_pages = 8;
  kd.d_c = d_c;
  kd.d_rope = d_r;
  PagedKvPool pool = be->make_kv_pool(kd);
  const int64_t n_loc = kd.num_locations();
  const int len0 = 12;
  Tensor c_kv = testing::random_tensor(rng, DType::kBF16, {n_loc, d_c}, 0.5f);
  Tensor k_pe = testing::random_tensor(rng, DType::kBF16, {n_loc, d_r});
  // Request 1's rows (locations 12..31) are NaN: any read of them shows in the output.
  for (int64_t loc = len0; loc < n_loc; ++loc) {
    for (int j = 0; j < d_c; ++j) c_kv.ptr<bf16_t>()[loc * d_c + j] = bf16_t{0x7FC0};
    for (int j = 0; j < d_r; ++j) k_pe.ptr<bf16_t>()[loc * d_r + j] = bf16_t{0x7FC0};
  }
  std::vector<int32_t> all(static_cast<size_t>(n_loc));
  for (int32_t i = 0; i < n_loc; ++i) all[size_t(i)] = i;
  const Tensor all_host = Tensor::host(DType::kI32, {n_loc});
  std::copy(all.begin(), all.end(), all_host.ptr<int32_t>());
  be->store_kv(pool, be->to_device(all_host), be->to_device(c_kv), be->to_device(k_pe));

  // Tokens of request 0 at positions 5..11 (ctx 6..12); kv_locs lists request 0 then request 1.
  const int t = 7;
  std::vector<int32_t> kv_locs(all.begin(), all.begin() + 32), kv_start(t, 0), ctx_len(t);
  for (int i = 0; i < t; ++i) ctx_len[size_t(i)] = 6 + i;
  Tensor positions = Tensor::host(DType::kI32, {t, k});
  std::vector<int32_t> valid(size_t(t) * k, -1);  // the entries a kernel may read, else -1
  const int32_t hostile[] = {-1, -2, INT32_MIN, INT32_MAX, 31, 1 << 20};
  for (int i = 0; i < t; ++i)
    for (int j = 0; j < k; ++j) {
      const int32_t ctx = ctx_len[size_t(i)];
      int32_t p;
      switch (rng.randint(0, 3)) {
        case 0:  // valid
          p = int32_t(rng.randint(0, ctx - 1));
          valid[size_t(i) * k + j] = p;  // location == position for request 0
          break;
        case 1:  // just past the context: request 0's own later (unwritten-yet) positions
          p = int32_t(rng.randint(ctx, len0 - 1 < ctx ? ctx : len0 - 1));
          break;
        case 2:  // lands in request 1's range of kv_locs
          p = int32_t(rng.randint(len0, 31));
          break;
        default:
          p = hostile[rng.randint(0, 5)];
      }
      positions.ptr<int32_t>()[i * k + j] = p;
    }
  const auto i32 = [&](const std::vector<int32_t>& v) {
    Tensor x = Tensor::host(DType::kI32, {int64_t(v.size())});
    std::copy(v.begin(), v.end(), x.ptr<int32_t>());
    return be->to_device(x);
  };
  const Tensor d_kv_locs = i32(kv_locs), d_start = i32(kv_start), d_ctx = i32(ctx_len);
  const Tensor locs = be->empty(DType::kI32, {t, k});
  be->poison(locs);
  be->positions_to_locations(be->to_device(positions), d_kv_locs, d_start, d_ctx, locs);
  const Tensor locs_host = be->to_host(locs);
  for (int64_t i = 0; i < int64_t(t) * k; ++i) {
    const int32_t want = valid[size_t(i)];
    ASSERT_EQ(locs_host.ptr<int32_t>()[i], want)
        << "entry " << i << " position " << positions.ptr<int32_t>()[i];
  }

  // The same locations with their -1s replaced by raw hostile locations: past the pool,
  // negative, INT32_MIN. Both must give the reference over the valid entries.
  Tensor raw = Tensor::host(DType::kI32, {t, k});
  for (int64_t i = 0; i < int64_t(t) * k; ++i)
    raw.ptr<int32_t>()[i] = valid[size_t(i)] >= 0 ? valid[size_t(i)]
                            : rng.randint(0, 1)   ? int32_t(rng.randint(n_loc, INT32_MAX))
                                                  : int32_t(rng.randint(INT32_MIN, -1));
  const DType mid = be->capabilities().intermediate_dtype;
  const Tensor q_abs_host = testing::random_tensor(rng, mid, {t, h, d_c});
  const Tensor q_pe_host = testing::random_tensor(rng, mid, {t, h, d_r});
  reference::Vec q(size_t(t) * h * d_qk), kv(size_t(n_loc) * d_qk);
  const auto qa = testing::to_double(q_abs_host), qp = testing::to_double(q_pe_host);
  for (int64_t r = 0; r < int64_t(t) * h; ++r) {
    std::copy_n(qa.begin() + r * d_c, d_c, q.begin() + r * d_qk);
    std::copy_n(qp.begin() + r * d_r, d_r, q.begin() + r * d_qk + d_c);
  }
  const auto cv = testing::to_double(c_kv), kp = testing::to_double(k_pe);
  for (int64_t l = 0; l < n_loc; ++l) {
    std::copy_n(cv.begin() + l * d_c, d_c, kv.begin() + l * d_qk);
    std::copy_n(kp.begin() + l * d_r, d_r, kv.begin() + l * d_qk + d_c);
  }
  const double scale = c.softmax_scale();
  const auto ref =
      reference::sparse_attention(q, kv, t, h, d_qk, d_c, n_loc, valid, k, nullptr, scale);
  const double tol = mid == DType::kF32 ? testing::kTolF32 : testing::kTolBf16;
  for (const bool is_raw : {false, true}) {
    SCOPED_TRACE(is_raw ? "raw hostile locations" : "positions_to_locations output");
    SparseMlaArgs a;
    const Tensor q_abs = be->to_device(q_abs_host), q_pe = be->to_device(q_pe_host);
    a.q_abs = q_abs;
    a.q_pe = q_pe;
    a.kv = &pool;
    const Tensor idx = is_raw ? be->to_device(raw) : locs;
    a.indices = idx;
    a.sm_scale = scale;
    const Tensor o_lat = be->empty(mid, {t, h, d_c}), lse = be->empty(DType::kF32, {t, h});
    be->poison(o_lat);
    be->poison(lse);
    a.o_lat = o_lat;
    a.lse = lse;
    be->sparse_mla(a);
    const auto o = testing::to_double(be->to_host(o_lat));
    const auto l = testing::to_double(be->to_host(lse));
    EXPECT_LE(testing::rel_l2(o, ref.o), tol);
    EXPECT_LE(testing::max_abs_diff(l, ref.lse), testing::kTolLse);
  }
}

// NaN or ±Inf in any input of request 0 leaves request 1's outputs bit-identical, on both
// paths; a poisoned query row gives a non-finite output instead of a crash.
TEST_P(HostileTest, NonFiniteInputsStayInTheirRequest) {
  const std::vector<int32_t> lengths = {40, 30};
  const char* names[] = {"q_nope", "q_pe", "c_kv", "k_pe", "idx_q", "idx_k", "idx_w"};
  for (DispatchMode mode : {DispatchMode::kDense, DispatchMode::kSparse}) {
    const uint64_t seed = fresh_seed();
    testing::Rng rng(seed);
    const int which = int(rng.randint(0, 6));
    const float bad = std::array<float, 3>{
        std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}[rng.randint(0, 2)];
    SCOPED_TRACE(::testing::Message()
                 << to_string(mode) << " " << names[which] << " = " << bad << " seed " << seed);
    LayerOptions o;
    o.policy.mode = mode;
    o.policy.allow_approximation = true;
    o.output_dtype = DType::kBF16;
    Rig clean(small_model(), GetParam(), KvLayout::kBf16, lengths, seed, o);
    Rig dirty(small_model(), GetParam(), KvLayout::kBf16, lengths, seed, o);
    Tensor* tensors[] = {&dirty.tokens.q_nope, &dirty.tokens.q_pe,  &dirty.tokens.c_kv,
                         &dirty.tokens.k_pe,   &dirty.tokens.idx_q, &dirty.tokens.idx_k,
                         &dirty.tokens.idx_w};
    Tensor& target = *tensors[which];
    const int64_t per_row = target.numel() / 70;
    const int64_t row = rng.randint(0, 39);  // request 0
    const int64_t i = row * per_row + rng.randint(0, per_row - 1);
    if (target.dtype() == DType::kBF16)
      target.ptr<bf16_t>()[i] = f32_to_bf16(bad);
    else
      target.ptr<float>()[i] = bad;
    const RunSchedule all{clean.zeros(), lengths, 0, ForwardMode::kExtend};
    const RunOutputs a = clean.run(all), b = dirty.run(all);
    EXPECT_TRUE(bitwise_equal(request_outputs(a, lengths, 1), request_outputs(b, lengths, 1)))
        << "request 1 changed";
    if (which <= 1 && std::isnan(bad)) {  // a NaN query: its row's o holds NaN
      const int64_t od = a.o.numel() / 70;
      bool finite = true;
      for (int64_t j = 0; j < od; ++j) finite &= std::isfinite(b.o.ptr<float>()[row * od + j]);
      EXPECT_FALSE(finite) << "row " << row;
    }
  }
}

// Two layers on two threads over separate pools give bit-identical results to the same two
// layers run one after the other (no shared mutable state between layers or backends).
TEST_P(HostileTest, TwoLayersOnTwoThreadsMatchSequential) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const std::vector<int32_t> len_a = {60, 25}, len_b = {45};
  struct Job {
    KvLayout layout;
    std::vector<int32_t> lengths;
    int chunk;
    uint64_t seed;
  };
  const Job jobs[] = {{KvLayout::kFp8Scaled, len_a, 20, seed},
                      {KvLayout::kBf16, len_b, 0, seed + 7}};
  const auto run_job = [&](const Job& j) {
    Rig rig(small_model(), GetParam(), j.layout, j.lengths, j.seed);
    RunOutputs out = rig.run({rig.zeros(), j.lengths, j.chunk, ForwardMode::kExtend});
    std::vector<double> v;
    for (int r = 0; r < int(j.lengths.size()); ++r) {
      const auto x = request_outputs(out, j.lengths, r);
      v.insert(v.end(), x.begin(), x.end());
    }
    for (int64_t i = 0; i < out.topk.numel(); ++i) v.push_back(out.topk.ptr<int32_t>()[i]);
    return v;
  };
  const std::vector<double> seq_a = run_job(jobs[0]), seq_b = run_job(jobs[1]);
  for (int round = 0; round < 2; ++round) {
    std::vector<double> par_a, par_b;
    std::thread ta([&] { par_a = run_job(jobs[0]); });
    std::thread tb([&] { par_b = run_job(jobs[1]); });
    ta.join();
    tb.join();
    EXPECT_TRUE(bitwise_equal(seq_a, par_a)) << "round " << round << ": layer A differs";
    EXPECT_TRUE(bitwise_equal(seq_b, par_b)) << "round " << round << ": layer B differs";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, HostileTest, ::testing::ValuesIn(testing::test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dsakit
