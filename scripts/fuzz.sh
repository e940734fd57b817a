#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) into build-fuzz/ and runs each for
# SECONDS (default 20). Exits non-zero on the first crash, leak, sanitizer report or timeout;
# the reproducer lands in build-fuzz/artifacts/.
#   scripts/fuzz.sh [SECONDS]
# Seeds come from fuzz/corpus/<target>/ (read-only); new inputs collect in
# build-fuzz/corpus/<target>/ and are reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-20}
cxx=${DSAKIT_FUZZ_CXX:-$(command -v clang++ || command -v clang++-14 || true)}
if [[ -z "$cxx" ]]; then
  echo "fuzz.sh: clang++ not found (set DSAKIT_FUZZ_CXX)" >&2
  exit 1
fi

cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
cmake --build build-fuzz

mkdir -p build-fuzz/artifacts
for target in safetensors config; do
  mkdir -p "build-fuzz/corpus/$target"
  echo "=== fuzz_$target for ${seconds}s"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "build-fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -max_len=65536 -dict="fuzz/$target.dict" -print_final_stats=1 \
      -artifact_prefix="build-fuzz/artifacts/$target-" \
      "build-fuzz/corpus/$target" "fuzz/corpus/$target"
done
echo "=== fuzzing found nothing"
