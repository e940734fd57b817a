#include "tools/cli_common.h"

#include <cerrno>
#include <cstdlib>
#include <ctime>

#include "dsakit/error.h"

namespace dsakit::cli {

std::vector<int32_t> parse_int_list(const std::string& text, const char* flag, int32_t min_value) {
  std::vector<int32_t> out;
  size_t i = 0;
  DSAKIT_CHECK_ARG(!text.empty(), flag, ": expected a comma-separated list of integers, got ''");
  while (i <= text.size()) {
    const size_t j = text.find(',', i);
    const std::string item = text.substr(i, j == std::string::npos ? std::string::npos : j - i);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    DSAKIT_CHECK_ARG(
        !item.empty() && end && *end == 0 && errno == 0 && v >= min_value && v <= INT32_MAX, flag,
        ": expected integers >= ", min_value, " separated by commas, got '", item, "' in '", text,
        "'");
    out.push_back(int32_t(v));
    if (j == std::string::npos) break;
    i = j + 1;
  }
  return out;
}

std::string join_int_list(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

ModelConfig load_model(const std::string& model, int tp) {
  return ModelConfig::load(model).with_tp(tp);
}

}  // namespace dsakit::cli
