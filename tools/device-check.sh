#!/usr/bin/env bash
# The H200 check, in one call of the device tool (see docs/cuda.md):
#   1. build for sm_90a (Release, CUDA on) with every core,
#   2. the whole GoogleTest suite against the cuda backend (DSAKIT_TEST_BACKENDS, default cuda),
#   3. compute-sanitizer memcheck / racecheck / initcheck on the CUDA test binaries,
#   4. `dsakit run --device cuda --verify` over both presets x three layouts x
#      {fresh, chunked, prefix-hit, decode}, fp8-raw at 32 heads, with --fp8-weights on both FP8
#      layouts, with --sparse-form masked-mha on both presets, and in cost mode with the auto
#      sparse form (a profile calibrated in the call),
#   5. the CUDA benchmark and the PyTorch SDPA peer,
# then prints a pass/fail table last. Logs land in $OUT (or out/). The golden peer files are read
# from tests/data/peers (in the tree; DSAKIT_PEERS_DIR overrides).
#   6. (explicit only) `dsakit calibrate` into $OUT/profile.json and `dsakit bench` with it
#      (DSAKIT_BENCH_MODELS, DSAKIT_PROFILE_IN, DSAKIT_LAYERBENCH_ARGS pass through).
#   7. (explicit only) `profile`: ncu per-kernel times of a short-prompt call on both paths.
#   8. (explicit only) `sparsebench`: `dsakit_bench_cuda --sparse` (every compiled sparse MLA
#      kernel per shape and the row-gather bound) into $OUT/bench_sparse.{txt,json}, then
#      `--issue-rates` (the widening conversion's and ALU instructions' rates an SM) into
#      $OUT/issue_rates.{txt,json}.
#   9. (explicit only) `indexerbench`: `dsakit_bench_cuda --indexer` (each logits kernel, top-k,
#      indexer_topk at 4K-64K tokens) and the torch.topk peer (bench/peer_topk.py) in the same
#      call, into $OUT/bench_indexer.{txt,json} and $OUT/peer_topk.{txt,json}.
#  10. (explicit only) `densebench`: `dsakit_bench_cuda --dense` (every compiled dense MHA kernel
#      per shape: fresh prompts 1K-16K, TP shards, varlen batches with prefixes) and the cuDNN
#      peer (bench/peer_sdpa.py) in the same call, into $OUT/bench_dense.{txt,json} and
#      $OUT/peer_sdpa.{txt,json}.
# Usage: tools/device-check.sh [all|build|tests|sanitize|verify|bench|calibrate|layerbench|profile|
#                               sparsebench|indexerbench|densebench]...
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-out}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(all)
want() { [[ " ${steps[*]} " == *" all "* || " ${steps[*]} " == *" $1 "* ]]; }
explicit() { [[ " ${steps[*]} " == *" $1 "* ]]; }  # steps not part of 'all'
SAN_TIMEOUT=${SAN_TIMEOUT:-420}
san() {  # tool binary: one job (gtest filter from SAN_FILTER); its verdict goes to a .rc file
  local log="$out/san_$1_$(basename "$2").log"
  ( timeout "$SAN_TIMEOUT" compute-sanitizer --tool "$1" --error-exitcode 9 "$2" --gtest_brief=1 \
      --gtest_filter="${SAN_FILTER:-*}" >"$log" 2>&1; echo $? >"$log.rc" ) &
}
declare -A result
t0=$(date +%s)
note() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export DSAKIT_TEST_BACKENDS=${DSAKIT_TEST_BACKENDS:-cuda}
jobs=$(nproc)

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
  --format=csv >"$out/gpu.txt" 2>&1
nvcc --version | tail -1 >>"$out/gpu.txt"
cat "$out/gpu.txt"

note "build"
if cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSAKIT_BENCH=ON >"$out/build.log" 2>&1 &&
   cmake --build build-dev -j "$jobs" >>"$out/build.log" 2>&1; then
  result[build]=PASS
else
  result[build]=FAIL
  tail -40 "$out/build.log"
fi
grep -E "spill|Local memory" "$out/build.log" | sort -u >"$out/spills.txt"

