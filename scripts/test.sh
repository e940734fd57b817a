#!/usr/bin/env bash
# Builds and runs every test of dsakit on this machine:
#   1. install dependencies (scripts/install-deps.sh),
#   2. Release build (CPU backend + CUDA backend for sm_90a when nvcc is present) and all CTest
#      tests (GPU tests run where a GPU is present and skip cleanly elsewhere),
#   3. an ASan+UBSan build of the host code and its unit tests,
#   4. the Python cross-checks (numpy + ml_dtypes) and the command-line tests,
#   5. a short fixed-time libFuzzer run over the safetensors reader and the config parser.
# Build folders live inside the checkout (build/, build-asan/). Set DSAKIT_JOBS to limit
# parallelism (default: nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DSAKIT_JOBS:-$(nproc)}
start=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - start ))s] $*"; }

step "dependencies"
bash scripts/install-deps.sh

step "release build"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"

step "tests (release)"
ctest --test-dir build --output-on-failure -j "$jobs"

step "sanitizer build (address,undefined; host code only)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSAKIT_CUDA=OFF \
  -DDSAKIT_BENCH=OFF -DDSAKIT_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j "$jobs"

step "tests (address,undefined)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  DSAKIT_TEST_BACKENDS=cpu ctest --test-dir build-asan --output-on-failure -j "$jobs" -L unit

step "python cross-checks and command-line tests"
DSAKIT_BUILD_DIR=build .venv/bin/python -m pytest -q tests/python tests/cli

step "fuzzing (${DSAKIT_FUZZ_SECONDS:-20}s per target)"
bash scripts/fuzz.sh "${DSAKIT_FUZZ_SECONDS:-20}"

step "done in $(( $(date +%s) - start ))s"
