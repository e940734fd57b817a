// The layer end to end on every backend under test (docs/design.md#equivalence, docs/layer.md,
// docs/reliability.md): dense == sparse where exact, chunked == one-shot (with a path switch),
// prefix hit == fresh, decode, DCP == single rank, agreement with the float64 layer reference,
// and rejected calls that leave the pools untouched.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <stdexcept>
#include <thread>

#include "dsakit/cost_model.h"
#include "dsakit/dcp.h"
#include "dsakit/driver.h"
#include "dsakit/error.h"
#include "src/layer/paths.h"
#include "src/reference/layer_reference.h"
#include "tests/common/test_util.h"
#include "tools/harness.h"

namespace dsakit {
namespace {

using testing::fresh_seed;

ModelConfig small_topk(ModelConfig c, int k) {
  c.index_topk = k;
  return c;
}

// One layer over fresh pools, with deterministic inputs for `lengths`.
struct Harness {
  ModelConfig cfg;
  std::unique_ptr<Backend> be;
  KvPoolDesc kd;
  PagedKvPool kv;
  IndexKeyPool ix;
  Tensor w_host, w;
  Tensor w_codes, w_scales;  // fp8_weights: kv_b_proj's FP8 form (LayerOptions::kv_b_proj_fp8)
  TokenStore tokens;
  std::vector<std::vector<int32_t>> tables;
  std::unique_ptr<DsaAttention> layer;

  Harness(const ModelConfig& c, const std::string& backend, KvLayout layout, int page_size,
          const std::vector<int32_t>& lengths, uint64_t seed, DispatchMode mode,
          DType out = DType::kF32, bool fp8_weights = false)
      : cfg(c), be(make_backend(backend)) {
    // f32 outputs where the backend computes in f32 (CPU); bf16 elsewhere (RunOutputs widens).
    if (be->capabilities().intermediate_dtype != DType::kF32) out = DType::kBF16;
    kd.layout = layout;
    kd.page_size = page_size;
    kd.d_c = c.kv_lora_rank;
    kd.d_rope = c.qk_rope_head_dim;
    int64_t pages = 2;
    for (int32_t l : lengths) pages += (l + page_size - 1) / page_size;
    kd.num_pages = pages;
    kv = be->make_kv_pool(kd);
    ix = be->make_index_pool({page_size, pages, c.index_head_dim});
    LayerOptions o;
    if (fp8_weights) {
      const Fp8KvBProj fp8 = random_fp8_kv_b_proj(c, seed + 1);
      w_host = fp8.bf16;
      w_codes = be->to_device(fp8.codes);
      w_scales = be->to_device(fp8.scales);
      o.kv_b_proj_fp8 = {w_codes, w_scales};
    } else {
      w_host = random_kv_b_proj(c, seed + 1);
    }
    w = be->to_device(w_host);
    tokens = random_token_store(c, lengths, seed);
    tables = allocate_pages(lengths, page_size, pages, seed + 2);
    o.output_dtype = out;
    o.policy.mode = mode;
    layer = std::make_unique<DsaAttention>(c, *be, kv, ix, w, o);
  }

