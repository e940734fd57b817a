// Model configuration: presets, Hugging Face config.json parsing and validation (docs/config.md).
#include "dsakit/config.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dsakit/error.h"

namespace dsakit {
namespace {

using json = nlohmann::json;

// Upper bound of every integer key: keeps products such as H * d_qk far from int overflow.
constexpr int kMaxExtent = 1 << 20;
// The pool's FP8 layout scales d_c in 128-value tiles; rope is copied in 8-value (16-byte) chunks.
constexpr int kKvLoraRankMultiple = 128;
constexpr int kRopeHeadDimMultiple = 8;
// dsakit's own key carrying tensor parallelism through to_json() / from_json().
constexpr const char* kTpKey = "dsakit_tp_size";

std::string describe(const json& j) {
  if (j.is_string() || j.is_number() || j.is_boolean() || j.is_null()) {
    return std::string(j.type_name()) + " " +
           j.dump(-1, ' ', false, json::error_handler_t::replace);
  }
  return j.type_name();
}

// The integer at `key`, or `fallback` when the key is absent (or null and `null_ok`).
// `fallback` < 0 marks the key as required.
int read_int(const json& root, const char* key, const std::string& origin, int fallback = -1,
             bool null_ok = false) {
  const auto it = root.find(key);
  if (it == root.end() || (null_ok && it->is_null())) {
    DSAKIT_CHECK(fallback >= 0, kConfig, origin, ": missing required key \"", key, "\"");
    return fallback;
  }
  const json& v = *it;
  DSAKIT_CHECK(v.is_number_integer(), kConfig, origin, ": ", key, ": expected an integer, got ",
               describe(v));
  // Out-of-range magnitudes are rejected here; validate() then names the exact range per key.
  const bool in_range = v.is_number_unsigned()
                            ? v.get<uint64_t>() <= uint64_t(kMaxExtent)
                            : (v.get<int64_t>() >= -kMaxExtent && v.get<int64_t>() <= kMaxExtent);
  DSAKIT_CHECK(in_range, kConfig, origin, ": ", key, ": expected an integer of magnitude at most ",
               kMaxExtent, ", got ", v.dump());
  return int(v.get<int64_t>());
}

// A number of the rope object `where` (e.g. "rope_scaling"), or `fallback` when absent.
double read_number(const json& obj, const char* where, const char* key, const std::string& origin,
                   double fallback) {
  const auto it = obj.find(key);
  if (it == obj.end()) return fallback;
  DSAKIT_CHECK(it->is_number(), kConfig, origin, ": ", where, ".", key, ": expected a number, got ",
               describe(*it));
  return it->get<double>();
}

// "rope_scaling" (transformers 4) or, when that is absent or null, "rope_parameters"
// (transformers 5). Neither present, or null: default rope.
RopeScaling read_rope_scaling(const json& root, const std::string& origin) {
  RopeScaling rope;
  const char* where = "rope_scaling";
  auto it = root.find(where);
  if (it == root.end() || it->is_null()) {
    where = "rope_parameters";
    it = root.find(where);
  }
  if (it == root.end() || it->is_null()) return rope;
  const json& rs = *it;
  DSAKIT_CHECK(rs.is_object(), kConfig, origin, ": ", where, ": expected an object or null, got ",
               describe(rs));
  // The kind is spelled "type" in older configs and "rope_type" in newer ones.
  const char* type_key = rs.contains("rope_type") ? "rope_type" : "type";
  if (const auto t = rs.find(type_key); t != rs.end()) {
    DSAKIT_CHECK(t->is_string(), kConfig, origin, ": ", where, ".", type_key,
                 ": expected a string, got ", describe(*t));
    rope.type = t->get<std::string>();
  }
  rope.factor = read_number(rs, where, "factor", origin, rope.factor);
  rope.mscale_all_dim = read_number(rs, where, "mscale_all_dim", origin, rope.mscale_all_dim);
  DSAKIT_CHECK(rope.type != "yarn" || rs.contains("factor"), kConfig, origin, ": ", where,
               ".factor: required for yarn");
  return rope;
}

void check_extent(int value, const char* key, int minimum = 1) {
  DSAKIT_CHECK(value >= minimum && value <= kMaxExtent, kConfig, key, ": expected ", minimum, "..",
               kMaxExtent, ", got ", value);
}

void check_multiple(int value, const char* key, int multiple) {
  DSAKIT_CHECK(value % multiple == 0, kConfig, key, ": expected a multiple of ", multiple, ", got ",
               value);
}

ModelConfig make_preset(const char* name, int heads, int d_nope, int d_v, int q_lora_rank,
                        int index_n_heads, int hidden_size, RopeScaling rope) {
  ModelConfig c;
  c.name = name;
  c.num_heads = c.num_heads_total = heads;
  c.tp_size = 1;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = d_nope;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = d_v;
  c.q_lora_rank = q_lora_rank;
  c.index_n_heads = index_n_heads;
  c.index_head_dim = 128;
  c.index_topk = 2048;
  c.hidden_size = hidden_size;
  c.rope = std::move(rope);
  return c;
}

// "deepseek-v3.2, glm-5": for error messages.
std::string preset_list() {
  std::string out;
  for (const std::string& p : ModelConfig::preset_names()) out += (out.empty() ? "" : ", ") + p;
  return out;
}

std::string format_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

double ModelConfig::softmax_scale() const {
  // YaRN attention temperature, as DeepSeek's reference: only factors > 1 stretch the scale.
  double mscale = 1.0;
  if (rope.type == "yarn" && rope.factor > 1.0) {
    mscale = 0.1 * rope.mscale_all_dim * std::log(rope.factor) + 1.0;
  }
  return mscale * mscale / std::sqrt(double(qk_head_dim()));
}

ModelConfig ModelConfig::with_tp(int tp) const {
  DSAKIT_CHECK(tp >= 1, kConfig, "tp: expected >= 1, got ", tp);
  DSAKIT_CHECK(num_heads_total % tp == 0, kConfig, "tp: num_attention_heads ", num_heads_total,
               " is not divisible by tp ", tp);
  ModelConfig c = *this;
  c.tp_size = tp;
  c.num_heads = num_heads_total / tp;
  return c;
}

void ModelConfig::validate() const {
  check_extent(num_heads_total, "num_attention_heads");
  check_extent(tp_size, "tp");
  DSAKIT_CHECK(num_heads_total % tp_size == 0, kConfig, "tp: num_attention_heads ", num_heads_total,
               " is not divisible by tp ", tp_size);
  DSAKIT_CHECK(num_heads * tp_size == num_heads_total, kConfig, "num_heads: expected ",
               num_heads_total / tp_size, " (num_attention_heads / tp), got ", num_heads);
  check_extent(kv_lora_rank, "kv_lora_rank");
  check_multiple(kv_lora_rank, "kv_lora_rank", kKvLoraRankMultiple);
  check_extent(qk_nope_head_dim, "qk_nope_head_dim");
  check_extent(qk_rope_head_dim, "qk_rope_head_dim");
  check_multiple(qk_rope_head_dim, "qk_rope_head_dim", kRopeHeadDimMultiple);
  check_extent(v_head_dim, "v_head_dim");
  check_extent(q_lora_rank, "q_lora_rank", 0);
  check_extent(index_n_heads, "index_n_heads");
  check_extent(index_head_dim, "index_head_dim");
  check_extent(index_topk, "index_topk");
  check_extent(hidden_size, "hidden_size");
  DSAKIT_CHECK(rope.type == "default" || rope.type == "yarn", kConfig,
               "rope_scaling.type: expected \"default\" or \"yarn\", got \"", rope.type, "\"");
  DSAKIT_CHECK(std::isfinite(rope.factor) && (rope.type != "yarn" || rope.factor > 0), kConfig,
               "rope_scaling.factor: expected a finite value", rope.type == "yarn" ? " > 0" : "",
               ", got ", rope.factor);
  DSAKIT_CHECK(std::isfinite(rope.mscale_all_dim) && rope.mscale_all_dim >= 0, kConfig,
               "rope_scaling.mscale_all_dim: expected a finite value >= 0, got ",
               rope.mscale_all_dim);
  const double scale = softmax_scale();
  DSAKIT_CHECK(std::isfinite(scale) && scale > 0, kConfig, "rope_scaling: factor ", rope.factor,
               " and mscale_all_dim ", rope.mscale_all_dim, " give softmax scale ", scale,
               "; expected a finite value > 0");
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << name << " H=" << num_heads << "/" << num_heads_total << " (tp " << tp_size
     << ") d_c=" << kv_lora_rank << " d_nope=" << qk_nope_head_dim << " d_rope=" << qk_rope_head_dim
     << " d_v=" << v_head_dim << " H_i=" << index_n_heads << " d_i=" << index_head_dim
     << " topk=" << index_topk << " rope=" << rope.type;
  if (rope.type == "yarn") {
    os << "(factor " << format_number(rope.factor) << ", mscale_all_dim "
       << format_number(rope.mscale_all_dim) << ")";
  }
  os.precision(4);
  os << " sm_scale=" << softmax_scale();
  return os.str();
}

std::vector<std::string> ModelConfig::preset_names() {
  return {"deepseek-v3.2", "glm-5"};
}

ModelConfig ModelConfig::preset(const std::string& name) {
  if (name == "deepseek-v3.2") {
    return make_preset("deepseek-v3.2", /*heads=*/128, /*d_nope=*/128, /*d_v=*/128,
                       /*q_lora_rank=*/1536, /*index_n_heads=*/64, /*hidden_size=*/7168,
                       RopeScaling{"yarn", 40.0, 1.0});
  }
  if (name == "glm-5") {
    return make_preset("glm-5", /*heads=*/64, /*d_nope=*/192, /*d_v=*/256,
                       /*q_lora_rank=*/2048, /*index_n_heads=*/32, /*hidden_size=*/6144,
                       RopeScaling{});
  }
  DSAKIT_FAIL(kConfig, "model preset: expected one of ", preset_list(), ", got \"", name, "\"");
}

ModelConfig ModelConfig::from_json(const std::string& json_text, const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    DSAKIT_FAIL(kConfig, origin, ": not valid JSON (", e.what(), ")");
  }
  DSAKIT_CHECK(root.is_object(), kConfig, origin, ": expected a JSON object, got ", describe(root));

