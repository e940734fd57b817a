// dsakit: the command line (tools/cli_app.cc). Subcommands: run, plan, info.
#include "tools/cli_app.h"

int main(int argc, char** argv) {
  return dsakit::cli::run_cli(argc, argv);
}