  RunOutputs run(const std::vector<RunSchedule>& schedules) {
    RunOutputs out;
    for (const auto& s : schedules) run_schedule(*layer, tables, tokens, s, out);
    return out;
  }
  std::vector<int32_t> zeros() const { return std::vector<int32_t>(tokens.lengths.size(), 0); }
  uint64_t pool_checksum() {
    return testing::checksum(be->to_host(kv.storage())) ^
           (testing::checksum(be->to_host(ix.storage())) * 31);
  }
};

// rel-L2 over the rows both runs computed (rows in `mask`), and max |lse| difference.
struct Diff {
  double o_rel = 0, lse_abs = 0;
  int64_t rows = 0;
};
Diff compare(const RunOutputs& a, const RunOutputs& b, const std::vector<uint8_t>& mask) {
  const int64_t rows = int64_t(a.ran.size());
  const int64_t od = a.o.numel() / rows, ld = a.lse.numel() / rows;
  std::vector<double> x, y, lx, ly;
  Diff d;
  for (int64_t r = 0; r < rows; ++r) {
    if (!mask[size_t(r)]) continue;
    ++d.rows;
    for (int64_t j = 0; j < od; ++j) {
      x.push_back(a.o.ptr<float>()[r * od + j]);
      y.push_back(b.o.ptr<float>()[r * od + j]);
    }
    for (int64_t j = 0; j < ld; ++j) {
      lx.push_back(a.lse.ptr<float>()[r * ld + j]);
      ly.push_back(b.lse.ptr<float>()[r * ld + j]);
    }
  }
  d.o_rel = testing::rel_l2(x, y);
  d.lse_abs = testing::max_abs_diff(lx, ly);
  return d;
}

std::vector<uint8_t> both(const RunOutputs& a, const RunOutputs& b) {
  std::vector<uint8_t> m(a.ran.size());
  for (size_t i = 0; i < m.size(); ++i) m[i] = a.ran[i] && b.ran[i];
  return m;
}

const std::vector<KvLayout> kLayouts = {KvLayout::kBf16, KvLayout::kFp8Scaled, KvLayout::kFp8Raw};

bool bf16_mid(const Harness& h) {
  return h.be->capabilities().intermediate_dtype == DType::kBF16;
}
// Output bound for f32 outputs: 1e-5 with f32 intermediates (CPU), the bf16 bound otherwise.
double tol_f32(const Harness& h) {
  return bf16_mid(h) ? testing::kTolBf16 : testing::kTolF32;
}
// lse bound between two runs that may round at different points (dense vs sparse): with bf16
// intermediates the up-projected K (dense) and the absorbed q (sparse) each carry a relative
// rounding of 2^-9 per element, i.e. score noise of std ~sm_scale·2^-9·sqrt(d)·|q||k|/sqrt(3)
// (~2.4e-3 for DeepSeek-V3.2); over thousands of (token, head) rows the largest lse difference
// reaches ~6 sigma, hence 3e-2 (docs/numerics.md). The CPU backend (f32) keeps 1e-3.
double tol_lse_across_paths(const Harness& h) {
  return bf16_mid(h) ? reference::kLseBoundAcrossPaths : testing::kTolLse;
}

// Every computed token of `out` (two requests of lengths `len`) against the float64 layer
// reference over h's pools and weights; dense-path rows attend to all positions, and rows of the
// masked-MHA form take the reference's dense arithmetic over their top-k.
void expect_matches_reference(Harness& h, const RunOutputs& out, const std::vector<int32_t>& len) {
  const ModelConfig& c = h.cfg;
  const Tensor kv_host = h.be->to_host(h.kv.storage()), ix_host = h.be->to_host(h.ix.storage());
  reference::LayerSnapshot snap{
      &c,
      h.layer->sm_scale(),
      len,
      h.tokens.q_nope,
      h.tokens.q_pe,
      h.tokens.idx_q,
      h.tokens.idx_w,
      h.w_host,
      h.kd,
      kv_host,
      h.ix.desc(),
      ix_host,
      h.tables,
      bf16_mid(h),
      detail::fp8_up_proj_weights(*h.be, h.kv, h.layer->options()) != nullptr,
      {}};  // kv_b_proj_dense: the tests' FP8 weights have pow2 block scales (kv_b_proj exact)
  std::vector<reference::TokenQuery> qs;
  std::vector<int64_t> rows;
  for (const auto& st : out.steps)
    for (int64_t row : st.rows) {
      const int r = row < len[0] ? 0 : 1;
      const bool dense = st.plan.path == AttentionPath::kDenseMha;
      qs.push_back({r, int32_t(row - (r ? len[0] : 0)), dense,
                    dense || st.plan.sparse_form == SparseForm::kMaskedMha});
      rows.push_back(row);
    }
  const auto ref = reference::layer_outputs(snap, qs);
  std::vector<double> got, got_lse;
  for (int64_t row : rows) {
    for (int64_t j = 0; j < c.num_heads * c.v_head_dim; ++j)
      got.push_back(out.o.ptr<float>()[row * c.num_heads * c.v_head_dim + j]);
    for (int64_t j = 0; j < c.num_heads; ++j)
      got_lse.push_back(out.lse.ptr<float>()[row * c.num_heads + j]);
  }
  EXPECT_LE(testing::rel_l2(got, ref.o), tol_f32(h));
  EXPECT_LE(testing::max_abs_diff(got_lse, ref.lse), reference::lse_bound(snap));
}

class LayerTest : public ::testing::TestWithParam<std::string> {};

// docs/design.md#equivalence: with every L_r <= index_topk, sparse MLA and dense MHA compute the
// same function.
TEST_P(LayerTest, DenseEqualsSparseWhenContextsFitTopk) {
  struct Case {
    const char* preset;
    int tp;
  };
  for (Case cs :
       {Case{"deepseek-v3.2", 8}, Case{"deepseek-v3.2", 1}, Case{"glm-5", 4}, Case{"glm-5", 1}}) {
    for (KvLayout layout : kLayouts) {
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE(::testing::Message()
                   << cs.preset << " tp" << cs.tp << " " << to_string(layout) << " seed " << seed);
      const ModelConfig c = ModelConfig::preset(cs.preset).with_tp(cs.tp);
      const std::vector<int32_t> len = {71, 33};
      Harness dense(c, GetParam(), layout, 16, len, seed, DispatchMode::kDense);
      Harness sparse(c, GetParam(), layout, 16, len, seed, DispatchMode::kSparse);
      const RunSchedule all{dense.zeros(), len, 0, ForwardMode::kExtend};
      const RunOutputs a = dense.run({all}), b = sparse.run({all});
      EXPECT_EQ(a.steps[0].plan.path, AttentionPath::kDenseMha);
      EXPECT_EQ(b.steps[0].plan.path, AttentionPath::kSparseMla);
      const Diff d = compare(a, b, both(a, b));
      EXPECT_EQ(d.rows, 104);
      EXPECT_LE(d.o_rel, tol_f32(dense));
      EXPECT_LE(d.lse_abs, tol_lse_across_paths(dense));
    }
  }
}

// docs/layer.md: chunking does not change any token's result, on either path and across a path
// switch.
TEST_P(LayerTest, ChunkedEqualsOneShot) {
  for (KvLayout layout : {KvLayout::kBf16, KvLayout::kFp8Scaled}) {
    for (DispatchMode mode : {DispatchMode::kRule, DispatchMode::kDense, DispatchMode::kSparse}) {
      const uint64_t seed = fresh_seed();
      testing::Rng rng(seed);
      const int chunk = int(rng.randint(5, 45));
      SCOPED_TRACE(::testing::Message() << to_string(layout) << " " << to_string(mode) << " chunk "
                                        << chunk << " seed " << seed);
      // index_topk 64 so the sparse path really selects (contexts reach 150); forced dense needs
      // exactness, so it runs with the full top-k.
      const ModelConfig base = ModelConfig::preset("deepseek-v3.2").with_tp(8);
      const ModelConfig c = mode == DispatchMode::kDense ? base : small_topk(base, 64);
      const std::vector<int32_t> len = {150, 90};
      Harness one(c, GetParam(), layout, 64, len, seed, mode);
      Harness chunked(c, GetParam(), layout, 64, len, seed, mode);
      const RunOutputs a = one.run({{one.zeros(), len, 0, ForwardMode::kExtend}});
      const RunOutputs b = chunked.run({{chunked.zeros(), len, chunk, ForwardMode::kExtend}});
      const Diff d = compare(a, b, both(a, b));
      EXPECT_EQ(d.rows, 240);
      EXPECT_LE(d.o_rel, tol_f32(one));
      EXPECT_LE(d.lse_abs, tol_lse_across_paths(one));
      if (mode == DispatchMode::kRule) {  // the first chunk is dense, the later ones sparse
        EXPECT_EQ(b.steps.front().plan.path, AttentionPath::kDenseMha);
        EXPECT_EQ(b.steps.back().plan.path, AttentionPath::kSparseMla);
      }
      // The same positions are selected however the prompt was split.
      if (mode == DispatchMode::kDense) continue;
      for (int64_t i = 0; i < a.topk.numel(); ++i) {
        const int64_t row = i / c.index_topk;
        const int32_t pos = int32_t(row < len[0] ? row : row - len[0]);
        if (pos + 1 <= c.index_topk) continue;  // only rows the sparse path computed in both runs
        ASSERT_EQ(a.topk.ptr<int32_t>()[i], b.topk.ptr<int32_t>()[i]) << "row " << row;
      }
    }
  }
}

// Cost mode may split a batch into runs of requests on different paths
// (docs/dispatch.md#cost-mode): each run computes exactly what the whole batch through one path
// would, dense rows carry no top-k, sparse rows do.
TEST_P(LayerTest, CostModeSplitPlanMatchesAWholeBatchPath) {
  for (KvLayout layout : {KvLayout::kBf16, KvLayout::kFp8Scaled}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(layout) << " seed " << seed);
    const ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
    // r0 and r2 fresh, r1 a short extend on a cached prefix: a profile where dense pays per
    // position re-read and sparse per new token splits it dense | sparse | dense.
    const std::vector<int32_t> len = {120, 300, 90}, prefix = {0, 280, 0};
    Harness cost(c, GetParam(), layout, 16, len, seed, DispatchMode::kCost);
    Harness dense(c, GetParam(), layout, 16, len, seed, DispatchMode::kDense);
    auto profile = std::make_shared<CostProfile>();
    CostEntry e;
    e.key = CostKey::of(cost.be->capabilities().device_name, c, layout);
    auto terms = [](AttentionPath path, const std::string& name, double per) {
      CostTerms t;
      t.names = cost_terms(path);
      for (const auto& n : t.names) t.coef_ms.push_back(n == name ? per : n == "1" ? 0.1 : 0.0);
      return t;
    };
    e.dense = terms(AttentionPath::kDenseMha, "N", 1e-3);
    e.sparse = terms(AttentionPath::kSparseMla, "T", 4e-3);
    profile->entries.push_back(e);
    DispatchPolicy pol;
    pol.mode = DispatchMode::kCost;
    pol.profile = profile;
    pol.min_split_gain = 0;  // the split is predicted 3% cheaper than whole-batch dense
    cost.layer->set_policy(pol);
    // The prefix of r1 goes in first (a dense call), then the batch.
    const RunSchedule warm{cost.zeros(), prefix, 0, ForwardMode::kExtend};
    const RunSchedule rest{prefix, len, 0, ForwardMode::kExtend};
    const RunOutputs a = cost.run({warm, rest}), b = dense.run({warm, rest});
    const StepRecord& step = a.steps.back();
    ASSERT_EQ(step.plan.path, AttentionPath::kMixed) << step.plan.reason;
    ASSERT_EQ(step.plan.segments.size(), 3u) << step.plan.reason;
    EXPECT_EQ(step.plan.path_of(1), AttentionPath::kSparseMla);
    const Diff d = compare(a, b, both(a, b));
    EXPECT_EQ(d.rows, 120 + 300 + 90);
    EXPECT_LE(d.o_rel, tol_f32(cost));
    EXPECT_LE(d.lse_abs, tol_lse_across_paths(cost));
    // Top-k rows: the sparse run's select every visible position (context <= index_topk),
    // the dense runs' hold -1.
    const int k = c.index_topk;
    for (int64_t row : step.rows) {
      const int32_t* t = a.topk.ptr<int32_t>() + row * k;
      const bool in_r1 = row >= len[0] && row < len[0] + len[1];
      const int64_t ctx = in_r1 ? row - len[0] + 1 : 0;
      for (int j = 0; j < k; ++j) {
        const int32_t want = in_r1 && j < ctx ? j : -1;
        ASSERT_EQ(t[j], want) << "row " << row << " slot " << j;
      }
    }
  }
}

// A prefix already in the pool (an earlier call) gives the same result as a fresh prompt.
TEST_P(LayerTest, PrefixHitEqualsFreshPrompt) {
  for (KvLayout layout : kLayouts) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(layout) << " seed " << seed);
    const ModelConfig c = small_topk(ModelConfig::preset("glm-5").with_tp(4), 64);
    const std::vector<int32_t> len = {130, 77}, prefix = {100, 13};
    Harness fresh(c, GetParam(), layout, 1, len, seed, DispatchMode::kRule);
    Harness hit(c, GetParam(), layout, 1, len, seed, DispatchMode::kRule);
    const RunOutputs a = fresh.run({{fresh.zeros(), len, 0, ForwardMode::kExtend}});
    RunOutputs b;
    run_schedule(*hit.layer, hit.tables, hit.tokens, {hit.zeros(), prefix, 0, ForwardMode::kExtend},
                 b);
    std::fill(b.ran.begin(), b.ran.end(), 0);
    run_schedule(*hit.layer, hit.tables, hit.tokens, {prefix, len, 0, ForwardMode::kExtend}, b);
    const Diff d = compare(a, b, both(a, b));
    EXPECT_EQ(d.rows, 30 + 64);
    EXPECT_LE(d.o_rel, tol_f32(fresh));
    EXPECT_LE(d.lse_abs, tol_lse_across_paths(fresh));
  }
}

