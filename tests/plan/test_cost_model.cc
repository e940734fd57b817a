// Cost-mode dispatch (docs/dispatch.md#cost-mode): batch features, the non-negative fit, the
// profile file (round trip, stale and mismatched profiles refused) and the planner's choices,
// including split plans, on synthetic profiles whose answers are known.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>

#include "dsakit/cost_model.h"
#include "dsakit/error.h"
#include "dsakit/plan.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using testing::fresh_seed;

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

ModelConfig ds16() {
  return ModelConfig::preset("deepseek-v3.2").with_tp(8);
}

Capabilities gpu_caps() {
  Capabilities c;
  c.device = Device::kCuda;
  c.device_name = "test gpu";
  c.sm_arch = 90;
  c.dense_mha = true;
  return c;
}

Batch make_batch(std::vector<int32_t> prefix, std::vector<int32_t> extend) {
  Batch b;
  b.prefix_lens = std::move(prefix);
  b.extend_lens = std::move(extend);
  b.page_tables.resize(b.prefix_lens.size());
  return b;
}

CostTerms terms(AttentionPath path, const std::map<std::string, double>& coef,
                SparseForm form = SparseForm::kMla) {
  CostTerms t;
  t.names = cost_terms(path, form);
  for (const auto& n : t.names) t.coef_ms.push_back(coef.count(n) ? coef.at(n) : 0.0);
  return t;
}

// A profile entry for `config` on "test gpu": dense pays per position re-read (N), sparse per
// new token (T) and for its indexer: short extends on long prefixes favour sparse.
CostEntry entry(const ModelConfig& c, KvLayout layout, double dense_per_pos = 1e-3,
                double sparse_per_token = 4e-3) {
  CostEntry e;
  e.key = CostKey::of("test gpu", c, layout);
  e.dense = terms(AttentionPath::kDenseMha, {{"1", 0.05}, {"N", dense_per_pos}});
  e.sparse = terms(AttentionPath::kSparseMla, {{"1", 0.1}, {"T", sparse_per_token}});
  return e;
}

std::shared_ptr<const CostProfile> profile_of(std::vector<CostEntry> entries) {
  auto p = std::make_shared<CostProfile>();
  p->entries = std::move(entries);
  return p;
}

DispatchPolicy cost_policy(std::shared_ptr<const CostProfile> profile) {
  DispatchPolicy p;
  p.mode = DispatchMode::kCost;
  p.profile = std::move(profile);
  return p;
}

TEST(CostFeatures, ClosedFormsMatchSums) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  ModelConfig c = ds16();
  c.index_topk = int(rng.randint(8, 300));
  for (int trial = 0; trial < 50; ++trial) {
    const int n = int(rng.randint(1, 6));
    Batch b = make_batch({}, {});
    for (int r = 0; r < n; ++r) {
      b.prefix_lens.push_back(int32_t(rng.randint(0, 600)));
      b.extend_lens.push_back(int32_t(rng.randint(1, 400)));
    }
    b.page_tables.resize(size_t(n));
    const int first = int(rng.randint(0, n - 1)), count = int(rng.randint(0, n - first));
    double t = 0, pos = 0, ctx = 0, ctxk = 0;
    for (int r = first; r < first + count; ++r) {
      t += b.extend_lens[size_t(r)];
      pos += b.prefix_lens[size_t(r)] + b.extend_lens[size_t(r)];
      for (int i = 1; i <= b.extend_lens[size_t(r)]; ++i) {
        const double cx = b.prefix_lens[size_t(r)] + i;
        ctx += cx;
        ctxk += std::min<double>(cx, c.index_topk);
      }
    }
    const CostFeatures f = CostFeatures::of(b, c, first, count);
    EXPECT_EQ(f.requests, count);
    EXPECT_EQ(f.tokens, t);
    EXPECT_EQ(f.positions, pos);
    EXPECT_EQ(f.ctx, ctx);
    EXPECT_EQ(f.ctx_topk, ctxk);
    EXPECT_EQ(f.term("K*H"), ctxk * c.num_heads);
    EXPECT_EQ(f.term("C*Hi"), ctx * c.index_n_heads);
  }
  EXPECT_THROW(CostFeatures::of(make_batch({0}, {1}), c, 0, 2), Error);
  EXPECT_THROW(CostFeatures{}.term("Q"), Error);
}

