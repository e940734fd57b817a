// The dispatcher's rule mode (docs/dispatch.md): one test per rule and per override; the reason
// names the deciding rule and its numbers.
#include <cstdlib>

#include "dsakit/error.h"
#include "dsakit/plan.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

class DispatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv("DSAKIT_DISPATCH");
    unsetenv("DSAKIT_DENSE_KV_LEN_THRESHOLD");
    config = ModelConfig::preset("deepseek-v3.2").with_tp(8);
    caps.device = Device::kCuda;
    caps.device_name = "test sm_90";
    caps.sm_arch = 90;
    caps.dense_mha = true;
    batch.prefix_lens = {0, 512};
    batch.extend_lens = {1500, 700};
  }
  void TearDown() override {
    unsetenv("DSAKIT_DISPATCH");
    unsetenv("DSAKIT_DENSE_KV_LEN_THRESHOLD");
  }
  Plan plan(const DispatchPolicy& p = {}) {
    return plan_batch(batch, config, layout, caps, p.with_env());
  }
  ModelConfig config;
  Capabilities caps;
  Batch batch;
  KvLayout layout = KvLayout::kFp8Scaled;
};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST_F(DispatchTest, AllRulesHoldGivesDense) {
  const Plan p = plan();
  EXPECT_EQ(p.path, AttentionPath::kDenseMha);
  EXPECT_EQ(p.rule, 0);
  EXPECT_FALSE(p.approximate);
  EXPECT_TRUE(contains(p.reason, "max L_r = 1500 <= threshold 2048")) << p.reason;
}

TEST_F(DispatchTest, Rule1CudaGraph) {
  batch.cuda_graph = true;
  const Plan p = plan();
  EXPECT_EQ(p.path, AttentionPath::kSparseMla);
  EXPECT_EQ(p.rule, 1);
  EXPECT_TRUE(contains(p.reason, "rule 1")) << p.reason;
}

TEST_F(DispatchTest, Rule2ModesOtherThanPlainExtend) {
  for (ForwardMode m :
       {ForwardMode::kDecode, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    batch.mode = m;
    const Plan p = plan();
    EXPECT_EQ(p.path, AttentionPath::kSparseMla) << to_string(m);
    EXPECT_EQ(p.rule, 2);
    EXPECT_TRUE(contains(p.reason, std::string("mode ") + to_string(m))) << p.reason;
  }
  batch.mode = ForwardMode::kExtend;
  batch.speculative = true;
  const Plan p = plan();
  EXPECT_EQ(p.rule, 2);
  EXPECT_TRUE(contains(p.reason, "speculative")) << p.reason;
}

TEST_F(DispatchTest, Rule3NoDensePathOnDevice) {
  caps.dense_mha = false;
  caps.device_name = "test sm_80";
  const Plan p = plan();
  EXPECT_EQ(p.rule, 3);
  EXPECT_TRUE(contains(p.reason, "test sm_80")) << p.reason;
}

TEST_F(DispatchTest, Rule3NoDenseKernelForTheseHeadDims) {
  caps.dense_head_dims = {{128, 64, 128}, {192, 64, 256}};
  EXPECT_EQ(plan().path, AttentionPath::kDenseMha);  // DeepSeek-V3.2 dims are compiled
  config.qk_nope_head_dim = 64;
  const Plan p = plan();
  EXPECT_EQ(p.rule, 3);
  EXPECT_TRUE(contains(p.reason, "no dense MHA kernel for d_nope/d_rope/d_v = 64/64/128"))
      << p.reason;
  DispatchPolicy pol;
  pol.mode = DispatchMode::kDense;
  EXPECT_THROW(plan(pol), Error);
}

TEST_F(DispatchTest, Rule4CountsPrefixPlusExtend) {
  batch.prefix_lens = {0, 2000};
  batch.extend_lens = {10, 49};  // extend alone is tiny, L = 2049
  const Plan p = plan();
  EXPECT_EQ(p.rule, 4);
  EXPECT_TRUE(contains(p.reason, "max L_r = 2049 > threshold 2048")) << p.reason;
  batch.extend_lens = {10, 48};  // L = 2048 = index_topk: still exact, dense
  EXPECT_EQ(plan().path, AttentionPath::kDenseMha);
}

TEST_F(DispatchTest, Rule4ThresholdBelowTopk) {
  DispatchPolicy pol;
  pol.threshold = 1000;
  const Plan p = plan(pol);
  EXPECT_EQ(p.rule, 4);
  EXPECT_TRUE(contains(p.reason, "1500 > threshold 1000")) << p.reason;
}

TEST_F(DispatchTest, Rule6ChunkCapacity) {
  DispatchPolicy pol;
  pol.chunk_capacity = 2000;
  const Plan p = plan(pol);  // Σ L = 1500 + 1212 = 2712
  EXPECT_EQ(p.rule, 6);
  EXPECT_TRUE(contains(p.reason, "sum L_r = 2712 > chunk capacity 2000")) << p.reason;
}

TEST_F(DispatchTest, Rule7ContextParallel) {
  batch.context_parallel = true;
  EXPECT_EQ(plan().rule, 7);
}

TEST_F(DispatchTest, Rule8HierarchicalSparseCache) {
  batch.hierarchical_sparse_cache = true;
  EXPECT_EQ(plan().rule, 8);
}

TEST_F(DispatchTest, Rule5EveryShippedLayoutHasADenseGather) {
  for (KvLayout l : {KvLayout::kBf16, KvLayout::kFp8Scaled, KvLayout::kFp8Raw}) {
    layout = l;
    EXPECT_EQ(plan().path, AttentionPath::kDenseMha) << to_string(l);
  }
}

TEST_F(DispatchTest, FirstFailingRuleDecides) {
  batch.cuda_graph = true;
  batch.context_parallel = true;
  EXPECT_EQ(plan().rule, 1);
}

TEST_F(DispatchTest, ThresholdAboveTopkNeedsOptIn) {
  DispatchPolicy pol;
  pol.threshold = 4096;
  EXPECT_THROW(plan(pol), Error);
  try {
    plan(pol);
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "4096")) << e.what();
    EXPECT_TRUE(contains(e.what(), "approximation")) << e.what();
  }
  pol.allow_approximation = true;
  batch.extend_lens = {3000, 700};
  const Plan p = plan(pol);
  EXPECT_EQ(p.path, AttentionPath::kDenseMha);
  EXPECT_TRUE(p.approximate);
  EXPECT_TRUE(contains(p.reason, "APPROXIMATE")) << p.reason;
}