// The dense path skips its gather exactly when the pool would return the inputs bit for bit
// (bf16 pool, bf16 intermediates, no cached prefix), and both ways agree with the sparse path.
TEST_P(LayerTest, DenseGathersUnlessThePoolReturnsTheInputs) {
  for (KvLayout layout : kLayouts) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(layout) << " seed " << seed);
    const ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
    const std::vector<int32_t> len = {90, 41}, prefix = {70, 0};
    Harness dense(c, GetParam(), layout, 16, len, seed, DispatchMode::kDense);
    Harness sparse(c, GetParam(), layout, 16, len, seed, DispatchMode::kSparse);
    LayerOptions o;
    o.output_dtype = bf16_mid(dense) ? DType::kBF16 : DType::kF32;
    o.policy.mode = DispatchMode::kDense;
    o.time_stages = true;
    dense.layer = std::make_unique<DsaAttention>(c, *dense.be, dense.kv, dense.ix, dense.w, o);
    // Step 0: fresh prompts up to `prefix` (request 1 has none yet); step 1: the rest over the
    // cached prefix of request 0.
    RunOutputs a, b;
    for (const RunSchedule& s : {RunSchedule{dense.zeros(), prefix, 0, ForwardMode::kExtend},
                                 RunSchedule{prefix, len, 0, ForwardMode::kExtend}}) {
      run_schedule(*dense.layer, dense.tables, dense.tokens, s, a);
      run_schedule(*sparse.layer, sparse.tables, sparse.tokens, s, b);
    }
    ASSERT_EQ(a.steps.size(), 2u);
    const bool bf16_inputs = layout == KvLayout::kBf16 && bf16_mid(dense);
    for (size_t i = 0; i < 2; ++i) {
      const auto& st = a.steps[i].stages;
      EXPECT_EQ(a.steps[i].plan.path, AttentionPath::kDenseMha);
      const bool gathered =
          std::any_of(st.begin(), st.end(), [](const StageTime& x) { return x.stage == "gather"; });
      EXPECT_EQ(gathered, !(bf16_inputs && i == 0)) << "step " << i;
    }
    const Diff d = compare(a, b, both(a, b));
    EXPECT_EQ(d.rows, 131);
    EXPECT_LE(d.o_rel, tol_f32(dense));
    EXPECT_LE(d.lse_abs, tol_lse_across_paths(dense));
  }
}

bool has_stage(const StepRecord& step, const char* name) {
  return std::any_of(step.stages.begin(), step.stages.end(),
                     [&](const StageTime& x) { return x.stage == name; });
}

// The same three schedules through x (into a) and y (into b): positions up to `prefix` (a cached
// prefix), then up to `prompt`, then one decode step up to `len`.
void run_prefix_prompt_decode(Harness& x, Harness& y, const std::vector<int32_t>& prefix,
                              const std::vector<int32_t>& prompt, const std::vector<int32_t>& len,
                              RunOutputs& a, RunOutputs& b) {
  for (const RunSchedule& s : {RunSchedule{x.zeros(), prefix, 0, ForwardMode::kExtend},
                               RunSchedule{prefix, prompt, 0, ForwardMode::kExtend},
                               RunSchedule{prompt, len, 1, ForwardMode::kDecode}}) {
    run_schedule(*x.layer, x.tables, x.tokens, s, a);
    run_schedule(*y.layer, y.tables, y.tokens, s, b);
  }
}

// h's layer remade on the sparse dispatch with stage times, `rows` and `form`.
void use_sparse_layer(Harness& h, SparseRows rows, SparseForm form = SparseForm::kMla) {
  LayerOptions o;
  o.output_dtype = bf16_mid(h) ? DType::kBF16 : DType::kF32;
  o.policy.mode = DispatchMode::kSparse;
  o.time_stages = true;
  o.sparse_rows = rows;
  o.sparse_form = form;
  h.layer = std::make_unique<DsaAttention>(h.cfg, *h.be, h.kv, h.ix, h.w, o);
}

// h with a fresh pool of `policy` / `k_scale` and a layer of `rows` (sparse dispatch, stage times).
void use_sparse_rows(Harness& h, ScalePolicy policy, float k_scale, SparseRows rows) {
  h.kd.scale_policy = policy;
  h.kd.k_scale = k_scale;
  h.kv = h.be->make_kv_pool(h.kd);
  use_sparse_layer(h, rows);
}

// The same schedules run through the MLA form (x into a) and the masked-MHA form (y into b): the
// same top-k, `rows` rows computed by both within the across-paths bounds, and y's outputs the
// float64 reference's (its dense arithmetic over the top-k where a step took the masked form).
void expect_forms_agree(Harness& x, Harness& y, const RunOutputs& a, const RunOutputs& b,
                        const std::vector<int32_t>& len, int64_t rows) {
  EXPECT_EQ(testing::checksum(a.topk), testing::checksum(b.topk)) << "the same selection";
  const Diff d = compare(a, b, both(a, b));
  EXPECT_EQ(d.rows, rows);
  EXPECT_LE(d.o_rel, tol_f32(x));
  EXPECT_LE(d.lse_abs, tol_lse_across_paths(x));
  expect_matches_reference(y, b, len);
}

// docs/layer.md#masked-mha: the sparse path's masked-MHA form (the top-k as dense_mha's kv_mask
// over every context row's up-projected K/V) computes the MLA form's function: over a prefix,
// chunked prefill and a decode step, the same top-k, outputs within the across-paths bounds and
// the float64 reference's values (its dense arithmetic over the top-k); its stages are the dense
// path's plus the mask, never sparse_mla; its workspace is the dense path's plus the indexer's
// and the mask's. DSAKIT_SPARSE_FORM overrides the option (a bad value names the variable).
TEST_P(LayerTest, MaskedMhaFormEqualsMla) {
  for (KvLayout layout : {KvLayout::kBf16, KvLayout::kFp8Scaled}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(layout) << " seed " << seed);
    const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 64);
    const std::vector<int32_t> prefix = {100, 0}, prompt = {150, 90}, len = {152, 92};
    Harness mla(c, GetParam(), layout, 16, len, seed, DispatchMode::kSparse);
    Harness masked(c, GetParam(), layout, 16, len, seed, DispatchMode::kSparse);
    use_sparse_layer(mla, SparseRows::kPool);
    use_sparse_layer(masked, SparseRows::kPool, SparseForm::kMaskedMha);
    RunOutputs a, b;
    run_prefix_prompt_decode(mla, masked, prefix, prompt, len, a, b);
    ASSERT_EQ(b.steps.size(), 4u);
    for (size_t i = 0; i < b.steps.size(); ++i) {
      EXPECT_TRUE(has_stage(b.steps[i], "topk_to_kv_mask")) << "step " << i;
      EXPECT_TRUE(has_stage(b.steps[i], "dense_mha")) << "step " << i;
      EXPECT_FALSE(has_stage(b.steps[i], "sparse_mla")) << "step " << i;
      EXPECT_EQ(b.steps[i].plan.path, AttentionPath::kSparseMla) << "step " << i;
    }
    EXPECT_EQ(a.ran, b.ran);
    expect_forms_agree(mla, masked, a, b, len, 244);

    const Batch& prefill = b.steps[1].batch;
    const int64_t t = prefill.num_new_tokens(), k = c.index_topk;
    const int64_t words = (prefill.max_kv_len() + 31) / 32;
    const int64_t indexer = masked.layer->workspace_bytes(prefill, AttentionPath::kSparseMla) -
                            masked.layer->workspace_bytes(prefill, AttentionPath::kDenseMha);
    EXPECT_GE(indexer, 4 * t * k + 4 * t * words) << "top-k and mask beyond the dense path's";
  }

  const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 64);
  Harness h(c, GetParam(), KvLayout::kBf16, 16, {40}, 1, DispatchMode::kSparse);
  ::setenv("DSAKIT_SPARSE_FORM", "masked-mha", 1);
  use_sparse_layer(h, SparseRows::kAuto, SparseForm::kMla);
  EXPECT_EQ(h.layer->options().sparse_form, SparseForm::kMaskedMha);
  ::setenv("DSAKIT_SPARSE_FORM", "masked", 1);
  testing::expect_error_naming([&] { use_sparse_layer(h, SparseRows::kAuto); },
                               "DSAKIT_SPARSE_FORM", ErrorKind::kInvalidArgument);
  ::unsetenv("DSAKIT_SPARSE_FORM");
  testing::expect_error_naming([&] { parse_sparse_form("masked"); }, "masked-mha",
                               ErrorKind::kInvalidArgument);
}