if [ "${result[build]}" = PASS ] && want tests; then
  note "tests (backends: $DSAKIT_TEST_BACKENDS)"
  for t in build-dev/tests/${TEST_GLOB:-test_*}; do
    name=$(basename "$t")
    if timeout 300 "$t" --gtest_brief=1 >"$out/$name.log" 2>&1; then result[$name]=PASS
    else result[$name]=FAIL; tail -25 "$out/$name.log"; fi
  done
fi

if [ "${result[build]}" = PASS ] && want sanitize; then
  note "compute-sanitizer (parallel jobs, $SAN_TIMEOUT s each)"
  # memcheck over every test binary that drives the GPU (DSAKIT_TEST_BACKENDS=cuda), racecheck
  # and initcheck over the CUDA-specific suites.
  for t in test_cuda_backend test_cuda_attention test_pool test_indexer test_peers test_layer \
           test_hostile; do
    san memcheck "build-dev/tests/$t"
  done
  san racecheck build-dev/tests/test_cuda_attention
  san racecheck build-dev/tests/test_cuda_backend
fi
if [ "${result[build]}" = PASS ] && { want sanitize || explicit initcheck; }; then
  # initcheck does not track cuBLAS's stores (the probe below reproduces it in 20 lines): the
  # three tests that feed a cuBLAS output (absorb_q) into our sparse kernel are left to memcheck
  # and racecheck; every other test runs under initcheck.
  SAN_FILTER="-*DeterministicAndNoAllocationWhenWarm*:*RunsOnACallerStream*:*SparseForwardCapturesIntoACudaGraph*" \
    san initcheck build-dev/tests/test_cuda_backend
  san initcheck build-dev/tests/test_cuda_attention
  # Does initcheck see cuBLAS's stores? The probe reads a GEMM's output with a plain kernel,
  # once after a memset (must be clean) and once with only cuBLAS writing it (informational).
  for v in memset plain; do
    ( timeout 120 compute-sanitizer --tool initcheck --error-exitcode 9 build-dev/tests/initcheck_probe \
        "$v" >"$out/probe_initcheck_$v.log" 2>&1; echo $? >"$out/probe_initcheck_$v.rc" ) &
  done
  wait
  for v in memset plain; do
    rc=$(cat "$out/probe_initcheck_$v.rc"); rm -f "$out/probe_initcheck_$v.rc"
    summary=$(grep -hE "ERROR SUMMARY" "$out/probe_initcheck_$v.log" | tail -1)
    echo "  initcheck probe ($v): rc $rc, $summary"
    if [ $v = memset ]; then [ "$rc" = 0 ] && result[probe:initcheck:memset]=PASS || result[probe:initcheck:memset]="FAIL(rc $rc)"
    else probe_plain="rc $rc, $summary"; fi
  done
  for rc in "$out"/san_*.log.rc; do
    log=${rc%.rc}; base=$(basename "$log" .log); tool=${base#san_}; tool=${tool%%_*}
    bin=${base#san_"$tool"_}
    if [ "$(cat "$rc")" = 0 ]; then result["san:$tool:$bin"]=PASS
    else result["san:$tool:$bin"]="FAIL(rc $(cat "$rc"))"; tail -15 "$log"; fi
    grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -1 | sed "s/^/  $tool $bin: /"
  done
  rm -f "$out"/san_*.log.rc
fi

if [ "${result[build]}" = PASS ] && want verify; then
  note "dsakit run --device cuda --verify matrix"
  : >"$out/verify.log"
  for model in "deepseek-v3.2 8" "glm-5 4"; do
    set -- $model
    for kv in bf16 fp8 fp8-raw; do
      for sc in fresh chunked prefix decode; do
        case $sc in
          fresh) args=(--prompts 1500,700) ;;
          chunked) args=(--prompts 3000,700 --chunk 1024) ;;
          prefix) args=(--prompts 2600,900 --prefix 2000,300) ;;
          decode) args=(--prompts 2200,500 --decode-steps 4) ;;
        esac
        key="verify:$1:$kv:$sc"
        echo "=== $key" >>"$out/verify.log"
        if timeout 120 build-dev/bin/dsakit run --device cuda --model "$1" --tp "$2" --kv "$kv" \
             "${args[@]}" --verify --verify-tokens 24 >>"$out/verify.log" 2>&1; then
          result[$key]=PASS
        else
          result[$key]=FAIL
        fi
        grep -E "^verify" "$out/verify.log" | tail -1 | sed "s/^/  $key /"
      done
    done
  done
  # fp8-raw pools at 32 heads, which the layer reads directly (32-head work items): chunked over
  # a prefix, then decode.
  for model in "deepseek-v3.2 4" "glm-5 2"; do
    set -- $model
    key="verify:$1:tp$2:fp8-raw:prefix-decode"
    if timeout 120 build-dev/bin/dsakit run --device cuda --model "$1" --tp "$2" --kv fp8-raw \
         --prompts 3000,900 --prefix 2000,300 --chunk 1024 --decode-steps 2 --verify \
         --verify-tokens 24 >>"$out/verify.log" 2>&1; then result[$key]=PASS
    else result[$key]=FAIL; fi
  done
  # H = 128 / 64 (no tensor parallelism) once each.
  for model in deepseek-v3.2 glm-5; do
    key="verify:$model:tp1:fp8:chunked"
    if timeout 180 build-dev/bin/dsakit run --device cuda --model $model --tp 1 --prompts 2500 \
         --chunk 1000 --verify --verify-tokens 16 >>"$out/verify.log" 2>&1; then result[$key]=PASS
    else result[$key]=FAIL; fi
  done
  # The FP8 weights' up-projection (docs/layer.md#fp8-weights): dense over a prefix hit, both
  # FP8 layouts.
  for kv in fp8 fp8-raw; do
    key="verify:deepseek-v3.2:fp8-weights:$kv:prefix"
    if timeout 120 build-dev/bin/dsakit run --device cuda --kv $kv --prompts 1900,700 \
         --prefix 1500,0 --fp8-weights --verify --verify-tokens 24 >>"$out/verify.log" 2>&1; then
      result[$key]=PASS
    else result[$key]=FAIL; fi
  done
  # The sparse path's masked-MHA form (docs/layer.md#masked-mha): both presets past their top-k,
  # chunked over a prefix, then decode; the FP8 pool with its FP8 weights.
  for model in "deepseek-v3.2 8" "glm-5 4"; do
    set -- $model
    key="verify:$1:masked-mha:fp8"
    if timeout 120 build-dev/bin/dsakit run --device cuda --model "$1" --tp "$2" --kv fp8 \
         --prompts 3000,2500 --prefix 800,0 --chunk 1200 --decode-steps 2 --dispatch sparse \
         --sparse-form masked-mha --fp8-weights --verify --verify-tokens 24 >>"$out/verify.log" 2>&1
    then result[$key]=PASS
    else result[$key]=FAIL; fi
  done
  # Cost mode choosing the sparse form (`auto`): a profile of this GPU for the TP8 FP8 entry,
  # then a 4K prompt past the top-k chunked behind a short one; a step whose plan took the
  # masked form must appear.
  key="verify:deepseek-v3.2:auto-form:fp8"
  if timeout 120 build-dev/bin/dsakit calibrate --device cuda --models deepseek-v3.2:8 --kv fp8 \
       --out "$out/verify-profile.json" --quiet >>"$out/verify.log" 2>&1 &&
     timeout 120 build-dev/bin/dsakit run --device cuda --kv fp8 --prompts 4096,900 --chunk 2500 \
       --dispatch cost --profile "$out/verify-profile.json" --verify --verify-tokens 24 --json \
       >"$out/verify-auto.json" 2>>"$out/verify.log" &&
     grep -q "masked-MHA" "$out/verify-auto.json"; then result[$key]=PASS
  else result[$key]=FAIL; fi
