#!/usr/bin/env bash
# Kernel variants against each other in one call of the device tool (docs/benchmarks.md#reproduce):
#
#   tools/compare-builds.sh [--rounds N] [--out DIR] [--jobs J] [--prepare-only] NAME=SPEC... \
#     -- BENCH_ARGS...
#
# SPEC says what variant NAME is:
#   .                this tree as it is
#   DIR              this tree with DIR's files copied over it (DIR mirrors the tree's paths)
#   FILE             this tree with the unified diff FILE applied (`patch -p1`, else `git apply`)
#   sed:PATH:SCRIPT  this tree with `sed -e SCRIPT` applied to its file PATH, which must change
#                    (a knob set another way: sed:src/x.cuh:'s/kTiles = 0/kTiles = 8/')
#   bin:PATH         an already built dsakit_bench_cuda (nothing is built)
# --prepare-only writes the variants' trees (build-cmp/NAME/src) and stops before building: to
# read a variant's SASS here before a device call.
# Each built variant is a copy of the tree under build-cmp/NAME (sm_90a, Release, tests off; only
# dsakit_bench_cuda is built, the variants' builds in parallel). Then the benches run interleaved:
# round r = 1..N (default 2) runs every variant once, one process at a time, odd rounds in the
# order given and even rounds in reverse (the same code run second read 0.8-1.5% slower in one
# A/B, perf.md run Q2: no variant should always follow another),
# as `dsakit_bench_cuda BENCH_ARGS --json OUT/NAME-rR.json` (stdout and stderr beside it). Two
# builds of the same code can time a shape several percent apart when run one after the other
# (the GPU's state moves), so a change is read from the interleaved rounds. Last, a table per
# (shape, stage): each variant's best median over the rounds, its ratio to the first variant's
# (> 1: faster than the first), marked + where every round of the variant beat every round of the
# first and - where every round lost (from 2 rounds; no mark: the rounds overlap, so this call
# cannot tell the two apart), and the largest spread between a variant's rounds. The table and
# each row's rounds and marks also go to OUT/compare.json.
#
# Example (the dense kernel before and after a change, GLM-5 rows only, 3 rounds):
#   tools/compare-builds.sh --rounds 3 before=.dev/before.patch after=. -- \
#     --dense --wgmma-only --filter 'glm-5 H=64'
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
rounds=2 out=${OUT:-out}/compare jobs=$(nproc) prepare_only=0
names=() specs=()
while [ $# -gt 0 ]; do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --prepare-only) prepare_only=1; shift ;;
    --out) out=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set /{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *=*) names+=("${1%%=*}"); specs+=("${1#*=}"); shift ;;
    *) echo "compare-builds.sh: expected NAME=SPEC, --rounds, --out, --jobs, --prepare-only or --, got '$1'" >&2
       exit 2 ;;
  esac