// SparseForm::kAuto (the default) under cost mode: the layer runs the form its plan chose, the
// cheaper one by the profile (here one whose fixed costs decide), over a prompt longer than
// index_topk; a decode step (rule 2) stays MLA; the outputs are MLA's function either way; a
// profile without masked fits keeps MLA; the workspace estimate of a sparse batch under kAuto
// covers both forms.
TEST_P(LayerTest, AutoSparseFormRunsThePlansForm) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  const KvLayout layout = KvLayout::kBf16;
  const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 64);
  const std::vector<int32_t> prompt = {150, 90}, len = {152, 92};
  // A profile whose fixed costs make `cheap` the sparse path's cheaper form (no masked fits
  // when `masked_fits` is false).
  const auto profile_for = [&](const Harness& h, SparseForm cheap, bool masked_fits) {
    CostEntry e;
    e.key = CostKey::of(h.be->capabilities().device_name, c, layout);
    const auto fixed = [](AttentionPath path, SparseForm form, double ms) {
      CostTerms t;
      t.names = cost_terms(path, form);
      for (const auto& n : t.names) t.coef_ms.push_back(n == "1" ? ms : 0.0);
      return t;
    };
    e.dense = fixed(AttentionPath::kDenseMha, SparseForm::kMla, 0.5);
    e.sparse =
        fixed(AttentionPath::kSparseMla, SparseForm::kMla, cheap == SparseForm::kMla ? 1.0 : 2.0);
    if (masked_fits)
      e.masked = fixed(AttentionPath::kSparseMla, SparseForm::kMaskedMha,
                       cheap == SparseForm::kMaskedMha ? 1.0 : 2.0);
    auto p = std::make_shared<CostProfile>();
    p->put(e);
    DispatchPolicy pol;
    pol.mode = DispatchMode::kCost;
    pol.profile = p;
    return pol;
  };
  const auto stage_names = [](const StepRecord& st) {
    std::string s;
    for (const auto& x : st.stages) s += x.stage + " ";
    return s;
  };
  Harness mla(c, GetParam(), layout, 16, len, seed, DispatchMode::kCost);
  Harness masked(c, GetParam(), layout, 16, len, seed, DispatchMode::kCost);
  Harness plain(c, GetParam(), layout, 16, len, seed, DispatchMode::kCost);
  for (Harness* h : {&mla, &masked, &plain}) {
    use_sparse_layer(*h, SparseRows::kAuto, SparseForm::kAuto);
    EXPECT_EQ(h->layer->options().sparse_form, SparseForm::kAuto);
  }
  mla.layer->set_policy(profile_for(mla, SparseForm::kMla, true));
  masked.layer->set_policy(profile_for(masked, SparseForm::kMaskedMha, true));
  plain.layer->set_policy(profile_for(plain, SparseForm::kMaskedMha, false));
  RunOutputs a, b, d;
  const std::vector<RunSchedule> steps = {{mla.zeros(), prompt, 0, ForwardMode::kExtend},
                                          {prompt, len, 1, ForwardMode::kDecode}};
  for (const RunSchedule& s : steps) {
    run_schedule(*mla.layer, mla.tables, mla.tokens, s, a);
    run_schedule(*masked.layer, masked.tables, masked.tokens, s, b);
    run_schedule(*plain.layer, plain.tables, plain.tokens, s, d);
  }
  ASSERT_EQ(b.steps.size(), 3u);  // the prompt, two decode steps
  const StepRecord& prefill = b.steps[0];
  EXPECT_EQ(prefill.plan.path, AttentionPath::kSparseMla) << prefill.plan.reason;
  EXPECT_EQ(prefill.plan.sparse_form, SparseForm::kMaskedMha) << prefill.plan.reason;
  EXPECT_NEAR(prefill.plan.predicted_masked_ms, 1.0, 1e-9);
  EXPECT_NEAR(prefill.plan.predicted_sparse_ms, 2.0, 1e-9);
  EXPECT_TRUE(has_stage(prefill, "topk_to_kv_mask")) << stage_names(prefill);
  EXPECT_FALSE(has_stage(prefill, "sparse_mla")) << stage_names(prefill);
  for (size_t i = 1; i < b.steps.size(); ++i) {
    EXPECT_EQ(b.steps[i].plan.sparse_form, SparseForm::kMla) << b.steps[i].plan.reason;
    EXPECT_TRUE(has_stage(b.steps[i], "sparse_mla")) << stage_names(b.steps[i]);
  }
  for (const RunOutputs* x : {&a, &d}) {
    EXPECT_EQ(x->steps[0].plan.sparse_form, SparseForm::kMla) << x->steps[0].plan.reason;
    EXPECT_TRUE(has_stage(x->steps[0], "sparse_mla")) << stage_names(x->steps[0]);
  }
  EXPECT_LT(d.steps[0].plan.predicted_masked_ms, 0) << "no masked fits: not priced";
  expect_forms_agree(mla, masked, a, b, len, 244);

  // kAuto keeps MLA where the masked form's workspace (every position's K/V) would exceed
  // max_workspace_bytes: two new tokens a request over the prompt's prefix.
  Batch tail = prefill.batch;
  tail.prefix_lens = {148, 88};
  tail.extend_lens = {2, 2};
  const Plan free_plan = masked.layer->plan(tail);
  ASSERT_EQ(free_plan.sparse_form, SparseForm::kMaskedMha) << free_plan.reason;
  LayerOptions capped_options = masked.layer->options();
  capped_options.max_workspace_bytes = masked.layer->workspace_bytes(tail, free_plan) - 1;
  const DsaAttention capped(c, *masked.be, masked.kv, masked.ix, masked.w, capped_options);
  const Plan capped_plan = capped.plan(tail);
  EXPECT_EQ(capped_plan.sparse_form, SparseForm::kMla) << capped_plan.reason;
  EXPECT_NE(capped_plan.reason.find("(masked-mha form over max_workspace_bytes)"),
            std::string::npos)
      << capped_plan.reason;
  EXPECT_LE(capped.workspace_bytes(tail, capped_plan), capped_options.max_workspace_bytes);

  const Batch& batch = prefill.batch;
  const int64_t auto_bytes = masked.layer->workspace_bytes(batch, AttentionPath::kSparseMla);
  use_sparse_layer(masked, SparseRows::kAuto, SparseForm::kMla);
  const int64_t mla_bytes = masked.layer->workspace_bytes(batch, AttentionPath::kSparseMla);
  use_sparse_layer(masked, SparseRows::kAuto, SparseForm::kMaskedMha);
  const int64_t masked_bytes = masked.layer->workspace_bytes(batch, AttentionPath::kSparseMla);
  EXPECT_EQ(auto_bytes, std::max(mla_bytes, masked_bytes));
  EXPECT_EQ(masked.layer->workspace_bytes(batch, prefill.plan), masked_bytes);
}

