// Shared pieces of the dsakit command line: option parsing helpers and error reporting.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsakit/config.h"

namespace dsakit::cli {

// "1500,700" -> {1500, 700}; throws Error(kInvalidArgument) naming `flag`.
std::vector<int32_t> parse_int_list(const std::string& text, const char* flag, int32_t min_value);
// {1500, 700} -> "1500,700" (the inverse).
std::string join_int_list(const std::vector<int32_t>& values);

// Today's date (UTC) as YYYY-MM-DD.
std::string today();

// Model from a preset name or a config.json path, sharded over `tp` ranks.
ModelConfig load_model(const std::string& model, int tp);

// Exit codes: 0 ok, 1 verification failed, 2 usage / input error, 3 runtime (device) error.
inline constexpr int kExitVerifyFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitRuntime = 3;

}  // namespace dsakit::cli
