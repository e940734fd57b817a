// libFuzzer target: the dsakit command line in-process (dsakit::cli::run_cli) on argument
// vectors drawn from the input, one argument per line (at most 24, each at most 96 bytes).
//
// To keep each run small and local, the harness rewrites what names files or sizes work:
//   * --model on `run` (and any non-preset --model) -> a tiny MLA config written at start-up;
//   * --inputs -> a file that `run --save` wrote at start-up, --save -> a scratch path;
//   * a `run` whose --prompts sum past 64 tokens or 8 requests, --decode-steps past 8, --chunk
//     or --page-size past 64, --threads past 2 or --verify-tokens past 64 is skipped.
//   * `bench` and `calibrate` are skipped: they time real work for seconds to minutes by design
//     (their flag validation is covered by tests/cli/test_bench.py).
// Invariant: run_cli returns an exit code of 0..3 and lets no exception escape (libFuzzer reports
// an escaped exception, crash, leak or sanitizer error). Run with -close_fd_mask=3: the CLI
// prints its reports and errors.
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "tools/cli_app.h"

namespace {

void require(bool cond) {
  if (!cond) std::abort();
}

constexpr size_t kMaxArgs = 24;
constexpr size_t kMaxArgBytes = 96;

// Scratch files of this process: a tiny config, a saved run, a --save target.
struct Scratch {
  std::string dir, config, inputs, save;
};

int call_cli(std::vector<std::string> args) {
  args.insert(args.begin(), "dsakit");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return dsakit::cli::run_cli(int(args.size()), argv.data());
}

const Scratch& scratch() {
  static const Scratch s = [] {
    Scratch x;
    char tmpl[] = "/tmp/dsakit-fuzz-cli-XXXXXX";
    require(mkdtemp(tmpl) != nullptr);
    x.dir = tmpl;
    x.config = x.dir + "/tiny.json";
    x.inputs = x.dir + "/inputs.safetensors";
    x.save = x.dir + "/save.safetensors";
    std::ofstream(x.config) << R"({"num_attention_heads": 4, "kv_lora_rank": 128,
      "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 2,
      "index_head_dim": 16, "index_topk": 8, "hidden_size": 64})";
    require(call_cli({"run", "--device", "cpu", "--threads", "1", "--model", x.config, "--tp", "1",
                      "--prompts", "9,4", "--prefix", "3,0", "--save", x.inputs, "--quiet"}) == 0);
    return x;
  }();
  return s;
}

// Largest magnitude of the comma-separated numbers in `text` under every reading the CLI might
// apply (decimal, C integer literal with base prefix, floating point); 0 for non-numbers.
double max_magnitude(const std::string& text, double* sum = nullptr, int* count = nullptr) {
  double largest = 0, total = 0;
  int items = 0;
  size_t i = 0;
  while (i <= text.size()) {
    const size_t j = std::min(text.find(',', i), text.size());
    const std::string item = text.substr(i, j - i);
    const double a = std::fabs(std::strtod(item.c_str(), nullptr));
    const double b = std::fabs(double(std::strtoll(item.c_str(), nullptr, 0)));
    const double c = std::fabs(double(std::strtoll(item.c_str(), nullptr, 10)));
    const double m = std::isnan(a) ? std::max(b, c) : std::max({a, b, c});
    largest = std::max(largest, m);
    total += m;
    ++items;
    i = j + 1;
  }
  if (sum) *sum = total;
  if (count) *count = items;
  return largest;
}

bool is_preset(const std::string& model) {
  return model == "deepseek-v3.2" || model == "glm-5";
}

// Rewrites file and model arguments in place; false when the `run` would be too large.
bool make_local(std::vector<std::string>& args, bool is_run) {
  const Scratch& s = scratch();
  for (size_t i = 0; i < args.size(); ++i) {
    std::string& a = args[i];
    const size_t eq = a.find('=');
    const std::string flag = a.rfind("--", 0) == 0 ? a.substr(0, eq) : std::string();
    if (flag.empty()) continue;
    // The value: after '=' or the next argument (CLI11 accepts both).
    std::string* value = eq != std::string::npos ? nullptr
                         : i + 1 < args.size()   ? &args[i + 1]
                                                 : nullptr;
    std::string inline_value = eq != std::string::npos ? a.substr(eq + 1) : std::string();
    std::string& v = value ? *value : inline_value;
    if (flag == "--model" && (is_run || !is_preset(v))) v = s.config;
    if (flag == "--inputs") v = s.inputs;
    if (flag == "--save") v = s.save;
    if (eq != std::string::npos) a = flag + "=" + v;
    if (!is_run) continue;
    double sum = 0;
    int count = 0;
    const double m = max_magnitude(v, &sum, &count);
    if (flag == "--prompts" && (sum > 64 || count > 8)) return false;
    if ((flag == "--decode-steps" && m > 8) || (flag == "--chunk" && m > 64) ||
        (flag == "--page-size" && m > 64) || (flag == "--threads" && m > 2) ||
        (flag == "--verify-tokens" && m > 64))
      return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args(1);
  for (size_t i = 0; i < size; ++i) {
    if (data[i] == '\n') {
      if (args.size() == kMaxArgs) return 0;
      args.emplace_back();
    } else if (data[i] == 0 || args.back().size() == kMaxArgBytes) {
      return 0;
    } else {
      args.back().push_back(char(data[i]));
    }
  }
  bool is_run = false, has_prompts = false;
  for (const auto& a : args) {
    if (a == "bench" || a == "calibrate") return 0;
    is_run = is_run || a == "run";
    has_prompts = has_prompts || a.rfind("--prompts", 0) == 0 || a.rfind("--inputs", 0) == 0;
  }
  // The default run (1500 + 700 tokens of DeepSeek-V3.2) is the CLI tests' job, not a fuzz input.
  if (is_run && !has_prompts) return 0;
  if (!make_local(args, is_run)) return 0;
  const int rc = call_cli(args);
  require(rc >= 0 && rc <= 3);
  return 0;
}