fi

if [ "${result[build]}" = PASS ] && want bench; then
  note "benchmarks"
  # DSAKIT_BENCH_ARGS (e.g. --quick) and DSAKIT_INDEXER_KERNEL (scalar|tc|sm90-exact|sm90)
  # pass through.
  # shellcheck disable=SC2086
  if timeout 300 build-dev/bench/dsakit_bench_cuda ${DSAKIT_BENCH_ARGS:-} --json "$out/bench_cuda.json" \
       >"$out/bench_cuda.txt" 2>"$out/bench_cuda.err"; then result[bench]=PASS
  else result[bench]=FAIL; tail -5 "$out/bench_cuda.err"; fi
  if timeout 180 python3 bench/peer_sdpa.py "$out/peer_sdpa.json" >"$out/peer_sdpa.txt" \
       2>"$out/peer_sdpa.err"; then result[peer]=PASS
  else result[peer]=FAIL; tail -5 "$out/peer_sdpa.err"; fi
  cat "$out/bench_cuda.txt" "$out/peer_sdpa.txt"
fi

if [ "${result[build]}" = PASS ] && explicit densebench; then
  note "dense MHA kernels (every compiled kernel per shape) and the cuDNN peer"
  if timeout 300 build-dev/bench/dsakit_bench_cuda --dense ${DSAKIT_BENCH_ARGS:-} \
       --json "$out/bench_dense.json" >"$out/bench_dense.txt" 2>"$out/bench_dense.err"; then
    result[densebench]=PASS
  else result[densebench]=FAIL; tail -5 "$out/bench_dense.err"; fi
  if timeout 240 python3 bench/peer_sdpa.py "$out/peer_sdpa.json" >"$out/peer_sdpa.txt" \
       2>"$out/peer_sdpa.err"; then result[peer]=PASS
  else result[peer]=FAIL; tail -5 "$out/peer_sdpa.err"; fi
  cat "$out/bench_dense.txt" "$out/peer_sdpa.txt"
