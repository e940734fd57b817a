// Model configuration of one DSA attention layer (docs/config.md).
#pragma once

#include <string>
#include <vector>

namespace dsakit {

struct RopeScaling {
  std::string type = "default";  // "default" or "yarn"
  double factor = 1.0;
  double mscale_all_dim = 0.0;
};

struct ModelConfig {
  std::string name;         // preset name or the config file's model_type
  int num_heads = 0;        // H: attention heads on this rank (after --tp)
  int num_heads_total = 0;  // H before tensor-parallel sharding
  int tp_size = 1;
  int kv_lora_rank = 0;      // d_c (512)
  int qk_nope_head_dim = 0;  // d_nope
  int qk_rope_head_dim = 0;  // d_rope (64)
  int v_head_dim = 0;        // d_v
  int q_lora_rank = 0;
  int index_n_heads = 0;   // H_i (replicated, never sharded)
  int index_head_dim = 0;  // d_i
  int index_topk = 0;      // k
  int hidden_size = 0;
  RopeScaling rope;

  int qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }  // d_qk
  int kv_dim() const { return kv_lora_rank + qk_rope_head_dim; }           // 576

  // sm_scale = mscale^2 / sqrt(d_qk), mscale = 0.1 * mscale_all_dim * ln(factor) + 1 for YaRN.
  double softmax_scale() const;

  // Returns a copy with heads sharded over `tp` ranks. Throws if H is not divisible by tp.
  ModelConfig with_tp(int tp) const;

  // Throws Error(kConfig) naming the offending key for impossible dimensions.
  void validate() const;

  std::string summary() const;  // one line: "deepseek-v3.2 H=16/128 (tp 8) d_c=512 ..."

  static std::vector<std::string> preset_names();
  // "deepseek-v3.2" | "glm-5". Throws Error(kConfig) listing the presets otherwise.
  static ModelConfig preset(const std::string& name);
  // Hugging Face config.json text / file. Missing keys, wrong types and impossible values
  // throw Error(kConfig) naming the key.
  static ModelConfig from_json(const std::string& json_text, const std::string& origin = "json");
  static ModelConfig from_json_file(const std::string& path);
  // A preset name or a path to a config.json.
  static ModelConfig load(const std::string& preset_or_path);

  std::string to_json() const;
};

}  // namespace dsakit