  ModelConfig c;
  c.name = "custom";
  if (const auto it = root.find("model_type"); it != root.end()) {
    DSAKIT_CHECK(it->is_string(), kConfig, origin, ": model_type: expected a string, got ",
                 describe(*it));
    c.name = it->get<std::string>();
  }
  c.num_heads_total = read_int(root, "num_attention_heads", origin);
  c.num_heads = c.num_heads_total;
  c.kv_lora_rank = read_int(root, "kv_lora_rank", origin);
  c.qk_nope_head_dim = read_int(root, "qk_nope_head_dim", origin);
  c.qk_rope_head_dim = read_int(root, "qk_rope_head_dim", origin);
  c.v_head_dim = read_int(root, "v_head_dim", origin);
  c.q_lora_rank = read_int(root, "q_lora_rank", origin, /*fallback=*/0, /*null_ok=*/true);
  c.index_n_heads = read_int(root, "index_n_heads", origin);
  c.index_head_dim = read_int(root, "index_head_dim", origin);
  c.index_topk = read_int(root, "index_topk", origin);
  c.hidden_size = read_int(root, "hidden_size", origin);
  c.rope = read_rope_scaling(root, origin);
  const int tp = read_int(root, kTpKey, origin, /*fallback=*/1);

  try {
    c.validate();
    DSAKIT_CHECK(tp >= 1, kConfig, kTpKey, ": expected >= 1, got ", tp);
    return c.with_tp(tp);
  } catch (const Error& e) {
    DSAKIT_FAIL(kConfig, origin, ": ", e.what());
  }
}

ModelConfig ModelConfig::from_json_file(const std::string& path) {
  std::ifstream in(path);
  DSAKIT_CHECK(in.good(), kConfig, path, ": cannot open config file");
  std::ostringstream text;
  text << in.rdbuf();
  DSAKIT_CHECK(!in.bad(), kConfig, path, ": read error");
  return from_json(text.str(), path);
}

ModelConfig ModelConfig::load(const std::string& preset_or_path) {
  for (const std::string& p : preset_names())
    if (p == preset_or_path) return preset(p);
  std::ifstream probe(preset_or_path);
  if (!probe.good()) {
    DSAKIT_FAIL(kConfig, "model: \"", preset_or_path, "\" is neither a preset (", preset_list(),
                ") nor a readable config.json file");
  }
  return from_json_file(preset_or_path);
}

std::string ModelConfig::to_json() const {
  json j = {
      {"model_type", name},
      {"num_attention_heads", num_heads_total},
      {"kv_lora_rank", kv_lora_rank},
      {"qk_nope_head_dim", qk_nope_head_dim},
      {"qk_rope_head_dim", qk_rope_head_dim},
      {"v_head_dim", v_head_dim},
      {"q_lora_rank", q_lora_rank},
      {"index_n_heads", index_n_heads},
      {"index_head_dim", index_head_dim},
      {"index_topk", index_topk},
      {"hidden_size", hidden_size},
      {"rope_scaling",
       {{"type", rope.type}, {"factor", rope.factor}, {"mscale_all_dim", rope.mscale_all_dim}}}};
  if (tp_size != 1) j[kTpKey] = tp_size;
  return j.dump(2, ' ', false, json::error_handler_t::replace);
}

}  // namespace dsakit
