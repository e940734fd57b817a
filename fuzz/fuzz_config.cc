// libFuzzer target: ModelConfig::from_json on arbitrary text, then with_tp, summary and the
// to_json round trip of whatever was accepted. Rejections must be dsakit::Error of kind kConfig.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "dsakit/config.h"
#include "dsakit/error.h"

namespace {

void require(bool cond) {
  if (!cond) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  dsakit::ModelConfig config;
  try {
    config = dsakit::ModelConfig::from_json(text, "fuzz.json");
  } catch (const dsakit::Error& e) {
    require(e.kind() == dsakit::ErrorKind::kConfig);
    return 0;
  }
  config.validate();  // an accepted config is valid: a throw here escapes and is reported
  require(std::isfinite(config.softmax_scale()) && config.softmax_scale() > 0);
  require(!config.summary().empty());

  const std::string json = config.to_json();
  const dsakit::ModelConfig back = dsakit::ModelConfig::from_json(json, "fuzz-roundtrip");
  require(back.to_json() == json);

  for (int tp : {-1, 0, 1, 2, 3, 8, config.num_heads_total, config.num_heads_total + 1}) {
    try {
      const dsakit::ModelConfig sharded = config.with_tp(tp);
      require(tp >= 1 && sharded.num_heads * tp == config.num_heads_total);
      require(sharded.index_n_heads == config.index_n_heads);
      sharded.validate();
    } catch (const dsakit::Error& e) {
      require(e.kind() == dsakit::ErrorKind::kConfig);
      require(tp < 1 || config.num_heads_total % tp != 0);
    }
  }
  return 0;
}