fi

if [ "${result[build]}" = PASS ] && explicit sparsebench; then
  note "sparse MLA kernels (every compiled kernel per shape, with the row-gather bound)"
  if timeout 420 build-dev/bench/dsakit_bench_cuda --sparse --json "$out/bench_sparse.json" \
       >"$out/bench_sparse.txt" 2>"$out/bench_sparse.err"; then result[sparsebench]=PASS
  else result[sparsebench]=FAIL; tail -5 "$out/bench_sparse.err"; fi
  cat "$out/bench_sparse.txt"
  if timeout 60 build-dev/bench/dsakit_bench_cuda --issue-rates --json "$out/issue_rates.json" \
       >"$out/issue_rates.txt" 2>&1; then result[issuerates]=PASS
  else result[issuerates]=FAIL; fi
  cat "$out/issue_rates.txt"
fi

if [ "${result[build]}" = PASS ] && explicit indexerbench; then
  note "indexer kernels (logits per kernel, top-k, indexer_topk) and the torch.topk peer"
  if timeout 240 build-dev/bench/dsakit_bench_cuda --indexer --json "$out/bench_indexer.json" \
       >"$out/bench_indexer.txt" 2>"$out/bench_indexer.err"; then result[indexerbench]=PASS
  else result[indexerbench]=FAIL; tail -5 "$out/bench_indexer.err"; fi
  if timeout 120 python3 bench/peer_topk.py "$out/peer_topk.json" >"$out/peer_topk.txt" 2>&1; then
    result[peer_topk]=PASS
  else result[peer_topk]=FAIL; tail -5 "$out/peer_topk.txt"; fi
  cat "$out/bench_indexer.txt" "$out/peer_topk.txt"
fi

# Layer benchmark steps (explicit only, not part of 'all': minutes of device time).
models=${DSAKIT_BENCH_MODELS:-deepseek-v3.2:1,deepseek-v3.2:8,glm-5:1,glm-5:4}
profile=${DSAKIT_PROFILE_IN:-$out/profile.json}
if [ "${result[build]}" = PASS ] && explicit calibrate; then
  note "dsakit calibrate ($models)"
  if timeout 400 build-dev/bin/dsakit calibrate --device cuda --models "$models" --kv bf16,fp8 \
       --out "$out/profile.json" >"$out/calibrate.txt" 2>"$out/calibrate.err"; then
    result[calibrate]=PASS
  else result[calibrate]=FAIL; tail -5 "$out/calibrate.err"; fi
  cat "$out/calibrate.txt"
