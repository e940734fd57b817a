// `dsakit run`: one batch through the layer (optionally chunked, after a cached prefix, followed by
// decode steps), with per-stage times, optional float64 verification and safetensors I/O.
#pragma once

#include <cstdint>
#include <string>

namespace dsakit::cli {

struct RunOptions {
  std::string model = "deepseek-v3.2";
  int tp = 8;
  std::string device = "auto";
  int threads = 0;
  std::string kv = "fp8";
  std::string scale_policy = "pow2";
  double k_scale = 1.0;
  int page_size = 64;
  std::string prompts = "1500,700";
  std::string prefix;  // empty: no cached prefix
  int chunk = 0;
  int decode_steps = 0;
  std::string dispatch = "rule";
  std::string profile;  // cost-mode calibration profile (dsakit calibrate)
  int64_t threshold = -1;
  bool allow_approx = false;
  double sm_scale = 0;
  uint64_t seed = 1;
  bool verify = false;
  int verify_tokens = 48;  // sampled tokens per request for --verify
  // rel-L2 bound on o; 0: docs/numerics.md#tolerances (1e-2 bf16 pool, 3e-2 fp8 pools)
  double verify_tol = 0;
  bool fp8_weights = false;  // kv_b_proj also in its FP8 form (LayerOptions::kv_b_proj_fp8)
  std::string inputs;
  std::string save;
  bool json = false;
  bool quiet = false;
  int64_t max_workspace_mb = 0;      // LayerOptions::max_workspace_bytes in MiB; 0: no limit
  std::string sparse_rows = "auto";  // LayerOptions::sparse_rows: auto | pool | staged
  std::string sparse_form = "auto";  // LayerOptions::sparse_form: auto | mla | masked-mha
  int dcp = 0;  // > 0: context parallelism over this many GPUs (tools/dcp_command)
};

// Returns the process exit code; throws dsakit::Error for bad input.
int run_command(const RunOptions& options);

}  // namespace dsakit::cli