// docs/layer.md#staged-rows: the sparse path reading an FP8 pool through a bf16 copy of the
// batch's context rows reads the same values, so over chunked prefill with a cached prefix and
// decode steps it returns the same outputs as reading the pool: the same bits where the
// arithmetic is the same (the CPU), within the same-path bounds where it is not (CUDA at 16
// heads: its FP8 kernel multiplies f16 codes, per scale tile on 656-byte pools), and the float64
// reference's values either way.
TEST_P(LayerTest, StagedRowsReadThePoolsValues) {
  struct Case {
    KvLayout layout;
    ScalePolicy policy;
    float k_scale;
  };
  for (Case cs : {Case{KvLayout::kFp8Scaled, ScalePolicy::kPow2, 1.0f},
                  Case{KvLayout::kFp8Raw, ScalePolicy::kAmax, 0.5f}}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(cs.layout) << " seed " << seed);
    const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 64);
    const std::vector<int32_t> prefix = {100, 0}, prompt = {150, 90}, len = {152, 92};
    Harness pool(c, GetParam(), cs.layout, 16, len, seed, DispatchMode::kSparse);
    Harness staged(c, GetParam(), cs.layout, 16, len, seed, DispatchMode::kSparse);
    use_sparse_rows(pool, cs.policy, cs.k_scale, SparseRows::kPool);
    use_sparse_rows(staged, cs.policy, cs.k_scale, SparseRows::kStaged);
    RunOutputs a, b;
    run_prefix_prompt_decode(pool, staged, prefix, prompt, len, a, b);
    ASSERT_EQ(a.steps.size(), 4u);
    for (size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_FALSE(has_stage(a.steps[i], "stage_rows")) << "step " << i;
      EXPECT_TRUE(has_stage(b.steps[i], "stage_rows")) << "step " << i;
    }
    EXPECT_EQ(a.ran, b.ran);
    const Diff d = compare(a, b, both(a, b));
    EXPECT_EQ(d.rows, 244);
    if (!bf16_mid(pool)) {
      EXPECT_EQ(testing::checksum(a.o), testing::checksum(b.o)) << "o rel-L2 " << d.o_rel;
      EXPECT_EQ(testing::checksum(a.lse), testing::checksum(b.lse)) << "lse " << d.lse_abs;
    } else {
      EXPECT_LE(d.o_rel, tol_f32(pool));
      EXPECT_LE(d.lse_abs, testing::kTolLse);
    }
    expect_matches_reference(staged, b, len);
  }
}

// kAuto stages where the backend prefers bf16 rows and the batch reads each context row often
// (a prefill), not for a decode step, nor for an fp8-raw pool at a head count the backend reads
// such pools directly (Capabilities::sparse_reads_fp8_raw_heads); the sparse workspace counts
// the copy exactly then; a forced copy of a pool bf16 does not hold is refused when the layer is
// made.
TEST_P(LayerTest, StagedRowsByDefaultWhereTheyPay) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 64);
  const std::vector<int32_t> prompt = {300, 200}, len = {301, 201};
  Harness h(c, GetParam(), KvLayout::kFp8Scaled, 16, len, seed, DispatchMode::kSparse);
  use_sparse_rows(h, ScalePolicy::kPow2, 1.0f, SparseRows::kAuto);
  RunOutputs out;
  run_schedule(*h.layer, h.tables, h.tokens, {h.zeros(), prompt, 0, ForwardMode::kExtend}, out);
  run_schedule(*h.layer, h.tables, h.tokens, {prompt, len, 1, ForwardMode::kDecode}, out);
  ASSERT_EQ(out.steps.size(), 2u);
  // Prefill: Σ min(ctx, 64) over 500 tokens is ~60 reads of each of the 500 rows; decode: 128
  // reads of 502 rows.
  EXPECT_EQ(has_stage(out.steps[0], "stage_rows"), h.be->capabilities().sparse_prefers_bf16_rows);
  EXPECT_FALSE(has_stage(out.steps[1], "stage_rows"));
  expect_matches_reference(h, out, len);

  // The copy: every context row, d_c + d_rope bf16 values each.
  const Batch& prefill = out.steps[0].batch;
  const int64_t copy = prefill.total_kv_len() * 2 * (c.kv_lora_rank + c.qk_rope_head_dim);
  const int64_t auto_bytes = h.layer->workspace_bytes(prefill, AttentionPath::kSparseMla);
  use_sparse_rows(h, ScalePolicy::kPow2, 1.0f, SparseRows::kPool);
  const int64_t pool_bytes = h.layer->workspace_bytes(prefill, AttentionPath::kSparseMla);
  use_sparse_rows(h, ScalePolicy::kPow2, 1.0f, SparseRows::kStaged);
  EXPECT_EQ(h.layer->workspace_bytes(prefill, AttentionPath::kSparseMla), pool_bytes + copy);
  EXPECT_EQ(auto_bytes, pool_bytes + (h.be->capabilities().sparse_prefers_bf16_rows ? copy : 0));

  // An fp8-raw pool (k_scale a power of two: bf16 holds its values) at these 16 heads and at 32.
  for (const int tp : {8, 4}) {
    const ModelConfig rc = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(tp), 64);
    SCOPED_TRACE(::testing::Message() << rc.num_heads << " heads");
    Harness raw(rc, GetParam(), KvLayout::kFp8Raw, 16, len, seed, DispatchMode::kSparse);
    use_sparse_rows(raw, ScalePolicy::kPow2, 0.5f, SparseRows::kAuto);
    RunOutputs raw_out;
    run_schedule(*raw.layer, raw.tables, raw.tokens, {raw.zeros(), prompt, 0, ForwardMode::kExtend},
                 raw_out);
    const Capabilities& caps = raw.be->capabilities();
    EXPECT_EQ(has_stage(raw_out.steps[0], "stage_rows"),
              caps.sparse_prefers_bf16_rows && rc.num_heads > caps.sparse_reads_fp8_raw_heads);
    expect_matches_reference(raw, raw_out, len);
  }

  // 656-byte amax scales, fp8-raw with k_scale 0.75: bf16 does not hold their values.
  for (KvLayout layout : {KvLayout::kFp8Scaled, KvLayout::kFp8Raw}) {
    Harness bad(c, GetParam(), layout, 16, len, seed, DispatchMode::kSparse);
    testing::expect_error_naming(
        [&] { use_sparse_rows(bad, ScalePolicy::kAmax, 0.75f, SparseRows::kStaged); },
        "sparse_rows staged", ErrorKind::kInvalidArgument);
  }

  // DSAKIT_SPARSE_ROWS overrides the option when a layer is made; a bad value names it.
  ::setenv("DSAKIT_SPARSE_ROWS", "pool", 1);
  use_sparse_rows(h, ScalePolicy::kPow2, 1.0f, SparseRows::kStaged);
  EXPECT_EQ(h.layer->options().sparse_rows, SparseRows::kPool);
  ::setenv("DSAKIT_SPARSE_ROWS", "copy", 1);
  testing::expect_error_naming(
      [&] { use_sparse_rows(h, ScalePolicy::kPow2, 1.0f, SparseRows::kAuto); },
      "DSAKIT_SPARSE_ROWS", ErrorKind::kInvalidArgument);
  ::unsetenv("DSAKIT_SPARSE_ROWS");
}

