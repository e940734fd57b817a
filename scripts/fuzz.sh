#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for SECONDS (default 20).
# Exits non-zero on the first crash, leak, sanitizer report or timeout; the reproducer lands in
# build-fuzz/artifacts/.
#   scripts/fuzz.sh [SECONDS]
# Targets: safetensors and config (the file readers; standalone project fuzz/ -> build-fuzz/),
# layer (DsaAttention::forward on the CPU backend) and cli (the command line in-process; both
# over the coverage-instrumented library of a main build -> build-fuzz-lib/).
# Seeds come from fuzz/corpus/<target>/ (read-only); new inputs collect in
# build-fuzz/corpus/<target>/ and are reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
jobs=${DSAKIT_JOBS:-$(nproc)}
cxx=${DSAKIT_FUZZ_CXX:-$(command -v clang++ || command -v clang++-14 || true)}
if [[ -z "$cxx" ]]; then
  echo "fuzz.sh: clang++ not found (set DSAKIT_FUZZ_CXX)" >&2
  exit 1
fi

cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build build-fuzz -j "$jobs"
cmake -S . -B build-fuzz-lib -G Ninja -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDSAKIT_CUDA=OFF -DDSAKIT_TESTS=OFF -DDSAKIT_BENCH=OFF -DDSAKIT_FUZZ=ON \
  -DDSAKIT_SANITIZE=fuzzer-no-link,address,undefined >/dev/null
cmake --build build-fuzz-lib -j "$jobs" --target fuzz_layer fuzz_cli

# target, binary, extra libFuzzer flags
run_target() {
  local target=$1 binary=$2
  shift 2
  mkdir -p "build-fuzz/corpus/$target"
  echo "=== fuzz_$target for ${seconds}s"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 OMP_NUM_THREADS=1 \
    "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -print_funcs=0 \
      -artifact_prefix="build-fuzz/artifacts/$target-" "$@" \
      "build-fuzz/corpus/$target" "fuzz/corpus/$target"
}

mkdir -p build-fuzz/artifacts
run_target safetensors build-fuzz/fuzz_safetensors -max_len=65536 -dict=fuzz/safetensors.dict
run_target config build-fuzz/fuzz_config -max_len=65536 -dict=fuzz/config.dict
run_target layer build-fuzz-lib/fuzz/fuzz_layer -max_len=4096
# The CLI prints reports and errors: keep them off the log (sanitizer reports still show).
run_target cli build-fuzz-lib/fuzz/fuzz_cli -max_len=2048 -dict=fuzz/cli.dict -close_fd_mask=3
echo "=== fuzzing found nothing"
