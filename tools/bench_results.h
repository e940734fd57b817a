// What `dsakit bench` reports (docs/cli.md, docs/benchmarks.md): the JSON document (rewritten
// after every shape), the table on stdout, the per-group summary and the figures.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dsakit/backend.h"
#include "dsakit/config.h"
#include "dsakit/plan.h"
#include "tools/bench_command.h"
#include "tools/measure.h"

namespace dsakit::cli {

// The document before any row: format, device, ceilings, profile, method; "complete": false.
nlohmann::json bench_document(const Backend& backend, const Backend::Ceilings& ceilings,
                              const DispatchPolicy& policy, const BenchOptions& options);

// One shape's row (the shape `bench` has prepared): its group (LayerBench::group), the layers'
// weights and sparse rows, the shape, each mode's timing with its path, FLOP rate and share of
// the GEMM ceiling, and the oracle (fastest exact whole-batch path measured: dense, sparse, and
// the sparse path's masked form where the "masked" mode ran) with the speed-ups over it.
nlohmann::json bench_row(const LayerBench& bench, const BenchShape& shape,
                         const std::vector<std::string>& modes,
                         const std::vector<PolicyTiming>& timings, double gemm_tflops);

// Writes the document to `path` atomically; nothing when `path` is empty.
void write_bench_json(const std::string& path, const nlohmann::json& doc);

// The table: the ceilings line and the column header, then a line per row.
void print_bench_header(const std::string& device_name, const Backend::Ceilings& ceilings);
void print_bench_row(const nlohmann::json& row);

// The figures of a run per group (speed-ups over always-sparse, cost and rule against the
// oracle), and their printout.
nlohmann::json summarize(const nlohmann::json& rows);
void print_summary(const nlohmann::json& summary);

// Runs tools/plot_bench.py on the JSON (matplotlib; optional: a failure is reported, not thrown).
void run_plot(const std::string& json_path, const std::string& prefix, const std::string& format);

}  // namespace dsakit::cli
