#!/usr/bin/env bash
# The Python package on the H200, in one device call (docs/python.md#tests):
#   1. build the wheel, CPU + CUDA (sm_90a), with the machine's own scikit-build-core and
#      nanobind (pip wheel --no-build-isolation: nothing is fetched) on every core, and the
#      dsakit CLI from the same CMake tree (the layer is compared with its --save output),
#   2. pytest tests/pydsakit against that wheel (installed into a fresh folder by the tests'
#      conftest): the GPU tests of test_py_cuda.py (ops vs golden files and references with torch
#      CUDA tensors, zero-copy, the caller's stream, torch.compile(fullgraph=True), CUDA graphs,
#      the layer vs the CLI on CUDA) and every CPU test (torch CPU, NumPy, the fresh-venv wheel),
#   3. the binding's overhead per layer call (tools/python_overhead.py) on the CPU and on CUDA,
# then prints a short table last. Logs land in $OUT (or out/). Needs no network.
# Usage: tools/device-python.sh            (PYTHON=... picks the interpreter; default python3)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
py=${PYTHON:-python3}
jobs=$(nproc)
t0=$(date +%s)
note() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
declare -A result
declare -A took
order=(build cli install tests bench-cpu bench-cuda)

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvcc --version | tail -1
  "$py" -c 'import sys, numpy, torch, nanobind, scikit_build_core, pytest
print("python", sys.version.split()[0], "| torch", torch.__version__, "| numpy", numpy.__version__,
      "| nanobind", nanobind.__version__, "| scikit-build-core", scikit_build_core.__version__,
      "| pytest", pytest.__version__)'
} 2>&1 | tee "$out/env.txt"

stage() {  # stage NAME LOG CMD...: runs CMD with its output in LOG, records PASS/FAIL and time
  local name=$1 log=$2 s=$(date +%s)
  shift 2
  note "$name"
  if "$@" >"$log" 2>&1; then result[$name]=PASS; else result[$name]=FAIL; tail -30 "$log"; fi
  took[$name]=$(( $(date +%s) - s ))
}

# 1. the wheel: CUDA is on wherever nvcc is found (the default); sm_90a comes from CMakeLists.
# The extension is built with the C++ compiler whose libstdc++ the interpreter loads (a newer GCC
# on the PATH, e.g. under /opt, puts its headers' inline code over the system's older runtime:
# docs/python.md, "Building"): PY_CXX overrides.
rm -rf build-pydev/dist
py_cxx=${PY_CXX:-}
if [ -z "$py_cxx" ] && [ -x /usr/bin/g++ ]; then py_cxx=/usr/bin/g++; fi
if [ -n "$py_cxx" ]; then
  export CXX=$py_cxx CUDAHOSTCXX=$py_cxx
  echo "C++ compiler for the extension: $py_cxx ($($py_cxx --version | head -1))" | tee -a "$out/env.txt"
fi
stage build "$out/build.log" env CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$py" -m pip wheel . \
  --no-build-isolation --no-deps --disable-pip-version-check -v -w build-pydev/dist \
  -C build-dir=build-pydev/cmake -C cmake.define.DSAKIT_CUDA=ON
ls -la build-pydev/dist >>"$out/build.log" 2>&1
grep -E "spill|Local memory" "$out/build.log" | sort -u >"$out/spills.txt"
if [ "${result[build]}" = PASS ]; then
  stage cli "$out/cli.log" cmake --build build-pydev/cmake --target dsakit_cli -j "$jobs"
fi

# the wheel installed into a fresh folder: has it the CUDA backend, does it see the GPU?
site=$(mktemp -d)
check=$(cd "$out" && pwd)/check.py
cat >"$check" <<'EOF'
import faulthandler, sys
faulthandler.enable()
import dsakit
print(dsakit.__file__, "| cuda compiled:", dsakit.cuda_compiled(), "| GPUs:",
      dsakit.cuda_device_count(), flush=True)
if dsakit.cuda_device_count():
    print(dsakit.device_name("cuda:0"), flush=True)
    print(dsakit.kernel_instances("cuda:0"), flush=True)
ok = dsakit.cuda_compiled() and dsakit.cuda_device_count()
print("check done; exiting", flush=True)
sys.exit(0 if ok else 1)
EOF
install_wheel() {
  "$py" -m pip install --no-deps --no-index --disable-pip-version-check --target "$site" \
    build-pydev/dist/dsakit-*.whl && (cd / && PYTHONPATH="$site" "$py" -X faulthandler "$check")
}
if [ "${result[build]}" = PASS ]; then
  stage install "$out/install.log" install_wheel
  tail -3 "$out/install.log"
fi

# 2. the tests, against the wheel (the conftest installs it again into a fresh folder)
if [ "${result[build]}" = PASS ]; then
  cli_dir=build-pydev/cmake
  [ "${result[cli]:-FAIL}" = PASS ] || cli_dir=build-pydev/missing-cli
  stage tests "$out/pytest.log" env DSAKIT_WHEEL_DIR=build-pydev/dist DSAKIT_BUILD_DIR="$cli_dir" \
    timeout 480 "$py" -m pytest tests/pydsakit -v -rs --junitxml="$out/pytest.xml"
  tail -15 "$out/pytest.log"
fi

# 3. the overhead per layer call (host us), from the installed wheel
if [ "${result[install]:-FAIL}" = PASS ]; then
  stage bench-cpu "$out/bench_cpu.txt" env PYTHONPATH="$site" "$py" tools/python_overhead.py \
    --device cpu --framework torch
  stage bench-cuda "$out/bench_cuda.txt" env PYTHONPATH="$site" "$py" tools/python_overhead.py \
    --device cuda
  cat "$out/bench_cpu.txt" "$out/bench_cuda.txt"
fi

note "done"
echo
echo "== dsakit Python package on $(head -1 "$out/env.txt" | cut -d, -f1) =="
printf '%-12s %-6s %6s\n' step result seconds
for k in "${order[@]}"; do
  [ -n "${result[$k]:-}" ] && printf '%-12s %-6s %6s\n' "$k" "${result[$k]}" "${took[$k]}"
done
if [ -f "$out/pytest.xml" ]; then
  "$py" - "$out/pytest.xml" <<'EOF'
import collections, sys, xml.etree.ElementTree as ET
counts = collections.defaultdict(collections.Counter)
for case in ET.parse(sys.argv[1]).iter("testcase"):
    group = case.get("classname", "").split(".")[-1] or "?"
    state = "failed" if case.find("failure") is not None or case.find("error") is not None \
        else "skipped" if case.find("skipped") is not None else "passed"
    counts[group][state] += 1
print(f"{'test file':<16} {'passed':>6} {'failed':>6} {'skipped':>7}")
for group, c in sorted(counts.items()):
    print(f"{group:<16} {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7}")
EOF
fi
for f in "$out/bench_cpu.txt" "$out/bench_cuda.txt"; do
  [ -f "$f" ] && grep -E "overhead" "$f" | sed "s|^|$(basename "$f" .txt): |"
done
fail=0
for k in "${order[@]}"; do [ "${result[$k]:-PASS}" = FAIL ] && fail=1; done
exit $fail
