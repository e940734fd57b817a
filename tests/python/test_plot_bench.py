"""tools/plot_bench.py on synthetic `dsakit bench --json` output: which figures it writes, that
they are valid PNG/SVG, and how it treats partial, malformed and foreign input.

The script runs as a subprocess (as the docs use it); the numbers come from the seeded `rng`
fixture in conftest.py.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("matplotlib")

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "plot_bench.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("curves", "decision", "speedup")
GROUPS = (("deepseek-v3.2", 128, "fp8"), ("deepseek-v3.2", 64, "bf16"))
TOPK = 2048
KERNEL = {"dense": "dense_mha", "sparse": "sparse_mla"}


# ---- synthetic bench output ---------------------------------------------------------------

def fresh_row(rng: np.random.Generator, group: tuple, tokens: int, with_dense: bool) -> dict:
    config, heads, layout = group
    sparse = float(rng.uniform(0.1, 10.0))
    modes = {"sparse": {"ms": sparse, "tflops": float(rng.uniform(10, 400)),
                        "pct_ceiling": float(rng.uniform(1, 60)), "path": "sparse_mla",
                        "stages": {}}}
    best, best_ms = "sparse", sparse
    if with_dense:
        dense = float(rng.uniform(0.1, 10.0))
        modes["dense"] = {"ms": dense, "path": "dense_mha", "stages": {"store": 0.01}}
        if dense < sparse:
            best, best_ms = "dense", dense
    modes["rule"] = {"ms": best_ms * 1.05, "path": KERNEL[best], "reason": "synthetic"}
    modes["cost"] = {"ms": best_ms, "path": KERNEL[best], "reason": "synthetic",
                     "predicted_ms": best_ms * 0.9}
    return {"config": config, "heads": heads, "layout": layout, "index_topk": TOPK,
            "kind": "fresh", "label": f"T={tokens}", "prefix": [0], "extend": [tokens],
            "tokens": tokens, "kv": tokens, "max_len": tokens, "modes": modes,
            "oracle_ms": best_ms, "oracle_path": best,
            "speedup_rule_vs_sparse": sparse / (best_ms * 1.05),
            "speedup_cost_vs_sparse": sparse / best_ms, "cost_vs_oracle": 1.0}


def prefix_row(rng: np.random.Generator, group: tuple, prefix: int, extend: int) -> dict:
    config, heads, layout = group
    oracle = str(rng.choice(["dense", "sparse"]))
    cost = str(rng.choice(["dense_mha", "sparse_mla", "mixed"]))
    rule = str(rng.choice(["dense_mha", "sparse_mla"]))
    return {"config": config, "heads": heads, "layout": layout, "index_topk": TOPK,
            "kind": "prefix", "label": f"P={prefix} E={extend}", "prefix": [prefix],
            "extend": [extend], "tokens": extend, "kv": prefix + extend,
            "max_len": prefix + extend,
            "modes": {"sparse": {"ms": float(rng.uniform(0.1, 5)), "path": "sparse_mla"},
                      "rule": {"ms": float(rng.uniform(0.1, 5)), "path": rule},
                      "cost": {"ms": float(rng.uniform(0.1, 5)), "path": cost}},
            "oracle_ms": float(rng.uniform(0.1, 5)), "oracle_path": oracle}


def bench_doc(rng: np.random.Generator, *, with_prefix: bool = True, complete: bool = True) -> dict:
    rows = []
    for group in GROUPS:
        for tokens in (256, 1024, 2048, 8192, 32768):
            # Dense is not exact for the longest context: the mode is absent there.
            rows.append(fresh_row(rng, group, tokens, with_dense=tokens < 32768))
        if with_prefix:
            for prefix in (0, 1024, 16384):
                for extend in (1, 64, 4096):
                    rows.append(prefix_row(rng, group, prefix, extend))
    # Rows the script must tolerate: malformed fields, missing modes, an unknown kind.
    rows.append({"config": "deepseek-v3.2", "heads": 128, "layout": "fp8", "kind": "fresh",
                 "tokens": "many", "modes": {"sparse": {"ms": None}}})
    rows.append({"config": "deepseek-v3.2", "heads": 128, "layout": "fp8", "kind": "prefix",
                 "prefix": [], "extend": [8], "oracle_path": "mixed"})
    rows.append({"config": "deepseek-v3.2", "heads": 128, "layout": "fp8", "kind": "mixed",
                 "prefix": [0, 64], "extend": [8, 8], "modes": {}})
    return {"format": "dsakit-bench", "version": 1, "complete": complete,
            "device": "NVIDIA H200", "backend": "cuda",
            "ceilings": {"copy_gbs": 4230.0, "gemm_tflops": 785.0}, "rows": rows}


# ---- running the script -------------------------------------------------------------------

@pytest.fixture(scope="session")
def mpl_env(tmp_path_factory) -> dict:
    """Environment with one matplotlib config/cache dir for all runs (font cache built once)."""
    env = dict(os.environ)
    env["MPLCONFIGDIR"] = str(tmp_path_factory.mktemp("mplconfig"))
    env.pop("MPLBACKEND", None)
    return env


def run_plot(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def write_json(path: pathlib.Path, doc) -> pathlib.Path:
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


# ---- tests --------------------------------------------------------------------------------

def test_writes_three_png_figures(tmp_path, rng, mpl_env):
    bench = write_json(tmp_path / "bench.json", bench_doc(rng))
    prefix = tmp_path / "figs" / "h200"
    proc = run_plot(mpl_env, str(bench), str(prefix))
    assert proc.returncode == 0, proc.stderr
    for name in FIGURES:
        path = pathlib.Path(f"{prefix}-{name}.png")
        assert path.is_file(), f"{path} missing; stdout:\n{proc.stdout}"
        assert path.read_bytes().startswith(PNG_MAGIC)
        assert str(path) in proc.stdout
    assert "partial" not in proc.stdout
    assert "skipped" not in proc.stdout


def test_svg_format(tmp_path, rng, mpl_env):
    bench = write_json(tmp_path / "bench.json", bench_doc(rng))
    prefix = tmp_path / "out"
    proc = run_plot(mpl_env, str(bench), str(prefix), "--format", "svg")
    assert proc.returncode == 0, proc.stderr
    for name in FIGURES:
        path = pathlib.Path(f"{prefix}-{name}.svg")
        assert path.is_file(), f"{path} missing; stdout:\n{proc.stdout}"
        assert "<svg" in path.read_text(encoding="utf-8")
    assert not list(tmp_path.glob("*.png"))


def test_partial_file_is_plotted_with_a_note(tmp_path, rng, mpl_env):
    doc = bench_doc(rng, complete=False)
    doc["rows"] = doc["rows"][: len(doc["rows"]) // 2]  # an interrupted run: fewer rows
    bench = write_json(tmp_path / "partial.json", doc)
    prefix = tmp_path / "partial"
    proc = run_plot(mpl_env, str(bench), str(prefix))
    assert proc.returncode == 0, proc.stderr
    assert "partial" in proc.stdout
    assert pathlib.Path(f"{prefix}-curves.png").read_bytes().startswith(PNG_MAGIC)


def test_all_fresh_skips_decision_figure(tmp_path, rng, mpl_env):
    bench = write_json(tmp_path / "fresh.json", bench_doc(rng, with_prefix=False))
    prefix = tmp_path / "fresh"
    proc = run_plot(mpl_env, str(bench), str(prefix))
    assert proc.returncode == 0, proc.stderr
    decision = pathlib.Path(f"{prefix}-decision.png")
    assert not decision.exists()
    skipped = [line for line in proc.stdout.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and str(decision) in skipped[0], proc.stdout
    assert pathlib.Path(f"{prefix}-curves.png").is_file()
    assert pathlib.Path(f"{prefix}-speedup.png").is_file()


@pytest.mark.parametrize("content", [
    json.dumps({"rows": []}),
    json.dumps({"format": "something-else", "version": 1, "rows": []}),
    json.dumps([1, 2, 3]),
    "not json at all {",
])
def test_foreign_input_exits_2_with_one_line(tmp_path, mpl_env, content):
    bench = tmp_path / "other.json"
    bench.write_text(content, encoding="utf-8")
    proc = run_plot(mpl_env, str(bench), str(tmp_path / "x"))
    assert proc.returncode == 2
    assert proc.stderr.strip() and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(tmp_path.glob("x-*"))


def test_missing_file_exits_2_with_one_line(tmp_path, mpl_env):
    proc = run_plot(mpl_env, str(tmp_path / "absent.json"), str(tmp_path / "x"))
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "absent.json" in proc.stderr
