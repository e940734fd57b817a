// PLACEHOLDER: replaced by the real config parser.
#include "dsakit/config.h"

#include "dsakit/error.h"

namespace dsakit {
#define DSAKIT_TODO DSAKIT_FAIL(kUnsupported, "config: not implemented yet")
double ModelConfig::softmax_scale() const { DSAKIT_TODO; }
ModelConfig ModelConfig::with_tp(int) const { DSAKIT_TODO; }
void ModelConfig::validate() const { DSAKIT_TODO; }
std::string ModelConfig::summary() const { DSAKIT_TODO; }
std::vector<std::string> ModelConfig::preset_names() { DSAKIT_TODO; }
ModelConfig ModelConfig::preset(const std::string&) { DSAKIT_TODO; }
ModelConfig ModelConfig::from_json(const std::string&, const std::string&) { DSAKIT_TODO; }
ModelConfig ModelConfig::from_json_file(const std::string&) { DSAKIT_TODO; }
ModelConfig ModelConfig::load(const std::string&) { DSAKIT_TODO; }
std::string ModelConfig::to_json() const { DSAKIT_TODO; }
}  // namespace dsakit