// Two requests share a cached prefix's pages (declared); the second's result equals its fresh run.
TEST_P(LayerTest, SharedPrefixPages) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
  // Request 1 repeats request 0's first 48 tokens (3 pages of 16), then has 16 of its own.
  auto make = [&] {
    auto h = std::make_unique<Harness>(c, GetParam(), KvLayout::kFp8Scaled, 16,
                                       std::vector<int32_t>{64, 64}, seed, DispatchMode::kRule);
    for (Tensor* t : {&h->tokens.q_nope, &h->tokens.q_pe, &h->tokens.c_kv, &h->tokens.k_pe,
                      &h->tokens.idx_q, &h->tokens.idx_k, &h->tokens.idx_w}) {
      auto* bytes = static_cast<uint8_t*>(t->view().data);
      const size_t row = t->nbytes() / 128;
      std::copy_n(bytes, 48 * row, bytes + 64 * row);
    }
    return h;
  };
  auto shared = make();
  shared->tables[1] = {shared->tables[0][0], shared->tables[0][1], shared->tables[0][2],
                       shared->tables[1][3]};
  RunOutputs out;
  run_schedule(*shared->layer, shared->tables, shared->tokens,
               {{0, 0}, {64, 0}, 0, ForwardMode::kExtend}, out);
  Batch b;
  b.prefix_lens = {64, 48};
  b.extend_lens = {0, 16};
  b.page_tables = shared->tables;
  EXPECT_THROW(shared->layer->plan(b), Error);  // sharing must be declared
  b.shared_prefix_pages = true;
  EXPECT_NO_THROW(shared->layer->plan(b));
  b.prefix_lens = {64, 40};  // request 1 would write into a shared page
  b.extend_lens = {0, 24};
  EXPECT_THROW(shared->layer->plan(b), Error);
  run_schedule(*shared->layer, shared->tables, shared->tokens,
               {{64, 48}, {64, 64}, 0, ForwardMode::kExtend}, out);
  // Fresh: request 1 computed from scratch in its own pages.
  auto fresh = make();
  RunOutputs ref = fresh->run({{{64, 0}, {64, 64}, 0, ForwardMode::kExtend}});
  std::vector<uint8_t> mask(128, 0);
  for (int i = 112; i < 128; ++i) mask[size_t(i)] = 1;
  const Diff d = compare(out, ref, mask);
  EXPECT_EQ(d.rows, 16);
  EXPECT_LE(d.o_rel, tol_f32(*shared));
  EXPECT_LE(d.lse_abs, tol_lse_across_paths(*shared));
}

// Decode steps after a prefill are sparse MLA and match the float64 layer reference.
TEST_P(LayerTest, DecodeAfterPrefillMatchesReference) {
  for (KvLayout layout : kLayouts) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(layout) << " seed " << seed);
    const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 64);
    const std::vector<int32_t> prompt = {120, 50}, len = {124, 54};
    Harness h(c, GetParam(), layout, 64, len, seed, DispatchMode::kRule);
    RunOutputs out;
    run_schedule(*h.layer, h.tables, h.tokens, {h.zeros(), prompt, 0, ForwardMode::kExtend}, out);
    for (int s = 0; s < 4; ++s)
      run_schedule(*h.layer, h.tables, h.tokens,
                   {{prompt[0] + s, prompt[1] + s},
                    {prompt[0] + s + 1, prompt[1] + s + 1},
                    1,
                    ForwardMode::kDecode},
                   out);
    for (size_t i = 1; i < out.steps.size(); ++i) {
      EXPECT_EQ(out.steps[i].plan.path, AttentionPath::kSparseMla);
      EXPECT_EQ(out.steps[i].plan.rule, 2);
    }
    expect_matches_reference(h, out, len);
  }
}

// docs/layer.md#fp8-weights: with kv_b_proj's FP8 form the dense path's K/V up-projection reads
// the FP8 pool's codes and scales as stored (no gather stage). Its weights are bf16-exact here,
// so the layer must match the float64 reference of the bf16 weights, and the sparse path (which
// uses the bf16 kv_b_proj) within the paths' tolerance; a bf16 pool ignores the FP8 form.
TEST_P(LayerTest, DenseWithFp8WeightsMatchesReference) {
  struct Case {
    const char* preset;
    int tp;
  };
  for (Case cs : {Case{"deepseek-v3.2", 8}, Case{"glm-5", 4}}) {
    for (KvLayout layout : kLayouts) {
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE(::testing::Message()
                   << cs.preset << " tp" << cs.tp << " " << to_string(layout) << " seed " << seed);
      const ModelConfig c = ModelConfig::preset(cs.preset).with_tp(cs.tp);
      // A prefix hit after a first chunk: the dense call re-reads cached rows from the pool.
      const std::vector<int32_t> first = {40, 21}, len = {71, 35};
      Harness h(c, GetParam(), layout, 16, len, seed, DispatchMode::kDense, DType::kF32, true);
      Harness sparse(c, GetParam(), layout, 16, len, seed, DispatchMode::kSparse, DType::kF32,
                     true);
      LayerOptions timed = h.layer->options();
      timed.time_stages = true;
      h.layer = std::make_unique<DsaAttention>(c, *h.be, h.kv, h.ix, h.w, timed);
      const std::vector<RunSchedule> chunks = {{h.zeros(), first, 0, ForwardMode::kExtend},
                                               {first, len, 0, ForwardMode::kExtend}};
      const RunOutputs a = h.run(chunks), b = sparse.run(chunks);
      const bool fp8_path = detail::fp8_up_proj_weights(*h.be, h.kv, h.layer->options()) != nullptr;
      ASSERT_EQ(a.steps.size(), 2u);
      for (size_t i = 0; i < a.steps.size(); ++i) {
        EXPECT_EQ(a.steps[i].plan.path, AttentionPath::kDenseMha);
        bool gathered = false;
        for (const StageTime& s : a.steps[i].stages) gathered |= s.stage == "gather";
        // A bf16 pool's first (prefix-free) call reads its inputs where the intermediates are
        // bf16; every other call gathers, unless the FP8 up-projection reads the pool itself.
        EXPECT_EQ(gathered, !fp8_path && !(layout == KvLayout::kBf16 && i == 0 && bf16_mid(h)));
      }
      const Diff d = compare(a, b, both(a, b));
      EXPECT_EQ(d.rows, 106);
      EXPECT_LE(d.o_rel, tol_f32(h));
      EXPECT_LE(d.lse_abs, tol_lse_across_paths(h));

      expect_matches_reference(h, a, len);
    }
  }
}