TEST(CostFit, RecoversNonNegativeCoefficients) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  const ModelConfig c = ds16();
  const auto& names = cost_terms(AttentionPath::kSparseMla);
  std::vector<double> truth;
  for (size_t i = 0; i < names.size(); ++i)
    truth.push_back(rng.randint(0, 2) == 0 ? 0.0 : rng.uniform(0.5, 2.0));
  CostTerms model;
  model.names = names;
  std::vector<CostFeatures> f;
  std::vector<double> ms;
  for (int s = 0; s < 40; ++s) {
    const int n = int(rng.randint(1, 4));
    Batch b = make_batch({}, {});
    for (int r = 0; r < n; ++r) {
      b.prefix_lens.push_back(int32_t(rng.randint(0, 5000)));
      b.extend_lens.push_back(int32_t(rng.randint(1, 3000)));
    }
    b.page_tables.resize(size_t(n));
    f.push_back(CostFeatures::of(b, c));
    double y = 0;
    // Scale each term's coefficient so every term contributes ~truth[i] ms at a typical shape.
    for (size_t i = 0; i < names.size(); ++i) {
      const double typical = CostFeatures::of(make_batch({1000}, {1000}), c).term(names[i]);
      y += truth[i] / typical * f.back().term(names[i]);
    }
    ms.push_back(y + 1e-3);  // never zero
  }
  const CostTerms fit = fit_cost_terms(names, f, ms);
  for (double v : fit.coef_ms) EXPECT_GE(v, 0);
  EXPECT_LT(fit.max_rel_error, 1e-2);
  for (size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(fit.predict_ms(f[i]) / ms[i], 1.0, 1e-2);
}

TEST(CostFit, NeverNegativeEvenWhenTheDataWantsIt) {
  // y falls with T: the unconstrained slope is negative; NNLS must keep it at zero.
  const ModelConfig c = ds16();
  std::vector<CostFeatures> f;
  std::vector<double> ms;
  for (int t = 1; t <= 10; ++t) {
    f.push_back(CostFeatures::of(make_batch({0}, {t * 100}), c));
    ms.push_back(10.0 - t * 0.5);
  }
  const CostTerms fit = fit_cost_terms({"1", "T"}, f, ms);
  EXPECT_GT(fit.coef_ms[0], 0);
  EXPECT_EQ(fit.coef_ms[1], 0);
  EXPECT_THROW(fit_cost_terms({"1"}, f, std::vector<double>(f.size(), 0.0)), Error);
  EXPECT_THROW(fit_cost_terms({"1"}, f, {1.0}), Error);
}

TEST(CostEntryPrediction, LocalCorrectionPullsTowardNearbySamples) {
  const ModelConfig c = ds16();
  CostEntry e = entry(c, KvLayout::kBf16);
  // The linear model says 0.05 + 1e-3 * N for dense; the measurements near P=1500, E=8 say
  // 3x that, near P=0, E=1000 they agree with it.
  const Batch near = make_batch({1500}, {8}), far = make_batch({0}, {1000});
  const CostFeatures fn = CostFeatures::of(near, c), ff = CostFeatures::of(far, c);
  const double lin_near = e.linear_ms(AttentionPath::kDenseMha, fn);
  e.samples.push_back({AttentionPath::kDenseMha, fn, 3 * lin_near, {}});
  e.samples.push_back(
      {AttentionPath::kDenseMha, ff, e.linear_ms(AttentionPath::kDenseMha, ff), {}});
  // Without prepare() the samples are not consulted yet.
  EXPECT_DOUBLE_EQ(e.predict_ms(AttentionPath::kDenseMha, fn), lin_near);
  e.prepare();
  // At the sample: within the shrinkage of the measurement.
  EXPECT_NEAR(e.predict_ms(AttentionPath::kDenseMha, fn) / (3 * lin_near), 1.0, 0.08);
  // Far from the slow sample (and at the agreeing one): the linear model.
  EXPECT_NEAR(
      e.predict_ms(AttentionPath::kDenseMha, ff) / e.linear_ms(AttentionPath::kDenseMha, ff), 1.0,
      1e-3);
  // Half an octave away in positions: part of the way.
  const CostFeatures mid = CostFeatures::of(make_batch({int32_t(1500 * 1.41)}, {8}), c);
  const double r =
      e.predict_ms(AttentionPath::kDenseMha, mid) / e.linear_ms(AttentionPath::kDenseMha, mid);
  EXPECT_GT(r, 1.5);
  EXPECT_LT(r, 3.0);
  // The sparse path has no samples: untouched.
  EXPECT_DOUBLE_EQ(e.predict_ms(AttentionPath::kSparseMla, fn),
                   e.linear_ms(AttentionPath::kSparseMla, fn));
  // Survives the file round trip.
  CostProfile p;
  p.put(e);
  const CostProfile q = CostProfile::from_json(p.to_json(), "mem");
  ASSERT_EQ(q.entries[0].samples.size(), 2u);
  EXPECT_NEAR(q.entries[0].predict_ms(AttentionPath::kDenseMha, fn),
              e.predict_ms(AttentionPath::kDenseMha, fn), 1e-9);
}

