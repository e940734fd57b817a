// dsakit: the command line (tools/cli_app.cc). Subcommands: run, plan, bench, calibrate, info.
#include "tools/cli_app.h"

int main(int argc, char** argv) {
  return dsakit::cli::run_cli(argc, argv);
}
