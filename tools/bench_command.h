// `dsakit bench` (the whole layer call per dispatch mode over a grid of shapes, with a table,
// JSON and plots) and `dsakit calibrate` (the cost-mode profile). See docs/benchmarks.md.
#pragma once

#include <cstdint>
#include <string>

namespace dsakit::cli {

struct BenchOptions {
  std::string device = "auto";
  int threads = 0;
  std::string models;  // "deepseek-v3.2:8,glm-5:4"; empty: by device (see --help)
  std::string kv = "bf16,fp8";
  std::string grid;                      // quick | small | full; empty: full on cuda, small on cpu
  std::string fresh, prefixes, extends;  // override the grid's lists
  bool no_mixed = false;
  std::string modes = "dense,sparse,rule,cost";
  std::string profile;      // cost-mode profile (or DSAKIT_PROFILE)
  int runs = 50;            // timed calls per mode at most (median)
  int min_runs = 5;         // ... and at least
  double budget_ms = 1000;  // per shape: stop adding runs once spent (after min_runs)
  bool stages = true;
  bool fp8_weights = false;          // kv_b_proj also in FP8 form (fp8 / fp8-raw pools' dense path)
  std::string sparse_rows = "auto";  // LayerOptions::sparse_rows: auto | pool | staged
  std::string sparse_form = "auto";  // LayerOptions::sparse_form: auto | mla | masked-mha
  std::string json, plot, plot_format = "png";
  uint64_t seed = 1;
  bool quiet = false;
  int dcp = 0;  // > 0: W-GPU context parallelism against one GPU (tools/dcp_command)
};

struct CalibrateOptions {
  std::string device = "auto";
  int threads = 0;
  std::string models;
  std::string kv = "bf16,fp8";
  std::string out = "dsakit-profile.json";
  int runs = 20;
  double budget_ms = 800;
  uint64_t seed = 7;
  bool quiet = false;
};

int bench_command(const BenchOptions& options);
int calibrate_command(const CalibrateOptions& options);

}  // namespace dsakit::cli