TEST(CostProfileFile, RoundTripKeepsPredictions) {
  const ModelConfig c = ds16();
  CostProfile p;
  p.put(entry(c, KvLayout::kFp8Scaled));
  p.put(entry(ModelConfig::preset("glm-5").with_tp(4), KvLayout::kBf16));
  p.entries[0].stages["store"] = terms(AttentionPath::kDenseMha, {{"1", 0.01}});
  const CostProfile q = CostProfile::from_json(p.to_json(), "mem");
  ASSERT_EQ(q.entries.size(), 2u);
  const CostFeatures f = CostFeatures::of(make_batch({1200, 0}, {64, 900}), c);
  for (AttentionPath path : {AttentionPath::kDenseMha, AttentionPath::kSparseMla})
    EXPECT_DOUBLE_EQ(q.entries[0].predict_ms(path, f), p.entries[0].predict_ms(path, f));
  EXPECT_EQ(q.entries[0].stages.count("store"), 1u);
  // put() replaces an entry with the same key.
  p.put(entry(c, KvLayout::kFp8Scaled, 5e-3));
  EXPECT_EQ(p.entries.size(), 2u);
  EXPECT_DOUBLE_EQ(p.entries[0].dense.coef_ms[3], 5e-3);  // "N"
  // save + load through a file.
  const std::string path = ::testing::TempDir() + "/dsakit_profile_roundtrip.json";
  p.save(path);
  const CostProfile r = CostProfile::load(path);
  EXPECT_EQ(r.source, path);
  EXPECT_EQ(r.entries.size(), 2u);
  std::remove(path.c_str());
}

TEST(CostProfileFile, RefusesStaleMalformedAndForeignFiles) {
  CostProfile p;
  p.put(entry(ds16(), KvLayout::kBf16));
  std::string text = p.to_json();
  auto refused = [](const std::string& t, const std::string& what) {
    try {
      CostProfile::from_json(t, "f.json");
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_TRUE(contains(e.what(), "f.json")) << e.what();
      return std::string(e.what());
    }
    return std::string();
  };
  auto replaced = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? t : t.replace(at, from.size(), to);
  };
  const std::string revision = "\"kernel_revision\": " + std::to_string(kCostKernelRevision);
  EXPECT_TRUE(contains(
      refused(replaced(revision, "\"kernel_revision\": " + std::to_string(kCostKernelRevision - 1)),
              "old kernels"),
      "stale"));
  const std::string format = "\"format_version\": " + std::to_string(kCostProfileFormat);
  EXPECT_TRUE(contains(refused(replaced(format, "\"format_version\": 99"), "format"), "stale"));
  refused("{", "truncated");
  refused("[]", "not an object");
  refused("{\"format\": \"something-else\"}", "foreign");
  refused(replaced("\"layout\": \"bf16\"", "\"layout\": \"int4\""), "layout");
  refused(replaced("\"heads\": 16", "\"heads\": \"x\""), "heads type");
  refused(replaced("\"N\":", "\"Z\":"), "unknown term");
  refused(replaced("\"T\": 0.004", "\"T\": -0.004"), "negative coefficient");
  EXPECT_THROW(CostProfile::load("/nonexistent/dsakit.json"), Error);
}