TEST_P(LayerTest, Fp8WeightsOfTheWrongShapeAreRefused) {
  const ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
  Harness h(c, GetParam(), KvLayout::kFp8Scaled, 16, {20}, fresh_seed(), DispatchMode::kDense);
  const Fp8KvBProj fp8 = random_fp8_kv_b_proj(c, 7);
  const Tensor codes = h.be->to_device(fp8.codes), scales = h.be->to_device(fp8.scales);
  const Tensor bf16_codes = h.be->to_device(fp8.bf16);
  const auto build = [&](const Fp8BlockWeights& w) {
    LayerOptions o;
    o.kv_b_proj_fp8 = w;
    DsaAttention layer(c, *h.be, h.kv, h.ix, h.w, o);
  };
  build({codes, scales});  // the right shapes construct
  const auto expect_refused = [&](const Fp8BlockWeights& w, const std::string& name) {
    try {
      build(w);
      ADD_FAILURE() << "expected an Error naming " << name;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  expect_refused({bf16_codes, scales}, "kv_b_proj_fp8.codes");
  expect_refused({codes, slice_rows(scales, 0, 1)}, "kv_b_proj_fp8.scales");
  expect_refused({codes, {}}, "kv_b_proj_fp8.scales");
  expect_refused({{}, scales}, "kv_b_proj_fp8.codes");
}

TEST_P(LayerTest, TargetVerifyRoutesToSparse) {
  const ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
  Harness h(c, GetParam(), KvLayout::kFp8Scaled, 64, {40}, fresh_seed(), DispatchMode::kRule);
  Batch b;
  b.mode = ForwardMode::kTargetVerify;
  b.prefix_lens = {36};
  b.extend_lens = {4};
  b.page_tables = h.tables;
  const Plan p = h.layer->plan(b);
  EXPECT_EQ(p.path, AttentionPath::kSparseMla);
  EXPECT_EQ(p.rule, 2);
}

// DCP (docs/layer.md): W in-process ranks own positions p % W; merged partials equal the single
// rank.
TEST_P(LayerTest, DcpEqualsSingleRank) {
  for (DispatchMode mode : {DispatchMode::kDense, DispatchMode::kSparse}) {
    for (int world : {2, 3, 4, 8}) {
      const uint64_t seed = fresh_seed();
      SCOPED_TRACE(::testing::Message() << to_string(mode) << " W=" << world << " seed " << seed);
      const ModelConfig base = ModelConfig::preset("deepseek-v3.2").with_tp(8);
      const ModelConfig c = mode == DispatchMode::kDense ? base : small_topk(base, 32);
      const std::vector<int32_t> prompt = {90, 45}, len = {92, 47};
      // Dense: with kv_b_proj's FP8 form on both sides (the ranks' up-projections read their
      // pools' codes; no gather stage).
      const bool fp8_weights = mode == DispatchMode::kDense;
      Harness single(c, GetParam(), KvLayout::kFp8Scaled, 16, len, seed, mode, DType::kF32,
                     fp8_weights);
      if (mode == DispatchMode::kDense && !single.be->capabilities().dense_kv_visible) {
        // Dense DCP needs per-query visible counts; a backend without them must refuse.
        LayerOptions o;
        o.policy.mode = mode;
        DcpSimulation dcp(c, *single.be, world, single.kd, len, single.w, o);
        Batch batch;
        batch.prefix_lens = {0, 0};
        batch.extend_lens = {prompt[0], prompt[1]};
        std::vector<int64_t> rows;
        for (int64_t i = 0; i < prompt[0]; ++i) rows.push_back(i);
        for (int64_t i = 0; i < prompt[1]; ++i) rows.push_back(len[0] + i);
        const auto in = single.tokens.slice(*single.be, rows);
        EXPECT_THROW(dcp.forward(batch, in.view()), Error);
        continue;
      }
      const RunOutputs a = single.run({{single.zeros(), prompt, 0, ForwardMode::kExtend},
                                       {prompt, len, 1, ForwardMode::kExtend}});
      LayerOptions o;
      o.output_dtype = bf16_mid(single) ? DType::kBF16 : DType::kF32;
      o.policy.mode = mode;
      o.kv_b_proj_fp8 = single.layer->options().kv_b_proj_fp8;
      o.time_stages = true;
      KvPoolDesc pd = single.kd;
      pd.num_pages = 8;
      DcpSimulation dcp(c, *single.be, world, pd, len, single.w, o);
      RunOutputs b;
      b.o = Tensor::host(DType::kF32, {a.o.size(0), a.o.size(1), a.o.size(2)});
      b.lse = Tensor::host(DType::kF32, {a.lse.size(0), a.lse.size(1)});
      b.ran.assign(a.ran.size(), 0);
      // Same steps as the single-rank run: the prompts, then one token each.
      for (int step = 0; step < 3; ++step) {
        Batch batch;
        std::vector<int64_t> rows;
        for (int r = 0; r < 2; ++r) {
          const int32_t from = step == 0 ? 0 : prompt[size_t(r)] + step - 1;
          const int32_t to = step == 0 ? prompt[size_t(r)] : from + 1;
          batch.prefix_lens.push_back(from);
          batch.extend_lens.push_back(to - from);
          for (int32_t p = from; p < to; ++p) rows.push_back((r ? len[0] : 0) + p);
        }
        const auto in = single.tokens.slice(*single.be, rows);
        const LayerResult res = dcp.forward(batch, in.view());
        EXPECT_EQ(res.plan.path, a.steps[size_t(step)].plan.path);
        bool gathered = false;
        for (const StageTime& st : res.stages) gathered |= st.stage == "gather";
        if (fp8_weights) {
          EXPECT_EQ(gathered, !single.be->capabilities().fp8_up_proj);
        }
        const Tensor o = single.be->to_host(res.o), lse = single.be->to_host(res.lse);
        const int64_t od = o.numel() / int64_t(rows.size()),
                      ld = lse.numel() / int64_t(rows.size());
        for (size_t i = 0; i < rows.size(); ++i) {
          for (int64_t j = 0; j < od; ++j)  // o is bf16 or f32, per the backend
            b.o.ptr<float>()[rows[i] * od + j] = load_as_float(o.view(), int64_t(i) * od + j);
          std::copy_n(lse.ptr<float>() + int64_t(i) * ld, ld, b.lse.ptr<float>() + rows[i] * ld);
          b.ran[size_t(rows[i])] = 1;
        }
        if (mode == DispatchMode::kSparse) {
          const Tensor top = single.be->to_host(res.topk);
          for (size_t i = 0; i < rows.size(); ++i)
            for (int j = 0; j < c.index_topk; ++j)
              ASSERT_EQ(top.ptr<int32_t>()[int64_t(i) * c.index_topk + j],
                        a.topk.ptr<int32_t>()[rows[i] * c.index_topk + j])
                  << "row " << rows[i] << " slot " << j;
        }
      }
      const Diff d = compare(a, b, both(a, b));
      EXPECT_EQ(d.rows, 139);
      EXPECT_LE(d.o_rel, tol_f32(single));
      EXPECT_LE(d.lse_abs, tol_lse_across_paths(single));
    }
  }
}

// docs/layer.md#staged-rows under DCP: each rank copies the rows it owns, its selected positions
// map to their rows in the copy, and the ranks' outputs are those of reading their pools: the
// same top-k, and the same o / lse bits where the arithmetic is the same (a pow2 656-byte pool
// on the CPU), within the same-path bounds where it is not (CUDA's FP8 kernel at 16 heads).
TEST_P(LayerTest, DcpStagedRowsEqualPoolRows) {
  for (int world : {2, 4}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << "W=" << world << " seed " << seed);
    const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 32);
    const std::vector<int32_t> prompt = {90, 45}, len = {92, 47};
    Harness h(c, GetParam(), KvLayout::kFp8Scaled, 16, len, seed, DispatchMode::kSparse);
    KvPoolDesc pd = h.kd;
    pd.scale_policy = ScalePolicy::kPow2;
    pd.num_pages = 8;
    std::vector<uint64_t> topk_sums[2];
    std::vector<std::vector<double>> outs[2], lses[2];
    for (SparseRows rows : {SparseRows::kPool, SparseRows::kStaged}) {
      LayerOptions o;
      o.output_dtype = bf16_mid(h) ? DType::kBF16 : DType::kF32;
      o.policy.mode = DispatchMode::kSparse;
      o.time_stages = true;
      o.sparse_rows = rows;
      DcpSimulation dcp(c, *h.be, world, pd, len, h.w, o);
      for (int step = 0; step < 3; ++step) {  // the prompts, then one token each
        Batch batch;
        std::vector<int64_t> token_rows;
        for (int r = 0; r < 2; ++r) {
          const int32_t from = step == 0 ? 0 : prompt[size_t(r)] + step - 1;
          const int32_t to = step == 0 ? prompt[size_t(r)] : from + 1;
          batch.prefix_lens.push_back(from);
          batch.extend_lens.push_back(to - from);
          for (int32_t p = from; p < to; ++p) token_rows.push_back((r ? len[0] : 0) + p);
        }
        const LayerResult res = dcp.forward(batch, h.tokens.slice(*h.be, token_rows).view());
        bool staged = false;
        for (const StageTime& st : res.stages) staged |= st.stage == "stage_rows";
        EXPECT_EQ(staged, rows == SparseRows::kStaged) << "step " << step;
        const bool s = rows == SparseRows::kStaged;
        outs[s].push_back(testing::to_double(h.be->to_host(res.o).view()));
        lses[s].push_back(testing::to_double(h.be->to_host(res.lse).view()));
        topk_sums[s].push_back(testing::checksum(h.be->to_host(res.topk)));
      }
    }
    EXPECT_EQ(topk_sums[0], topk_sums[1]);
    ASSERT_EQ(outs[0].size(), outs[1].size());
    for (size_t step = 0; step < outs[0].size(); ++step) {
      if (!bf16_mid(h)) {
        EXPECT_EQ(outs[0][step], outs[1][step]) << "step " << step;
        EXPECT_EQ(lses[0][step], lses[1][step]) << "step " << step;
      } else {
        EXPECT_LE(testing::rel_l2(outs[0][step], outs[1][step]), tol_f32(h)) << "step " << step;
        EXPECT_LE(testing::max_abs_diff(lses[0][step], lses[1][step]), testing::kTolLse)
            << "step " << step;
      }
    }
  }
}