done
bench_args=("$@")
if [ ${#names[@]} -lt 1 ] || ! [[ $rounds =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: tools/compare-builds.sh [--rounds N>=1] [--out DIR] [--jobs J] [--prepare-only] NAME=SPEC... -- BENCH_ARGS..." >&2
  exit 2
fi
for n in "${names[@]}"; do
  if ! [[ $n =~ ^[A-Za-z0-9_.-]+$ ]]; then echo "compare-builds.sh: bad variant name '$n'" >&2; exit 2; fi
done
if [ "$(printf '%s\n' "${names[@]}" | sort | uniq -d)" != "" ]; then
  echo "compare-builds.sh: variant names must differ" >&2; exit 2
fi
mkdir -p "$out"
t0=$(date +%s)
note() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

# ---- variants: trees and builds -------------------------------------------------------------
declare -A bench
to_build=()
for i in "${!names[@]}"; do
  n=${names[$i]} s=${specs[$i]}
  if [[ $s == bin:* ]]; then
    bench[$n]=${s#bin:}
    [ -x "${bench[$n]}" ] || { echo "compare-builds.sh: $n: ${bench[$n]} is not executable" >&2; exit 2; }
    continue
  fi
  sed_path='' sed_script=''
  if [[ $s == sed:* ]]; then
    rest=${s#sed:} sed_path=${rest%%:*} sed_script=${rest#*:}
    if [ "$sed_path" = "$rest" ] || [ -z "$sed_script" ] || [ ! -f "$sed_path" ]; then
      echo "compare-builds.sh: $n: expected sed:PATH:SCRIPT with PATH a file of this tree, got '$s'" >&2
      exit 2
    fi
    if ! edited=$(sed -e "$sed_script" "$sed_path"); then
      echo "compare-builds.sh: $n: sed failed on $sed_path" >&2; exit 2
    fi
    if [ "$edited" = "$(cat "$sed_path")" ]; then
      echo "compare-builds.sh: $n: '$sed_script' changed nothing in $sed_path" >&2; exit 2
    fi
  elif [ "$s" != . ] && [ ! -d "$s" ] && [ ! -f "$s" ]; then
    echo "compare-builds.sh: $n: '$s' is neither ., a directory, a patch file, sed:PATH:SCRIPT nor bin:PATH" >&2
    exit 2
  fi
  tree=build-cmp/$n/src
  rm -rf "build-cmp/$n"; mkdir -p "$tree"
  tar --exclude='./build*' --exclude=./.git --exclude=./out --exclude=./.venv --exclude=./.whl \
    -cf - . | tar -C "$tree" -xf -
  if [ "$s" = . ]; then :
  elif [ -n "$sed_path" ]; then sed -i -e "$sed_script" "$tree/$sed_path"
  elif [ -d "$s" ]; then cp -r "$s"/. "$tree"/
  else
    if command -v patch >/dev/null; then patch -s -p1 -d "$tree" <"$s"
    else git -C "$tree" apply "$(realpath "$s")"; fi || { echo "compare-builds.sh: $n: $s does not apply" >&2; exit 2; }
  fi
  bench[$n]=build-cmp/$n/build/bench/dsakit_bench_cuda
  to_build+=("$n")
done
if [ "$prepare_only" = 1 ]; then
  for n in "${to_build[@]}"; do echo "$n: build-cmp/$n/src"; done
  exit 0
fi
if [ ${#to_build[@]} -gt 0 ]; then
  per=$(( jobs / ${#to_build[@]} )); [ "$per" -lt 1 ] && per=1
  note "building ${to_build[*]} ($per jobs each)"
  for n in "${to_build[@]}"; do
    ( cmake -S "build-cmp/$n/src" -B "build-cmp/$n/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DDSAKIT_BENCH=ON -DDSAKIT_TESTS=OFF >"$out/build-$n.log" 2>&1 &&
      cmake --build "build-cmp/$n/build" -j "$per" --target dsakit_bench_cuda >>"$out/build-$n.log" 2>&1
      echo $? >"$out/build-$n.rc" ) &
  done
  wait
  for n in "${to_build[@]}"; do
    if [ "$(cat "$out/build-$n.rc" 2>/dev/null)" != 0 ]; then
      echo "compare-builds.sh: $n did not build ($out/build-$n.log):" >&2
      tail -20 "$out/build-$n.log" >&2; exit 1
    fi
  done
  note "built"
fi

# ---- interleaved rounds -----------------------------------------------------------------------
for r in $(seq 1 "$rounds"); do
  order=("${names[@]}")
  if ((r % 2 == 0)); then
    order=()
    for ((i = ${#names[@]} - 1; i >= 0; i--)); do order+=("${names[$i]}"); done
  fi
  for n in "${order[@]}"; do
    "${bench[$n]}" "${bench_args[@]}" --json "$out/$n-r$r.json" >"$out/$n-r$r.txt" 2>"$out/$n-r$r.err"
    rc=$?
    note "round $r $n rc=$rc"
    [ $rc = 0 ] || { tail -5 "$out/$n-r$r.err" >&2; exit 1; }
  done
done

python3 - "$out" "$rounds" "${names[@]}" <<'PY'
import json, sys
out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
ms, order = {}, []
for n in names:
    for r in range(1, rounds + 1):
        doc = json.load(open(f"{out}/{n}-r{r}.json"))
        for row in doc["rows"]:
            key = (row["shape"], row["stage"])
            if key not in ms:
                ms[key] = {}
                order.append(key)
            ms[key].setdefault(n, []).append(row["ms"])
head = f"{'shape':<44} {'stage':<18} " + " ".join(f"{n:>17}" for n in names) + "  spread"
print(head)
summary = []
for key in order:
    runs = ms[key]
    if names[0] not in runs:
        continue
    base, base_worst = min(runs[names[0]]), max(runs[names[0]])
    cells, spread, marks = [], 0.0, {}
    for n in names:
        if n not in runs:
            cells.append(f"{'-':>17}")
            continue
        best, worst = min(runs[n]), max(runs[n])
        spread = max(spread, worst / best - 1)
        # Separable only if the rounds' ranges do not overlap (and there are rounds to compare).
        mark = ""
        if n != names[0] and len(runs[n]) > 1 and len(runs[names[0]]) > 1:
            mark = "+" if worst < base else "-" if best > base_worst else ""
        marks[n] = mark
        cells.append(f"{best:9.3f} {base / best:5.3f}x{mark or ' '}")
    print(f"{key[0]:<44} {key[1]:<18} " + " ".join(cells) + f"  {100 * spread:5.1f}%")
    summary.append({"shape": key[0], "stage": key[1], "ms": runs, "marks": marks})
json.dump({"variants": names, "rounds": rounds, "rows": summary},
          open(f"{out}/compare.json", "w"), indent=1)
PY