TEST(CostProfileFile, FindMatchesDimensionsAndListsWhatItHolds) {
  CostProfile p;
  p.source = "h.json";
  p.put(entry(ds16(), KvLayout::kFp8Scaled));
  ModelConfig renamed = ds16();
  renamed.name = "my-finetune";  // same dimensions: same entry
  EXPECT_NO_THROW(p.find(CostKey::of("test gpu", renamed, KvLayout::kFp8Scaled)));
  for (const CostKey& k : {CostKey::of("other gpu", ds16(), KvLayout::kFp8Scaled),
                           CostKey::of("test gpu", ds16(), KvLayout::kBf16),
                           CostKey::of("test gpu", ds16().with_tp(1), KvLayout::kFp8Scaled)}) {
    try {
      p.find(k);
      ADD_FAILURE() << "matched " << k.describe();
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "has no entry for")) << e.what();
      EXPECT_TRUE(contains(e.what(), "holds 1 entry")) << e.what();
      EXPECT_TRUE(contains(e.what(), "dsakit calibrate")) << e.what();
    }
  }
}

// The masked-MHA form's fit: its own terms from its own samples (the MLA fit untouched by them),
// none without samples; its samples' stage times stay out of the stage fits (its dense_mha
// stage is the masked kernel's); fits, samples and forms survive the file, and a form on a
// dense sample or an "auto" sample is refused.
TEST(CostFit, TheMaskedFormHasItsOwnFit) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  const ModelConfig c = ds16();
  const CostKey key = CostKey::of("test gpu", c, KvLayout::kBf16);
  std::vector<CostSample> samples;
  for (int s = 0; s < 24; ++s) {
    const Batch b = make_batch({int32_t(rng.randint(0, 6000))}, {int32_t(rng.randint(1, 4000))});
    const CostFeatures f = CostFeatures::of(b, c);
    samples.push_back(
        {AttentionPath::kDenseMha, f, 0.05 + 1e-4 * f.positions, {{"dense_mha", 1.0}}});
    samples.push_back({AttentionPath::kSparseMla, f, 0.1 + 2e-3 * f.tokens, {}});
    samples.push_back({AttentionPath::kSparseMla,
                       f,
                       0.2 + 1e-9 * f.term("C*H"),
                       {{"dense_mha", 1e6}},
                       SparseForm::kMaskedMha});
  }
  const CostEntry e = fit_cost_entry(key, samples);
  ASSERT_TRUE(e.prices_masked());
  EXPECT_EQ(e.masked.names, cost_terms(AttentionPath::kSparseMla, SparseForm::kMaskedMha));
  EXPECT_LT(e.sparse.max_rel_error, 1e-6);
  EXPECT_LT(e.masked.max_rel_error, 1e-6);
  const CostFeatures f = CostFeatures::of(make_batch({0}, {4096}), c);
  EXPECT_NEAR(e.predict_ms(AttentionPath::kSparseMla, f, SparseForm::kMaskedMha),
              0.2 + 1e-9 * f.term("C*H"), 1e-6);
  EXPECT_NEAR(e.predict_ms(AttentionPath::kSparseMla, f), 0.1 + 2e-3 * f.tokens, 1e-6);
  ASSERT_EQ(e.stages.count("dense_mha"), 1u);
  EXPECT_NEAR(e.stages.at("dense_mha").predict_ms(f), 1.0, 1e-6) << "masked stages left out";

  std::vector<CostSample> mla_only;
  for (const auto& smp : samples)
    if (smp.form == SparseForm::kMla) mla_only.push_back(smp);
  const CostEntry m = fit_cost_entry(key, mla_only);
  EXPECT_FALSE(m.prices_masked());
  EXPECT_DOUBLE_EQ(m.predict_ms(AttentionPath::kSparseMla, f, SparseForm::kMaskedMha),
                   m.predict_ms(AttentionPath::kSparseMla, f))
      << "priced as MLA without masked fits";
  std::vector<CostSample> few = mla_only;
  few.push_back(samples[2]);  // one masked sample for seven terms
  EXPECT_THROW(fit_cost_entry(key, few), Error);

  CostProfile p;
  p.put(e);
  const std::string text = p.to_json();
  const CostProfile q = CostProfile::from_json(text, "mem");
  ASSERT_TRUE(q.entries[0].prices_masked());
  size_t masked_samples = 0;
  for (const auto& smp : q.entries[0].samples) masked_samples += smp.form == SparseForm::kMaskedMha;
  EXPECT_EQ(masked_samples, 24u);
  for (SparseForm form : {SparseForm::kMla, SparseForm::kMaskedMha})
    EXPECT_DOUBLE_EQ(q.entries[0].predict_ms(AttentionPath::kSparseMla, f, form),
                     e.predict_ms(AttentionPath::kSparseMla, f, form));
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string t = text;
    const size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? t : t.replace(at, from.size(), to);
  };
  EXPECT_THROW(CostProfile::from_json(with("\"path\": \"dense_mha\"",
                                           "\"path\": \"dense_mha\", \"form\": \"masked-mha\""),
                                      "f.json"),
               Error);
  EXPECT_THROW(
      CostProfile::from_json(with("\"form\": \"masked-mha\"", "\"form\": \"auto\""), "f.json"),
      Error);
  EXPECT_THROW(
      CostProfile::from_json(with("\"form\": \"masked-mha\"", "\"form\": \"mask\""), "f.json"),
      Error);
}

class CostDispatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("DSAKIT_DISPATCH");
    unsetenv("DSAKIT_DENSE_KV_LEN_THRESHOLD");
    unsetenv("DSAKIT_PROFILE");
  }
  void TearDown() override { SetUp(); }
  Plan plan(const Batch& b, const DispatchPolicy& p) {
    return plan_batch(b, config, layout, caps, p.with_env());
  }
  ModelConfig config = ds16();
  Capabilities caps = gpu_caps();
  KvLayout layout = KvLayout::kFp8Scaled;
};

TEST_F(CostDispatchTest, WithoutAProfileFallsBackToRuleModeAndSaysSo) {
  DispatchPolicy p;
  p.mode = DispatchMode::kCost;
  const Plan pl = plan(make_batch({0}, {1000}), p);
  EXPECT_EQ(pl.path, AttentionPath::kDenseMha);
  EXPECT_TRUE(contains(pl.reason, "no calibration profile, fell back to rule mode")) << pl.reason;
}

TEST_F(CostDispatchTest, PicksTheCheaperPathAndNamesBothPredictions) {
  const auto prof = profile_of({entry(config, layout)});
  // Fresh 1000 tokens: dense 0.05 + 1.0 ms, sparse 0.1 + 4 ms.
  Plan pl = plan(make_batch({0}, {1000}), cost_policy(prof));
  EXPECT_EQ(pl.path, AttentionPath::kDenseMha);
  EXPECT_NEAR(pl.predicted_dense_ms, 1.05, 1e-9);
  EXPECT_NEAR(pl.predicted_sparse_ms, 4.1, 1e-9);
  EXPECT_NEAR(pl.predicted_ms, 1.05, 1e-9);
  EXPECT_TRUE(contains(pl.reason, "dense MHA predicted")) << pl.reason;
  // 8 new tokens on a 2000-token prefix: dense re-reads 2008 positions (2.06 ms), sparse 0.13.
  pl = plan(make_batch({2000}, {8}), cost_policy(prof));
  EXPECT_EQ(pl.path, AttentionPath::kSparseMla);
  EXPECT_EQ(pl.rule, 0);
  EXPECT_TRUE(contains(pl.reason, "sparse MLA predicted")) << pl.reason;
  ASSERT_EQ(pl.segments.size(), 1u);
  EXPECT_EQ(pl.segments[0].num_requests, 1);
}

