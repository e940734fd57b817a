#!/usr/bin/env bash
# Builds dsakit and runs its main job: one DSA layer call on the embedded default
# (DeepSeek-V3.2 at TP8, a 1,500 + 700 token batch, FP8 pool, dispatcher in rule mode) on the
# GPU when one is present, else on the CPU, verified against the float64 reference.
# Extra arguments go to `dsakit run` (try: scripts/run.sh --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "${DSAKIT_JOBS:-$(nproc)}" --target dsakit_cli
exec build/bin/dsakit run --verify "$@"
