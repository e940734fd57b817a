// ModelConfig: presets (docs/config.md), config.json parsing, validation messages, tensor
// parallelism and the to_json() round trip.
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dsakit/config.h"
#include "dsakit/error.h"
#include "tests/common/test_util.h"

namespace dsakit {
namespace {

using json = nlohmann::json;
using testing::fresh_seed;
using testing::Rng;

const std::string kConfigDir = std::string(DSAKIT_SOURCE_DIR) + "/tests/data/configs/";

// Every field except the name.
void expect_same_dims(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_heads_total, b.num_heads_total);
  EXPECT_EQ(a.tp_size, b.tp_size);
  EXPECT_EQ(a.kv_lora_rank, b.kv_lora_rank);
  EXPECT_EQ(a.qk_nope_head_dim, b.qk_nope_head_dim);
  EXPECT_EQ(a.qk_rope_head_dim, b.qk_rope_head_dim);
  EXPECT_EQ(a.v_head_dim, b.v_head_dim);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.index_n_heads, b.index_n_heads);
  EXPECT_EQ(a.index_head_dim, b.index_head_dim);
  EXPECT_EQ(a.index_topk, b.index_topk);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.rope.type, b.rope.type);
  EXPECT_EQ(a.rope.factor, b.rope.factor);
  EXPECT_EQ(a.rope.mscale_all_dim, b.rope.mscale_all_dim);
  EXPECT_EQ(a.softmax_scale(), b.softmax_scale());
}

void expect_config_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning '" << needles.front() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' does not mention '" << n << "'";
  }
}

json deepseek_json() {
  std::ifstream in(kConfigDir + "deepseek-v3.2.json");
  return json::parse(in);
}

// ---- presets --------------------------------------------------------------------------------

TEST(ModelConfig, DeepSeekV32Preset) {
  const ModelConfig c = ModelConfig::preset("deepseek-v3.2");
  EXPECT_EQ(c.name, "deepseek-v3.2");
  EXPECT_EQ(c.num_heads, 128);
  EXPECT_EQ(c.num_heads_total, 128);
  EXPECT_EQ(c.tp_size, 1);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.index_n_heads, 64);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.factor, 40.0);
  EXPECT_EQ(c.rope.mscale_all_dim, 1.0);
  EXPECT_EQ(c.qk_head_dim(), 192);
  EXPECT_EQ(c.kv_dim(), 576);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_NEAR(mscale, 1.3689, 1e-4);
  EXPECT_NEAR(c.softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-15);
  EXPECT_NEAR(c.softmax_scale(), 0.1352, 1e-4);  // the peers' sm_scale
  EXPECT_NO_THROW(c.validate());
}

TEST(ModelConfig, Glm5Preset) {
  const ModelConfig c = ModelConfig::preset("glm-5");
  EXPECT_EQ(c.name, "glm-5");
  EXPECT_EQ(c.num_heads, 64);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 192);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 256);
  EXPECT_EQ(c.q_lora_rank, 2048);
  EXPECT_EQ(c.index_n_heads, 32);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 2048);
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.rope.type, "default");
  EXPECT_EQ(c.qk_head_dim(), 256);
  EXPECT_EQ(c.softmax_scale(), 1.0 / 16.0);
  EXPECT_NO_THROW(c.validate());
}

TEST(ModelConfig, PresetNamesAndUnknownPreset) {
  EXPECT_EQ(ModelConfig::preset_names(), (std::vector<std::string>{"deepseek-v3.2", "glm-5"}));
  expect_config_error([] { ModelConfig::preset("deepseek-v4"); },
                      {"\"deepseek-v4\"", "deepseek-v3.2", "glm-5"});
}

// ---- Hugging Face config.json ---------------------------------------------------------------

TEST(ModelConfig, ExampleConfigFilesMatchPresets) {
  const ModelConfig ds = ModelConfig::from_json_file(kConfigDir + "deepseek-v3.2.json");
  EXPECT_EQ(ds.name, "deepseek_v32");
  expect_same_dims(ds, ModelConfig::preset("deepseek-v3.2"));
  const ModelConfig glm = ModelConfig::load(kConfigDir + "glm-5.json");
  EXPECT_EQ(glm.name, "glm_moe_dsa");
  expect_same_dims(glm, ModelConfig::preset("glm-5"));
}