TEST_F(CostDispatchTest, NeverDenseBeyondTheThresholdOrTheEngineRules) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  testing::Rng rng(seed);
  // Dense predicted free: cost mode would take it wherever it may.
  const auto prof = profile_of({entry(config, layout, 0.0, 1.0)});
  DispatchPolicy pol = cost_policy(prof);
  for (int trial = 0; trial < 200; ++trial) {
    pol.threshold = rng.randint(0, 1) ? -1 : rng.randint(1, config.index_topk);
    pol.chunk_capacity = rng.randint(0, 1) ? 131072 : rng.randint(100, 6000);
    pol.allow_split = rng.randint(0, 1) == 1;
    const int64_t limit = pol.threshold < 0 ? config.index_topk : pol.threshold;
    const int n = int(rng.randint(1, 5));
    Batch b = make_batch({}, {});
    for (int r = 0; r < n; ++r) {
      b.prefix_lens.push_back(int32_t(rng.randint(0, 3000)));
      b.extend_lens.push_back(int32_t(rng.randint(1, 1500)));
    }
    b.page_tables.resize(size_t(n));
    const Plan pl = plan(b, pol);
    EXPECT_FALSE(pl.approximate);
    int covered = 0;
    for (const auto& s : pl.segments) {
      EXPECT_EQ(s.first_request, covered);
      covered += s.num_requests;
      if (s.path != AttentionPath::kDenseMha) continue;
      int64_t total = 0;
      for (int r = s.first_request; r < s.first_request + s.num_requests; ++r) {
        const int64_t len = int64_t(b.prefix_lens[size_t(r)]) + b.extend_lens[size_t(r)];
        EXPECT_LE(len, limit) << pl.reason;
        total += len;
      }
      EXPECT_LE(total, pol.chunk_capacity) << pl.reason;
    }
    EXPECT_EQ(covered, n);
    if (!pol.allow_split) {
      EXPECT_NE(pl.path, AttentionPath::kMixed);
    }
  }
  // Engine state decides before any cost: graph capture, decode, context parallelism.
  Batch b = make_batch({0}, {100});
  b.cuda_graph = true;
  EXPECT_EQ(plan(b, pol).path, AttentionPath::kSparseMla);
  EXPECT_EQ(plan(b, pol).rule, 1);
  b = make_batch({100}, {1});
  b.mode = ForwardMode::kDecode;
  EXPECT_EQ(plan(b, pol).rule, 2);
  b = make_batch({0}, {100});
  b.context_parallel = true;
  EXPECT_EQ(plan(b, pol).rule, 7);
  caps.dense_mha = false;
  EXPECT_EQ(plan(make_batch({0}, {100}), pol).rule, 3);
}

TEST_F(CostDispatchTest, SplitsAMixedBatchWhenThatIsCheaper) {
  const auto prof = profile_of({entry(config, layout)});
  // r0: fresh 1000 (dense 1.05 < sparse 4.1); r1: 16 new on a 1984 prefix (sparse 0.164 <
  // dense 2.05); r2: fresh 900 (dense).
  const Batch b = make_batch({0, 1984, 0}, {1000, 16, 900});
  const Plan pl = plan(b, cost_policy(prof));
  ASSERT_EQ(pl.path, AttentionPath::kMixed) << pl.reason;
  ASSERT_EQ(pl.segments.size(), 3u);
  EXPECT_EQ(pl.segments[0].path, AttentionPath::kDenseMha);
  EXPECT_EQ(pl.segments[1].path, AttentionPath::kSparseMla);
  EXPECT_EQ(pl.segments[2].path, AttentionPath::kDenseMha);
  EXPECT_EQ(pl.path_of(1), AttentionPath::kSparseMla);
  EXPECT_EQ(pl.path_of(2), AttentionPath::kDenseMha);
  EXPECT_LT(pl.predicted_ms, std::min(pl.predicted_dense_ms, pl.predicted_sparse_ms));
  EXPECT_NEAR(pl.predicted_ms, (0.05 + 1.0) + (0.1 + 0.064) + (0.05 + 0.9), 1e-9);
  EXPECT_TRUE(contains(pl.reason, "split into 3 runs (dense r0, sparse r1, dense r2)"))
      << pl.reason;
  DispatchPolicy no_split = cost_policy(prof);
  no_split.allow_split = false;
  EXPECT_NE(plan(b, no_split).path, AttentionPath::kMixed);
  // The split must be predicted min_split_gain cheaper than the best whole path.
  const double gain = 1 - pl.predicted_ms / std::min(pl.predicted_dense_ms, pl.predicted_sparse_ms);
  DispatchPolicy margin = cost_policy(prof);
  margin.min_split_gain = gain * 1.01;
  const Plan whole = plan(b, margin);
  EXPECT_NE(whole.path, AttentionPath::kMixed) << whole.reason;
  EXPECT_TRUE(contains(whole.reason, "a split into 3 runs predicted")) << whole.reason;
  margin.min_split_gain = gain * 0.99;
  EXPECT_EQ(plan(b, margin).path, AttentionPath::kMixed);
  margin.min_split_gain = 1.0;
  EXPECT_THROW(plan(b, margin), Error);
  // A request beyond index_topk keeps its run sparse; the others may still go dense.
  const Plan long_one = plan(make_batch({0, 0}, {1500, 5000}), cost_policy(prof));
  ASSERT_EQ(long_one.path, AttentionPath::kMixed) << long_one.reason;
  EXPECT_EQ(long_one.path_of(0), AttentionPath::kDenseMha);
  EXPECT_EQ(long_one.path_of(1), AttentionPath::kSparseMla);
  EXPECT_LT(long_one.predicted_dense_ms, 0);  // not exact as a whole
}