// Chunked prefill under DCP: steps whose batches hold a subset of the requests (the rest are
// done), found by their request ids; equal to the single rank's chunked run, top-k sets identical.
// A rejected call (a request beyond its max length) throws on every rank without a hang and
// leaves the ranks usable.
TEST_P(LayerTest, DcpChunkedPrefillWithRequestIds) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8), 32);
  const std::vector<int32_t> len = {130, 41, 77};
  Harness single(c, GetParam(), KvLayout::kFp8Scaled, 16, len, seed, DispatchMode::kSparse);
  const std::vector<RunSchedule> schedule = {{single.zeros(), len, 48, ForwardMode::kExtend}};
  const RunOutputs a = single.run(schedule);
  LayerOptions o;
  o.output_dtype = bf16_mid(single) ? DType::kBF16 : DType::kF32;
  o.policy.mode = DispatchMode::kSparse;
  KvPoolDesc pd = single.kd;
  pd.num_pages = 12;
  DcpSimulation dcp(c, *single.be, 3, pd, len, single.w, o);
  Batch bad;
  bad.prefix_lens = {0};
  bad.extend_lens = {len[1] + 1};
  const auto bad_in = single.tokens.slice(*single.be, std::vector<int64_t>(size_t(len[1] + 1), 0));
  EXPECT_THROW(dcp.forward(bad, bad_in.view(), {1}), Error);
  RunOutputs b;
  const LayerForward forward = [&](const Batch& batch, const std::vector<int32_t>& requests,
                                   const LayerInputs& inputs) {
    return dcp.forward(batch, inputs, requests);
  };
  for (const auto& s : schedule)
    run_schedule(c, *single.be, forward, single.tables, single.tokens, s, b);
  ASSERT_EQ(b.steps.size(), a.steps.size());
  const Diff d = compare(a, b, both(a, b));
  EXPECT_EQ(d.rows, 130 + 41 + 77);
  EXPECT_LE(d.o_rel, tol_f32(single));
  EXPECT_LE(d.lse_abs, tol_lse_across_paths(single));
  for (int64_t i = 0; i < a.topk.numel(); ++i)
    ASSERT_EQ(a.topk.ptr<int32_t>()[i], b.topk.ptr<int32_t>()[i]) << "entry " << i;
}

// The in-process group: a rank that fails releases the others from all_gather (they throw
// instead of waiting forever); after reset() the group exchanges again.
TEST(DcpGroup, AFailedRankReleasesTheOthersAndResetRestoresTheGroup) {
  const auto be = make_cpu_backend(1);
  InProcessDcpGroup group(3);
  const auto gather_once = [&](int w, std::vector<int32_t>& got) {
    std::vector<int32_t> mine = {10 * w, 10 * w + 1};
    got.assign(6, -1);
    group.comm(w).all_gather(*be, make_view(mine.data(), DType::kI32, Device::kCpu, {2}),
                             make_view(got.data(), DType::kI32, Device::kCpu, {3, 2}));
  };
  std::vector<int> threw(3, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w)
    threads.emplace_back([&, w] {
      std::vector<int32_t> got;
      try {
        if (w == 2) throw std::runtime_error("rank 2 fails before the collective");
        gather_once(w, got);
      } catch (...) {
        threw[size_t(w)] = 1;
        group.abort();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(threw, (std::vector<int>{1, 1, 1}));
  group.reset();
  std::vector<std::vector<int32_t>> got(3);
  threads.clear();
  for (int w = 0; w < 3; ++w) threads.emplace_back([&, w] { gather_once(w, got[size_t(w)]); });
  for (auto& t : threads) t.join();
  for (int w = 0; w < 3; ++w)
    EXPECT_EQ(got[size_t(w)], (std::vector<int32_t>{0, 1, 10, 11, 20, 21}));
}

// docs/reliability.md: every rejected call leaves both pools byte-identical.
TEST_P(LayerTest, RejectedCallsLeaveThePoolsUntouched) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  const ModelConfig c = ModelConfig::preset("deepseek-v3.2").with_tp(8);
  Harness h(c, GetParam(), KvLayout::kFp8Scaled, 16, {40, 30}, seed, DispatchMode::kRule);
  h.run({{h.zeros(), {20, 10}, 0, ForwardMode::kExtend}});  // something in the pools
  const uint64_t before = h.pool_checksum();
  const auto rows = [&] {
    std::vector<int64_t> r;
    for (int p = 20; p < 40; ++p) r.push_back(p);
    for (int p = 10; p < 30; ++p) r.push_back(40 + p);
    return r;
  }();
  const auto in = h.tokens.slice(*h.be, rows);
  auto good = [&] {
    Batch b;
    b.prefix_lens = {20, 10};
    b.extend_lens = {20, 20};
    b.page_tables = h.tables;
    return b;
  };
  auto expect_rejected = [&](const Batch& b, const LayerInputs& li, const char* what,
                             const char* needle) {
    try {
      h.layer->forward(b, li);
      ADD_FAILURE() << what << ": expected an error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << what << ": " << e.what();
    }
    EXPECT_EQ(h.pool_checksum(), before) << what;
  };
  Batch b = good();
  b.page_tables[1][0] = int32_t(h.kd.num_pages);
  expect_rejected(b, in.view(), "page id out of range", "page_table[0]");
  b = good();
  b.page_tables[0].resize(2);
  expect_rejected(b, in.view(), "length beyond the table", "needs 3 pages");
  b = good();
  b.page_tables[1][1] = b.page_tables[0][2];
  expect_rejected(b, in.view(), "page shared without declaration", "also used by request");
  b = good();
  b.extend_lens = {20, 19};
  expect_rejected(b, in.view(), "inputs for a different T", "expected shape");
  b = good();
  LayerInputs li = in.view();
  li.idx_w.dtype = DType::kBF16;
  expect_rejected(b, li, "idx_w dtype", "idx_w");
  b = good();
  b.mode = ForwardMode::kDecode;
  expect_rejected(b, in.view(), "decode with 20 tokens", "decode expects 1");
  b = good();
  b.prefix_lens = {20, -1};
  expect_rejected(b, in.view(), "negative prefix", "prefix_len");
  // And a good call still works afterwards.
  EXPECT_NO_THROW(h.layer->forward(good(), in.view()));
  EXPECT_NE(h.pool_checksum(), before);
}

// docs/reliability.md: NaN in one request's inputs stays in that request's outputs.
TEST_P(LayerTest, NanStaysInItsRequest) {
  for (DispatchMode mode : {DispatchMode::kDense, DispatchMode::kSparse}) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << to_string(mode) << " seed " << seed);
    const ModelConfig c = small_topk(ModelConfig::preset("deepseek-v3.2").with_tp(8),
                                     mode == DispatchMode::kSparse ? 16 : 2048);
    const std::vector<int32_t> len = {40, 30};
    Harness clean(c, GetParam(), KvLayout::kBf16, 16, len, seed, mode);
    Harness dirty(c, GetParam(), KvLayout::kBf16, 16, len, seed, mode);
    // NaN in request 0: one query row and one latent KV row.
    dirty.tokens.q_nope.ptr<bf16_t>()[5 * c.num_heads * c.qk_nope_head_dim] = bf16_t{0x7FC0};
    dirty.tokens.c_kv.ptr<bf16_t>()[7 * c.kv_lora_rank + 3] = bf16_t{0x7FC0};
    const RunSchedule all{clean.zeros(), len, 0, ForwardMode::kExtend};
    const RunOutputs a = clean.run({all}), b = dirty.run({all});
    std::vector<uint8_t> req1(70, 0);
    for (int i = 40; i < 70; ++i) req1[size_t(i)] = 1;
    const Diff d = compare(a, b, req1);
    EXPECT_EQ(d.o_rel, 0.0) << "request 1 changed";
    const int64_t od = c.num_heads * c.v_head_dim;
    bool nan_row5 = false;
    for (int64_t j = 0; j < od; ++j) nan_row5 |= std::isnan(b.o.ptr<float>()[5 * od + j]);
    EXPECT_TRUE(nan_row5) << "the NaN query row must give NaN";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, LayerTest, ::testing::ValuesIn(testing::test_backends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dsakit