TEST(ModelConfig, OptionalKeysAndSpellings) {
  json j = deepseek_json();
  j["q_lora_rank"] = nullptr;
  j.erase("model_type");
  ModelConfig c = ModelConfig::from_json(j.dump());
  EXPECT_EQ(c.q_lora_rank, 0);
  EXPECT_EQ(c.name, "custom");
  j.erase("q_lora_rank");
  EXPECT_EQ(ModelConfig::from_json(j.dump()).q_lora_rank, 0);

  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"mscale_all_dim", 0.707}};
  c = ModelConfig::from_json(j.dump());
  EXPECT_EQ(c.rope.type, "yarn");
  EXPECT_EQ(c.rope.factor, 4.0);
  const double mscale = 0.1 * 0.707 * std::log(4.0) + 1.0;
  EXPECT_NEAR(c.softmax_scale(), mscale * mscale / std::sqrt(192.0), 1e-15);

  // YaRN without mscale_all_dim, or with factor <= 1, leaves the scale at 1/sqrt(d_qk).
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40}};
  EXPECT_EQ(ModelConfig::from_json(j.dump()).softmax_scale(), 1.0 / std::sqrt(192.0));
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 0.5}, {"mscale_all_dim", 1.0}};
  EXPECT_EQ(ModelConfig::from_json(j.dump()).softmax_scale(), 1.0 / std::sqrt(192.0));

  j.erase("rope_scaling");
  EXPECT_EQ(ModelConfig::from_json(j.dump()).rope.type, "default");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 40}, {"mscale_all_dim", 1.0}};
  EXPECT_NEAR(ModelConfig::from_json(j.dump()).softmax_scale(), 0.1352, 1e-4);
  j["rope_scaling"] = nullptr;  // null rope_scaling falls through to rope_parameters
  EXPECT_EQ(ModelConfig::from_json(j.dump()).rope.type, "yarn");
}

