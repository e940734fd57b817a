// The dsakit command line as a function: parses argv, runs the subcommand, prints its report and
// errors, and returns the process exit code (tools/cli_common.h). Never exits the process.
#pragma once

namespace dsakit::cli {

int run_cli(int argc, char** argv);

}  // namespace dsakit::cli
