"""tools/compare-builds.sh with prebuilt variants (bin:) that stand in for dsakit_bench_cuda: the
interleaved rounds' order, each row's best time and ratio, the + / - marks only where the rounds'
ranges do not overlap, and the spread, against values computed here from random timings."""
import json
import pathlib
import re
import stat
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "compare-builds.sh"

# A stand-in bench: each call appends its name to calls.txt and writes the next round's times
# (times.json: {name: [[ms of each row] per round]}) as dsakit_bench_cuda's --json does.
FAKE = r'''#!/usr/bin/env python3
import json, pathlib, sys
here = pathlib.Path(__file__).parent
name = pathlib.Path(__file__).name
out = sys.argv[sys.argv.index("--json") + 1]
calls = here / "calls.txt"
done = calls.read_text().split().count(name) if calls.exists() else 0
with open(calls, "a") as f:
    f.write(name + "\n")
times = json.load(open(here / "times.json"))[name][done]
rows = [{"shape": f"shape {i}", "stage": "kernel", "ms": t} for i, t in enumerate(times)]
json.dump({"rows": rows}, open(out, "w"))
'''


def fake_variants(tmp_path, times):
    for name in times:
        path = tmp_path / name
        path.write_text(FAKE)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "times.json").write_text(json.dumps(times))


def test_rows_ratios_and_marks(tmp_path, rng):
    rounds, rows = 3, 6
    base = rng.uniform(0.5, 2.0, size=rows)
    # Per row: the second variant clearly faster (+), clearly slower (-), or overlapping.
    kinds = ["+", "-", "", "+", "-", ""]
    times = {"a": [], "b": []}
    for r in range(rounds):
        times["a"].append(list(base * rng.uniform(1.0, 1.02, size=rows)))
        b = []
        for i, kind in enumerate(kinds):
            if kind == "+":
                b.append(base[i] * rng.uniform(0.85, 0.95))
            elif kind == "-":
                b.append(base[i] * rng.uniform(1.05, 1.15))
            else:  # straddles the first variant's rounds: round 0 below, the others above
                b.append(base[i] * (0.99 if r == 0 else 1.03))
        times["b"].append(b)
    fake_variants(tmp_path, times)
    out = tmp_path / "out"
    p = subprocess.run(["bash", str(SCRIPT), "--rounds", str(rounds), "--out", str(out),
                        f"a=bin:{tmp_path / 'a'}", f"b=bin:{tmp_path / 'b'}", "--", "--dense"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    # Odd rounds in the order given, even rounds reversed.
    assert (tmp_path / "calls.txt").read_text().split() == ["a", "b", "b", "a", "a", "b"]
    doc = json.load(open(out / "compare.json"))
    assert doc["variants"] == ["a", "b"] and doc["rounds"] == rounds
    lines = [l for l in p.stdout.splitlines() if re.match(r"shape \d", l)]
    assert len(lines) == rows
    for i, (row, line) in enumerate(zip(doc["rows"], lines)):
        a = [times["a"][r][i] for r in range(rounds)]
        b = [times["b"][r][i] for r in range(rounds)]
        assert row["ms"] == {"a": a, "b": b}
        assert row["marks"] == {"a": "", "b": kinds[i]}
        cells = line.split()
        assert float(cells[5]) == pytest.approx(min(b), abs=5e-4)
        ratio = cells[6]
        assert ratio.endswith("x" + kinds[i])
        assert float(ratio.rstrip("+-x")) == pytest.approx(min(a) / min(b), abs=5e-4)
        spread = max(max(a) / min(a), max(b) / min(b)) - 1
        assert float(cells[7].rstrip("%")) == pytest.approx(100 * spread, abs=0.05)


def test_one_round_marks_nothing(tmp_path):
    fake_variants(tmp_path, {"a": [[1.0]], "b": [[0.5]]})
    p = subprocess.run(["bash", str(SCRIPT), "--rounds", "1", "--out", str(tmp_path / "out"),
                        f"a=bin:{tmp_path / 'a'}", f"b=bin:{tmp_path / 'b'}", "--"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    row = json.load(open(tmp_path / "out" / "compare.json"))["rows"][0]
    assert row["marks"] == {"a": "", "b": ""}
    line = next(l for l in p.stdout.splitlines() if l.startswith("shape 0"))
    assert line.split()[6] == "2.000x"


def test_sed_variant_tree(tmp_path, rng):
    """sed:PATH:SCRIPT with --prepare-only: the variant's tree is this one with PATH changed by
    SCRIPT and every other file as it is; nothing is built or run."""
    name = f"pytest-sed-{rng.integers(1 << 30)}"
    path = "tools/compare-builds.sh"
    try:
        p = subprocess.run(["bash", str(SCRIPT), "--prepare-only", "--out", str(tmp_path / "o"),
                            f"{name}=sed:{path}:s/^rounds=2 /rounds=5 /", "--", "--sparse"],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        tree = REPO / "build-cmp" / name / "src"
        assert p.stdout.strip() == f"{name}: build-cmp/{name}/src"
        original = (REPO / path).read_text().splitlines()
        changed = (tree / path).read_text().splitlines()
        diff = [(a, b) for a, b in zip(original, changed) if a != b]
        assert len(original) == len(changed) and len(diff) == 1
        assert diff[0][0].startswith("rounds=2 ") and diff[0][1].startswith("rounds=5 ")
        assert (tree / "README.md").read_bytes() == (REPO / "README.md").read_bytes()
        assert not (REPO / "build-cmp" / name / "build").exists()
        assert not list(tmp_path.glob("o/*-r*.json"))
    finally:
        subprocess.run(["rm", "-rf", str(REPO / "build-cmp" / name)], check=True)


def test_bad_arguments_are_refused(tmp_path):
    for args in (["--rounds", "0", "a=bin:/bin/true"], ["a"], ["a=bin:/nonexistent"],
                 ["a=bin:/bin/true", "a=bin:/bin/true"],
                 # sed: no script, no such file, a script that changes nothing
                 ["a=sed:README.md"], ["a=sed:no/such/file:s/x/y/"],
                 ["a=sed:README.md:s/no such text in the readme 1f0e/x/"]):
        p = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path / "o"), *args, "--"],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, (args, p.stdout, p.stderr)