TEST(ModelConfig, MissingRequiredKeysAreNamed) {
  for (const char* key :
       {"num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "index_n_heads", "index_head_dim", "index_topk", "hidden_size"}) {
    SCOPED_TRACE(key);
    json j = deepseek_json();
    j.erase(key);
    expect_config_error([&] { ModelConfig::from_json(j.dump(), "my/config.json"); },
                        {"my/config.json", std::string("missing required key \"") + key + "\""});
  }
}

TEST(ModelConfig, BadValuesNameKeyAndValue) {
  struct Case {
    const char* key;
    json value;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"num_attention_heads", "128", {"num_attention_heads: expected an integer, got string"}},
      {"kv_lora_rank", 512.0, {"kv_lora_rank: expected an integer, got number 512.0"}},
      {"v_head_dim", true, {"v_head_dim: expected an integer, got boolean true"}},
      {"index_head_dim", json::array({128}), {"index_head_dim: expected an integer, got array"}},
      {"q_lora_rank", -1, {"q_lora_rank: expected 0..", "got -1"}},
      {"qk_nope_head_dim", -128, {"qk_nope_head_dim: expected 1..", "got -128"}},
      {"v_head_dim", 0, {"v_head_dim: expected 1..", "got 0"}},
      {"num_attention_heads", 0, {"num_attention_heads: expected 1..", "got 0"}},
      {"index_n_heads", -64, {"index_n_heads: expected 1..", "got -64"}},
      {"kv_lora_rank", 500, {"kv_lora_rank: expected a multiple of 128, got 500"}},
      {"qk_rope_head_dim", 60, {"qk_rope_head_dim: expected a multiple of 8, got 60"}},
      {"index_topk", 0, {"index_topk: expected 1..", "got 0"}},
      {"index_topk", -2048, {"index_topk: expected 1..", "got -2048"}},
      {"hidden_size",
       1000000000000LL,
       {"hidden_size: expected an integer of magnitude at most 1048576", "1000000000000"}},
      {"hidden_size", 18446744073709551615ULL, {"hidden_size: expected an integer of magnitude"}},
      {"index_topk",
       std::numeric_limits<int64_t>::min(),
       {"index_topk: expected an integer of magnitude"}},
      {"dsakit_tp_size", 3, {"num_attention_heads 128 is not divisible by tp 3"}},
      {"dsakit_tp_size", 0, {"dsakit_tp_size: expected >= 1, got 0"}},
      {"model_type", 5, {"model_type: expected a string, got number 5"}},
      {"rope_scaling", json::array(), {"rope_scaling: expected an object or null, got array"}},
      {"rope_scaling", {{"type", "yarn"}, {"factor", 0}}, {"rope_scaling.factor", "> 0, got 0"}},
      {"rope_scaling", {{"type", "yarn"}, {"factor", -40}}, {"rope_scaling.factor", "got -40"}},
      {"rope_scaling",
       {{"type", "yarn"}, {"factor", "40"}},
       {"rope_scaling.factor: expected a number, got string \"40\""}},
      {"rope_scaling", {{"type", "yarn"}}, {"rope_scaling.factor: required for yarn"}},
      {"rope_scaling", {{"type", 1}}, {"rope_scaling.type: expected a string, got number 1"}},
      {"rope_scaling",
       {{"rope_type", "linear"}, {"factor", 2}},
       {"rope_scaling.type: expected \"default\" or \"yarn\", got \"linear\""}},
      {"rope_scaling",
       {{"type", "yarn"}, {"factor", 40}, {"mscale_all_dim", -1}},
       {"rope_scaling.mscale_all_dim: expected a finite value >= 0, got -1"}},
      {"rope_scaling",
       {{"type", "yarn"}, {"factor", 40}, {"mscale_all_dim", 1e300}},
       {"rope_scaling: factor 40 and mscale_all_dim 1e+300 give softmax scale inf"}},
  };
  for (const Case& c : cases) {
    json j = deepseek_json();
    j[c.key] = c.value;
    SCOPED_TRACE(std::string(c.key) + " = " + c.value.dump());
    std::vector<std::string> needles = c.needles;
    needles.push_back("cfg.json");
    expect_config_error([&] { ModelConfig::from_json(j.dump(), "cfg.json"); }, needles);
  }
}

TEST(ModelConfig, NotJsonOrNotObject) {
  expect_config_error([] { ModelConfig::from_json("{\"num_attention_heads\": ", "a.json"); },
                      {"a.json", "not valid JSON"});
  expect_config_error([] { ModelConfig::from_json("[128]", "b.json"); },
                      {"b.json", "expected a JSON object, got array"});
  expect_config_error([] { ModelConfig::from_json("", "c.json"); }, {"c.json", "not valid JSON"});
}

TEST(ModelConfig, LoadPresetOrPath) {
  EXPECT_EQ(ModelConfig::load("glm-5").name, "glm-5");
  EXPECT_EQ(ModelConfig::load(kConfigDir + "deepseek-v3.2.json").name, "deepseek_v32");
  expect_config_error([] { ModelConfig::load("/no/such/config.json"); },
                      {"/no/such/config.json", "deepseek-v3.2", "glm-5"});
  expect_config_error([] { ModelConfig::from_json_file("/no/such/config.json"); },
                      {"/no/such/config.json", "cannot open"});
}

// ---- tensor parallelism ---------------------------------------------------------------------

