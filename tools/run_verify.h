// `dsakit run --verify` (docs/cli.md): sampled tokens of a run against the float64 reference,
// rebuilt from the pool contents after the run with the reference's own decoder, indexer and
// top-k; bounds from docs/numerics.md.
#pragma once

#include <cstdint>

#include "tools/run_command.h"
#include "tools/run_state.h"

namespace dsakit::cli {

struct VerifyResult {
  double o_rel = 0, lse_abs = 0, topk_agree = 1;  // rel-L2 of o, max |Δlse|, top-k sets equal
  int64_t tokens = 0, sparse_tokens = 0;          // tokens checked, of them through top-k
  double tol = 0, lse_tol = 1e-3;
  bool pass = true;
};

VerifyResult verify_run(const RunOptions& options, const RunState& run);

}  // namespace dsakit::cli
