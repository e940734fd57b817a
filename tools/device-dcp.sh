#!/usr/bin/env bash
# Context parallelism on a multi-GPU host, in one device call (docs/layer.md, docs/cuda.md):
#   1. build for sm_90a with NCCL (the CUDA toolkit's, else the PyPI wheel's under the Python
#      that has torch: NCCL_ROOT),
#   2. the DCP tests of the GoogleTest suite on the CUDA backend (DcpSimulation: W ranks on
#      threads over one GPU),
#   3. `dsakit run --dcp W --verify` (W processes over NCCL) against one GPU and the float64
#      reference: fresh, chunked, cached prefix and decode, both presets, three pool layouts,
#   4. compute-sanitizer memcheck over one `run --dcp W` (every process),
#   5. `dsakit bench --dcp W`: fresh prompts on W GPUs against one (DCP_BENCH_FRESH, default
#      16384,65536; DeepSeek-V3.2 H=128, FP8 pool),
# then prints a pass/fail table last. Logs land in $OUT (or out/).
# Usage: tools/device-dcp.sh [W]   (default: every GPU of the host)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
world=${1:-$(nvidia-smi -L | wc -l)}
t0=$(date +%s)
note() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
declare -A result
order=()
check() {  # check NAME LOG TIMEOUT CMD...: PASS/FAIL by exit code
  local name=$1 log=$2 limit=$3
  shift 3
  order+=("$name")
  if timeout "$limit" "$@" >>"$log" 2>&1; then result[$name]=PASS
  else result[$name]="FAIL(rc $?)"; tail -15 "$log"; fi
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
nvidia-smi topo -m >>"$out/gpu.txt" 2>&1
nccl_root=
if ! ls /usr/local/cuda/lib*/libnccl.so* >/dev/null 2>&1; then
  nccl_root=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' \
    2>/dev/null || true)
fi
note "build ($world GPUs, NCCL ${nccl_root:-from the CUDA toolkit})"
if cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSAKIT_BENCH=ON \
     ${nccl_root:+-DNCCL_ROOT="$nccl_root"} >"$out/build.log" 2>&1 &&
   cmake --build build-dev -j "$(nproc)" >>"$out/build.log" 2>&1 &&
   grep -q "dsakit: NCCL" "$out/build.log"; then
  result[build]=PASS
else
  result[build]=FAIL
  tail -30 "$out/build.log"
fi
order+=(build)
[ -n "$nccl_root" ] && export LD_LIBRARY_PATH="$nccl_root/lib:${LD_LIBRARY_PATH:-}"
dsakit=build-dev/bin/dsakit

export DSAKIT_TEST_BACKENDS=cuda
if [ "${result[build]}" = PASS ]; then
  note "DCP tests (CUDA backend, in-process ranks)"
  check tests "$out/tests.log" 300 env DSAKIT_TEST_BACKENDS=cuda build-dev/tests/test_layer \
    --gtest_brief=1 --gtest_filter='*Dcp*'
  check ops "$out/tests.log" 300 env DSAKIT_TEST_BACKENDS=cuda build-dev/tests/test_dcp_ops \
    --gtest_brief=1
  check memcheck:ops "$out/memcheck_ops.log" 300 compute-sanitizer --tool memcheck \
    --error-exitcode 9 build-dev/tests/test_dcp_ops --gtest_brief=1

  note "dsakit run --dcp $world --verify"
  for spec in "deepseek-v3.2 8 fp8" "deepseek-v3.2 8 fp8-raw" "glm-5 4 bf16" "deepseek-v3.2 1 fp8"; do
    set -- $spec
    for sc in fresh chunked prefix decode; do
      case $sc in
        fresh) args=(--prompts 3000,700) ;;
        chunked) args=(--prompts 5000,900 --chunk 1024) ;;
        prefix) args=(--prompts 2600,900 --prefix 2000,300) ;;
        decode) args=(--prompts 2200,500 --decode-steps 4) ;;
      esac
      [ "$2" = 1 ] && [ $sc != chunked ] && continue
      echo "=== $1 tp$2 $3 $sc" >>"$out/verify.log"
      check "run:$1:tp$2:$3:$sc" "$out/verify.log" 240 $dsakit run --dcp "$world" --model "$1" \
        --tp "$2" --kv "$3" "${args[@]}" --verify --verify-tokens 16
      grep -E "^(verify|dcp vs)" "$out/verify.log" | tail -4 | sed "s/^/  /"
    done
  done
  # Forced dense: the CUDA dense kernel has no per-query visible counts, so the ranks refuse it
  # with a clear error (exit 2) rather than run another path than asked.
  echo "=== dense forced" >>"$out/verify.log"
  order+=(refuse:dense)
  timeout 120 $dsakit run --dcp "$world" --prompts 1500,700 --dispatch dense --verify \
    >>"$out/verify.log" 2>&1
  rc=$?
  if [ $rc = 2 ] && grep -q "per-query visible counts" "$out/verify.log"; then
    result[refuse:dense]=PASS
  else result[refuse:dense]="FAIL(rc $rc)"; fi

  note "compute-sanitizer memcheck, every process"
  # NCCL probes kernels of other architectures at init (cudaFuncGetAttributes ->
  # cudaErrorNoKernelImageForDevice, handled inside NCCL): API errors are not reported here; the
  # device memory accesses of every kernel are.
  check memcheck "$out/memcheck.log" 300 compute-sanitizer --tool memcheck --target-processes all \
    --report-api-errors no --error-exitcode 9 $dsakit run --dcp "$world" --prompts 2600,300 --chunk 1000 --quiet
  grep -h "ERROR SUMMARY" "$out/memcheck.log" | sed 's/^/  /'

  note "dsakit bench --dcp $world"
  check bench "$out/bench_dcp.txt" 420 $dsakit bench --dcp "$world" \
    --fresh "${DCP_BENCH_FRESH:-16384,65536}" --models "${DCP_BENCH_MODELS:-deepseek-v3.2:1}" \
    --kv "${DCP_BENCH_KV:-fp8}" --runs 5 --min-runs 3
  cat "$out/bench_dcp.txt"
fi

note "done"
echo
printf '%-36s %s\n' CHECK RESULT
for k in "${order[@]}"; do printf '%-36s %s\n' "$k" "${result[$k]}"; done
fail=0
for k in "${order[@]}"; do [ "${result[$k]}" = PASS ] || fail=1; done
exit $fail