TEST(ModelConfig, WithTpShardsAttentionHeadsOnly) {
  const ModelConfig ds = ModelConfig::preset("deepseek-v3.2");
  const ModelConfig tp8 = ds.with_tp(8);
  EXPECT_EQ(tp8.num_heads, 16);
  EXPECT_EQ(tp8.num_heads_total, 128);
  EXPECT_EQ(tp8.tp_size, 8);
  EXPECT_EQ(tp8.index_n_heads, 64);  // the indexer is replicated
  EXPECT_EQ(tp8.softmax_scale(), ds.softmax_scale());
  EXPECT_NO_THROW(tp8.validate());
  EXPECT_EQ(tp8.with_tp(2).num_heads, 64);  // re-shards from the total
  const ModelConfig glm4 = ModelConfig::preset("glm-5").with_tp(4);
  EXPECT_EQ(glm4.num_heads, 16);
  EXPECT_EQ(glm4.index_n_heads, 32);
  expect_config_error([&] { ds.with_tp(3); }, {"tp", "128", "not divisible by tp 3"});
  expect_config_error([&] { ds.with_tp(0); }, {"tp: expected >= 1, got 0"});
  expect_config_error([&] { ds.with_tp(-8); }, {"tp: expected >= 1, got -8"});
  expect_config_error([&] { ds.with_tp(256); }, {"not divisible by tp 256"});
}

TEST(ModelConfig, ValidateRejectsInconsistentShards) {
  ModelConfig c = ModelConfig::preset("glm-5").with_tp(4);
  c.num_heads = 15;
  expect_config_error([&] { c.validate(); }, {"num_heads: expected 16", "got 15"});
  c = ModelConfig::preset("glm-5");
  c.rope.type = "ntk";
  expect_config_error([&] { c.validate(); }, {"rope_scaling.type", "\"ntk\""});
}

TEST(ModelConfig, SummaryIsOneLine) {
  const std::string s = ModelConfig::preset("deepseek-v3.2").with_tp(8).summary();
  EXPECT_EQ(s.find('\n'), std::string::npos);
  for (const char* part : {"deepseek-v3.2", "H=16/128 (tp 8)", "d_c=512", "d_nope=128", "d_rope=64",
                           "d_v=128", "H_i=64", "d_i=128", "topk=2048",
                           "rope=yarn(factor 40, mscale_all_dim 1)", "sm_scale=0.1352"})
    EXPECT_NE(s.find(part), std::string::npos) << s << " lacks " << part;
  EXPECT_NE(ModelConfig::preset("glm-5").summary().find("sm_scale=0.0625"), std::string::npos);
}

// ---- to_json round trip ---------------------------------------------------------------------

TEST(ModelConfig, ToJsonRoundTripsPresets) {
  for (const std::string& name : ModelConfig::preset_names()) {
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(name + " tp " + std::to_string(tp));
      const ModelConfig c = ModelConfig::preset(name).with_tp(tp);
      const ModelConfig back = ModelConfig::from_json(c.to_json());
      EXPECT_EQ(back.name, c.name);
      expect_same_dims(back, c);
    }
  }
}

TEST(ModelConfig, ToJsonRoundTripsRandomConfigs) {
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(seed);
  Rng rng(seed);
  for (int trial = 0; trial < 50; ++trial) {
    ModelConfig c;
    c.name = "random-" + std::to_string(trial);
    c.tp_size = int(rng.randint(1, 8));
    c.num_heads = int(rng.randint(1, 32));
    c.num_heads_total = c.num_heads * c.tp_size;
    c.kv_lora_rank = 128 * int(rng.randint(1, 8));
    c.qk_nope_head_dim = int(rng.randint(1, 512));
    c.qk_rope_head_dim = 8 * int(rng.randint(1, 16));
    c.v_head_dim = int(rng.randint(1, 512));
    c.q_lora_rank = int(rng.randint(0, 4096));
    c.index_n_heads = int(rng.randint(1, 128));
    c.index_head_dim = int(rng.randint(1, 256));
    c.index_topk = int(rng.randint(1, 8192));
    c.hidden_size = int(rng.randint(1, 16384));
    if (rng.randint(0, 1)) c.rope = {"yarn", rng.uniform(0.01f, 100.f), rng.uniform(0.f, 2.f)};
    ASSERT_NO_THROW(c.validate());
    const ModelConfig back = ModelConfig::from_json(c.to_json());
    SCOPED_TRACE(c.to_json());
    EXPECT_EQ(back.name, c.name);
    expect_same_dims(back, c);
  }
}

}  // namespace
}  // namespace dsakit