// SparseForm::kAuto: the sparse path's two forms priced and the cheaper plan taken (whole batch
// or split), named in the reason; MLA where the profile has no masked fits, the backend no masked
// kernel, the engine state no dense work (decode, graphs) or Σ L_r exceeds the chunk capacity; a
// fixed form is the plan's.
TEST_F(CostDispatchTest, AutoFormPricesBothSparseForms) {
  caps.dense_kv_mask = true;
  CostEntry e = entry(config, layout);
  // Masked: 0.2 ms + 3e-3 per new token, against MLA's 0.1 + 4e-3 and dense's 0.05 + 1e-3 per
  // position.
  e.masked = terms(AttentionPath::kSparseMla, {{"1", 0.2}, {"T", 3e-3}}, SparseForm::kMaskedMha);
  const auto prof = profile_of({e});
  const auto plan_form = [&](const Batch& b, SparseForm form, DispatchPolicy pol) {
    return plan_batch(b, config, layout, caps, pol, form);
  };
  // A fresh 4096-token prompt (beyond index_topk: no dense): masked 12.488 ms < MLA 16.484.
  const Batch fresh = make_batch({0}, {4096});
  Plan pl = plan_form(fresh, SparseForm::kAuto, cost_policy(prof));
  EXPECT_EQ(pl.path, AttentionPath::kSparseMla);
  EXPECT_EQ(pl.sparse_form, SparseForm::kMaskedMha);
  EXPECT_NEAR(pl.predicted_masked_ms, 12.488, 1e-9);
  EXPECT_NEAR(pl.predicted_sparse_ms, 16.484, 1e-9);
  EXPECT_NEAR(pl.predicted_ms, 12.488, 1e-9);
  EXPECT_TRUE(contains(pl.reason,
                       "sparse masked-MHA predicted dense not exact (max L_r = 4096 > "
                       "2048), sparse 16.48 ms, masked-mha 12.49 ms"))
      << pl.reason;
  // 8 new tokens on a 2000-token prefix: MLA 0.132 < masked 0.224.
  pl = plan_form(make_batch({2000}, {8}), SparseForm::kAuto, cost_policy(prof));
  EXPECT_EQ(pl.sparse_form, SparseForm::kMla) << pl.reason;
  EXPECT_TRUE(contains(pl.reason, "sparse MLA predicted")) << pl.reason;
  // Split: r0 fresh 1000 dense (1.05 < masked 3.2), r1 fresh 4096 masked: 13.538 ms against
  // 15.488 for the whole batch masked.
  pl = plan_form(make_batch({0, 0}, {1000, 4096}), SparseForm::kAuto, cost_policy(prof));
  ASSERT_EQ(pl.path, AttentionPath::kMixed) << pl.reason;
  EXPECT_EQ(pl.sparse_form, SparseForm::kMaskedMha);
  EXPECT_TRUE(contains(pl.reason, "split into 2 runs (dense r0, masked-mha r1)")) << pl.reason;
  EXPECT_NEAR(pl.predicted_ms, 13.538, 1e-9);
  // Not taken: a fixed MLA form, no masked kernel, no masked fits, decode, over the capacity.
  pl = plan_form(fresh, SparseForm::kMla, cost_policy(prof));
  EXPECT_EQ(pl.sparse_form, SparseForm::kMla);
  EXPECT_LT(pl.predicted_masked_ms, 0);
  Capabilities no_mask = caps;
  no_mask.dense_kv_mask = false;
  EXPECT_EQ(
      plan_batch(fresh, config, layout, no_mask, cost_policy(prof), SparseForm::kAuto).sparse_form,
      SparseForm::kMla);
  EXPECT_EQ(plan_form(fresh, SparseForm::kAuto, cost_policy(profile_of({entry(config, layout)})))
                .sparse_form,
            SparseForm::kMla);
  Batch decode = make_batch({4096}, {1});
  decode.mode = ForwardMode::kDecode;
  EXPECT_EQ(plan_form(decode, SparseForm::kAuto, cost_policy(prof)).sparse_form, SparseForm::kMla);
  DispatchPolicy small = cost_policy(prof);
  small.chunk_capacity = 4000;
  pl = plan_form(fresh, SparseForm::kAuto, small);
  EXPECT_EQ(pl.sparse_form, SparseForm::kMla);
  EXPECT_LT(pl.predicted_masked_ms, 0);
  // A fixed masked form: the plan's in every mode (and priced by its fits in cost mode).
  pl = plan_form(make_batch({2000}, {8}), SparseForm::kMaskedMha, cost_policy(prof));
  EXPECT_EQ(pl.sparse_form, SparseForm::kMaskedMha);
  EXPECT_NEAR(pl.predicted_ms, 0.224, 1e-9);
  EXPECT_LT(pl.predicted_sparse_ms, 0);
  for (DispatchMode m : {DispatchMode::kRule, DispatchMode::kSparse}) {
    DispatchPolicy pol;
    pol.mode = m;
    pl = plan_form(fresh, SparseForm::kMaskedMha, pol);
    EXPECT_EQ(pl.sparse_form, SparseForm::kMaskedMha);
    EXPECT_TRUE(contains(pl.reason, "(sparse form masked-mha)")) << pl.reason;
    EXPECT_EQ(plan_form(fresh, SparseForm::kAuto, pol).sparse_form, SparseForm::kMla);
  }
  try {
    plan_batch(fresh, config, layout, no_mask, cost_policy(prof), SparseForm::kMaskedMha);
    ADD_FAILURE() << "masked-mha planned without the masked kernel";
  } catch (const Error& ex) {
    EXPECT_EQ(ex.kind(), ErrorKind::kUnsupported);
    EXPECT_TRUE(contains(ex.what(), "masked-mha")) << ex.what();
  }
}