fi
if [ "${result[build]}" = PASS ] && explicit layerbench; then
  bench_models=${DSAKIT_LAYERBENCH_MODELS:-$models}
  note "dsakit bench ($bench_models, profile $profile)"
  # shellcheck disable=SC2086
  if timeout "${LAYERBENCH_TIMEOUT:-420}" build-dev/bin/dsakit bench --device cuda --models "$bench_models" \
       --profile "$profile" --json "$out/bench_layer.json" ${DSAKIT_LAYERBENCH_ARGS:-} \
       >"$out/bench_layer.txt" 2>"$out/bench_layer.err"; then result[layerbench]=PASS
  else result[layerbench]=FAIL; tail -5 "$out/bench_layer.err"; fi
  tail -8 "$out/bench_layer.txt"
fi

if [ "${result[build]}" = PASS ] && explicit profile; then
  # Per-kernel GPU times of one short-prompt layer call (T = PROFILE_TOKENS, default 256; 16
  # heads; bf16 pool) on both paths, at the clocks and cache state the benchmark sees (ncu's
  # defaults lock base clocks and flush caches, which inflates microsecond kernels), then the
  # dense_mha kernel's launch, occupancy and stall sections at that size and at 2048 tokens.
  note "ncu per-kernel times"
  ncu_q=(ncu --clock-control none --cache-control none)
  ok=PASS
  for spec in deepseek-v3.2:8 glm-5:4; do
    for path in dense sparse; do
      csv="$out/ncu_${spec%%:*}_$path.csv"
      timeout 120 "${ncu_q[@]}" --metrics gpu__time_duration.sum --csv build-dev/bin/dsakit run \
        --device cuda --model "${spec%%:*}" --tp "${spec##*:}" --kv bf16 \
        --prompts "${PROFILE_TOKENS:-256}" --dispatch "$path" --quiet >"$csv" 2>&1 || ok=FAIL
      python3 - "$csv" "${spec} $path" <<'PY' | tee -a "$out/ncu_summary.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows: sys.exit(print(sys.argv[2], "no ncu rows"))
h = rows[0]; k, v, u = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
total = 0.0
print("==", sys.argv[2])
for r in rows[1:]:
    us = float(r[v].replace(",", "")) * {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(r[u], 1.0)
    total += us
    print(f"  {us:8.1f} us  {r[k][:90]}")
print(f"  {total:8.1f} us  GPU total")
PY
    done
    for t in "${PROFILE_TOKENS:-256}" 2048; do
      timeout 120 "${ncu_q[@]}" -k regex:dense_mha --section LaunchStats --section Occupancy \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
        build-dev/bin/dsakit run --device cuda --model "${spec%%:*}" --tp "${spec##*:}" --kv bf16 \
        --prompts "$t" --dispatch dense --quiet >"$out/ncu_dense_mha_${spec%%:*}_$t.txt" 2>&1 ||
        ok=FAIL
    done
  done
  result[profile]=$ok
fi

note "done"
# The device tool returns at most 8 files: pack everything into one archive and keep only the
# archive and the JSON results next to it.
(cd "$out" && tar -czf logs.tgz --exclude=logs.tgz ./* 2>/dev/null &&
  find . -maxdepth 1 -type f ! -name logs.tgz ! -name profile.json ! -name bench_layer.json ! -name ncu_summary.txt ! -name bench_sparse.json ! -name bench_indexer.json ! -name issue_rates.json \
    -delete)
echo
printf '%-44s %s\n' CHECK RESULT
fail=0
for k in $(printf '%s\n' "${!result[@]}" | sort); do
  printf '%-44s %s\n' "$k" "${result[$k]}"
  [ "${result[$k]}" = PASS ] || fail=1
done
[ -n "${probe_plain:-}" ] && printf '%-44s %s\n' "info: initcheck probe, cuBLAS-only writes" "$probe_plain"
printf '%-44s %s\n' "device time (s)" "$(( $(date +%s) - t0 ))"
exit $fail
