#!/usr/bin/env bash
# Builds and runs every test of dsakit on this machine:
#   1. install dependencies (scripts/install-deps.sh),
#   2. Release build (CPU backend + CUDA backend for sm_90a when nvcc is present) and all CTest
#      tests (GPU tests run where a GPU is present and skip cleanly elsewhere),
#   3. an ASan+UBSan build of the host code (clang) and its unit tests,
#   4. a TSan build (clang + LLVM libomp + archer) of the host code and its unit tests,
#   5. the Python cross-checks (numpy + ml_dtypes) and the command-line tests, then the Python
#      package: its wheel built CPU-only (pip wheel, no build isolation: the venv's pinned
#      scikit-build-core and nanobind) and tests/pydsakit run against that wheel (docs/python.md),
#   6. a short fixed-time libFuzzer run over the safetensors reader, the config parser, the layer
#      API and the command line.
# Build folders live inside the checkout (build/, build-asan/, build-tsan/, build-wheel/,
# build-fuzz*/). Set DSAKIT_JOBS to limit parallelism (default: nproc).
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

# The sanitizer builds use clang: GCC's libgomp is not TSan-aware (clang's -fopenmp links LLVM's
# libomp, and archer tells TSan about OpenMP's synchronisation), and clang builds the ASan + UBSan
# tree faster (docs/reliability.md).
clang_cxx=$(command -v clang++ || command -v clang++-14)

step "sanitizer build (clang, address,undefined; host code only)"
cmake -S . -B build-asan -G Ninja -DCMAKE_CXX_COMPILER="$clang_cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSAKIT_CUDA=OFF -DDSAKIT_BENCH=OFF \
  -DDSAKIT_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j "$jobs"

step "tests (address,undefined)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  DSAKIT_TEST_BACKENDS=cpu ctest --test-dir build-asan --output-on-failure -j "$jobs" -L unit

step "thread sanitizer build (clang, LLVM libomp + archer; host code only)"
archer=$(dirname "$(readlink -f "$clang_cxx")")/../lib/libarcher.so  # next to clang's libraries
cmake -S . -B build-tsan -G Ninja -DCMAKE_CXX_COMPILER="$clang_cxx" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDSAKIT_CUDA=OFF -DDSAKIT_BENCH=OFF -DDSAKIT_SANITIZE=thread >/dev/null
cmake --build build-tsan -j "$jobs"

step "tests (thread; 2 OpenMP threads per test)"
OMP_NUM_THREADS=2 OMP_TOOL_LIBRARIES="$archer" DSAKIT_TEST_BACKENDS=cpu \
  TSAN_OPTIONS="halt_on_error=1 suppressions=$PWD/scripts/tsan.supp" \
  ctest --test-dir build-tsan --output-on-failure -j "$jobs" -L unit

step "python cross-checks and command-line tests"
DSAKIT_BUILD_DIR=build .venv/bin/python -m pytest -q tests/python tests/cli

step "python package: the wheel (CPU-only) and its tests"
rm -rf build-wheel/dist
CMAKE_BUILD_PARALLEL_LEVEL=$jobs .venv/bin/python -m pip wheel . -q --no-build-isolation \
  --no-deps --disable-pip-version-check -w build-wheel/dist -C build-dir=build-wheel/cmake \
  -C cmake.define.DSAKIT_CUDA=OFF
DSAKIT_WHEEL_DIR=build-wheel/dist DSAKIT_BUILD_DIR=build .venv/bin/python -m pytest -q tests/pydsakit

step "fuzzing (${DSAKIT_FUZZ_SECONDS:-20}s per target)"
bash scripts/fuzz.sh "${DSAKIT_FUZZ_SECONDS:-20}"

step "done in $(( $(date +%s) - start ))s"
