// `dsakit run --dcp W` and `dsakit bench --dcp W`: the layer under context parallelism on W GPUs
// of this host, one process per GPU over NCCL (dsakit/dcp.h run_dcp_on_gpus), against the same
// work on one GPU (docs/cli.md, docs/layer.md).
#pragma once

#include "tools/bench_command.h"
#include "tools/run_command.h"

namespace dsakit::cli {

// The run's steps on W ranks; rank 0 reports. --verify: rank 0 also runs the same steps through
// DsaAttention on its GPU and checks the W-rank outputs against it (o rel-L2, lse, top-k sets
// identical) and both against the float64 reference. Returns the exit code.
int run_dcp_command(const RunOptions& options);

// Per fresh prompt length (--fresh, default 16384,65536) and model (--models, first layout of
// --kv): the median time of one forward on W ranks and on one GPU, and their ratio.
int bench_dcp_command(const BenchOptions& options);

}  // namespace dsakit::cli