TEST_F(CostDispatchTest, RefusesAProfileForAnotherDeviceOrLayout) {
  const auto prof = profile_of({entry(config, KvLayout::kBf16)});
  try {
    plan(make_batch({0}, {100}), cost_policy(prof));
    ADD_FAILURE() << "planned with a profile of another layout";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "has no entry for")) << e.what();
    EXPECT_TRUE(contains(e.what(), "fp8 pool")) << e.what();
  }
}

TEST_F(CostDispatchTest, ProfileFromTheEnvironment) {
  CostProfile p;
  p.put(entry(config, layout));
  const std::string path = ::testing::TempDir() + "/dsakit_env_profile.json";
  p.save(path);
  setenv("DSAKIT_PROFILE", path.c_str(), 1);
  setenv("DSAKIT_DISPATCH", "cost", 1);
  const Plan pl = plan(make_batch({2000}, {8}), DispatchPolicy{});
  EXPECT_EQ(pl.mode, DispatchMode::kCost);
  EXPECT_EQ(pl.path, AttentionPath::kSparseMla);
  EXPECT_TRUE(contains(pl.reason, "DSAKIT_PROFILE=" + path)) << pl.reason;
  // A policy already holding that file does not read it again.
  const DispatchPolicy once = DispatchPolicy{}.with_env();
  EXPECT_EQ(once.with_env().profile.get(), once.profile.get());
  std::ofstream(path) << "{ not json";
  setenv("DSAKIT_PROFILE", (path + ".missing").c_str(), 1);
  try {
    DispatchPolicy{}.with_env();
    ADD_FAILURE() << "a missing profile was accepted";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "DSAKIT_PROFILE")) << e.what();
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace dsakit