TEST_F(DispatchTest, ForcedModes) {
  DispatchPolicy pol;
  pol.mode = DispatchMode::kSparse;
  EXPECT_EQ(plan(pol).path, AttentionPath::kSparseMla);
  EXPECT_TRUE(contains(plan(pol).reason, "forced sparse"));
  pol.mode = DispatchMode::kDense;
  batch.cuda_graph = true;  // forced dense ignores the engine rules...
  EXPECT_EQ(plan(pol).path, AttentionPath::kDenseMha);
  batch.extend_lens = {3000, 700};  // ...but not exactness
  EXPECT_THROW(plan(pol), Error);
  pol.allow_approximation = true;
  EXPECT_TRUE(plan(pol).approximate);
  caps.dense_mha = false;  // nor the device
  EXPECT_THROW(plan(pol), Error);
}

TEST_F(DispatchTest, CostModeWithoutProfileFallsBackToRuleAndSaysSo) {
  DispatchPolicy pol;
  pol.mode = DispatchMode::kCost;
  const Plan p = plan(pol);
  EXPECT_EQ(p.path, AttentionPath::kDenseMha);
  EXPECT_TRUE(contains(p.reason, "fell back to rule mode")) << p.reason;
}

TEST_F(DispatchTest, EnvDispatchOverrideIsValidatedAndEchoed) {
  setenv("DSAKIT_DISPATCH", "sparse", 1);
  const Plan p = plan();
  EXPECT_EQ(p.path, AttentionPath::kSparseMla);
  EXPECT_TRUE(contains(p.reason, "[env: DSAKIT_DISPATCH=sparse]")) << p.reason;
  setenv("DSAKIT_DISPATCH", "fastest", 1);
  try {
    plan();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "DSAKIT_DISPATCH")) << e.what();
    EXPECT_TRUE(contains(e.what(), "fastest")) << e.what();
  }
}

TEST_F(DispatchTest, EnvThresholdOverrideIsValidatedAndEchoed) {
  setenv("DSAKIT_DENSE_KV_LEN_THRESHOLD", "1000", 1);
  const Plan p = plan();
  EXPECT_EQ(p.rule, 4);
  EXPECT_TRUE(contains(p.reason, "threshold 1000")) << p.reason;
  EXPECT_TRUE(contains(p.reason, "DSAKIT_DENSE_KV_LEN_THRESHOLD=1000")) << p.reason;
  for (const char* bad : {"abc", "-5", "12x", "99999999999"}) {
    setenv("DSAKIT_DENSE_KV_LEN_THRESHOLD", bad, 1);
    try {
      plan();
      FAIL() << "expected an error for " << bad;
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "DSAKIT_DENSE_KV_LEN_THRESHOLD")) << e.what();
    }
  }
  setenv("DSAKIT_DENSE_KV_LEN_THRESHOLD", "4096", 1);  // above index_topk without opt-in
  EXPECT_THROW(plan(), Error);
}

TEST_F(DispatchTest, ParseNames) {
  EXPECT_EQ(parse_dispatch_mode("cost"), DispatchMode::kCost);
  EXPECT_THROW(parse_dispatch_mode("Dense"), Error);
}

}  // namespace
}  // namespace dsakit
