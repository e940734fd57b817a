"""`dsakit bench` and `dsakit calibrate` on the CPU backend: JSON contents, profiles that cost
mode reads (and refuses when stale or mismatched), Ctrl-C leaving valid partial JSON, bad flags."""
import json
import os
import signal
import subprocess
import time

import pytest

QUICK = ["--device", "cpu", "--threads", "2", "--models", "deepseek-v3.2:8", "--kv", "bf16"]
FAST = ["--runs", "3", "--min-runs", "1", "--budget-ms", "20"]


def load(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def profile(tmp_path_factory, dsakit):
    """A CPU profile for deepseek-v3.2 tp8, bf16 pool (calibrated once for the module)."""
    path = tmp_path_factory.mktemp("calib") / "cpu.json"
    p = subprocess.run([str(dsakit), "calibrate", *QUICK, "--runs", "3", "--budget-ms", "5",
                        "--quiet", "--out", str(path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    return path


def test_bench_quick_grid_json(run, tmp_path):
    out = tmp_path / "b.json"
    p = run("bench", *QUICK, "--grid", "quick", *FAST, "--json", out, "--quiet")
    assert p.returncode == 0, p.stderr
    doc = load(out)
    assert doc["format"] == "dsakit-bench" and doc["complete"] is True
    assert doc["ceilings"]["copy_gbs"] > 0 and doc["ceilings"]["gemm_tflops"] > 0
    rows = doc["rows"]
    assert [r["label"] for r in rows] == ["T=128", "T=512", "P=384 E=1", "P=384 E=64",
                                          "[256,448+64]"]
    for r in rows:
        m = r["modes"]
        assert set(m) == {"dense", "sparse", "rule", "cost"}  # every shape is exact here
        assert m["dense"]["path"] == "dense_mha" and m["sparse"]["path"] == "sparse_mla"
        assert "fell back to rule mode" in m["cost"]["reason"]
        assert m["cost"]["path"] == m["rule"]["path"]
        for mode in m.values():
            assert mode["ms"] > 0 and mode["runs"] >= 1 and mode["flops"] > 0
        assert r["oracle_ms"] == min(m["dense"]["ms"], m["sparse"]["ms"])
        assert r["speedup_rule_vs_sparse"] == pytest.approx(m["sparse"]["ms"] / m["rule"]["ms"])
        assert "store" in m["sparse"]["stages"] and "dense_mha" in m["dense"]["stages"]
    assert "deepseek-v3.2 H=16 bf16" in doc["summary"]
    assert "summary" in p.stdout and "T=512" in p.stdout


def test_bench_fp8_weights(run, tmp_path):
    """--fp8-weights: the fp8 pool's dense path reads the FP8 weights (no gather stage, the
    rows marked w8); the bf16 pool's runs as without it."""
    out = tmp_path / "w.json"
    p = run("bench", "--device", "cpu", "--threads", "2", "--models", "deepseek-v3.2:8",
            "--kv", "fp8,bf16", "--grid", "quick", "--fresh", "128", "--prefixes", "384",
            "--extends", "64", "--no-mixed", "--modes", "dense,sparse", *FAST, "--fp8-weights",
            "--json", out, "--quiet")
    assert p.returncode == 0, p.stderr
    rows = load(out)["rows"]
    assert [(r["layout"], r["label"]) for r in rows] == [
        ("fp8", "T=128"), ("fp8", "P=384 E=64"), ("bf16", "T=128"), ("bf16", "P=384 E=64")]
    for r in rows:
        fp8 = r["layout"] == "fp8"
        assert r["weights"] == ("fp8" if fp8 else "bf16")
        assert r["group"] == "deepseek-v3.2 H=16 " + ("fp8 w8" if fp8 else "bf16")
        dense = r["modes"]["dense"]
        assert dense["path"] == "dense_mha" and dense["ms"] > 0
        assert "up_proj_kv" in dense["stages"]
        # Only the prefix row reads pool rows; with FP8 weights the GEMM reads them itself.
        if r["kind"] == "prefix":
            assert ("gather" in dense["stages"]) == (not fp8)
    assert set(load(out)["summary"]) == {"deepseek-v3.2 H=16 fp8 w8", "deepseek-v3.2 H=16 bf16"}
    assert "fp8 w8" in p.stdout


def test_bench_sparse_rows(run, tmp_path):
    """--sparse-rows staged: the fp8 pool's sparse path copies its rows first (a stage_rows
    stage, the group marked staged); DSAKIT_SPARSE_ROWS overrides the flag, as for every layer;
    the bf16 pool's group is unmarked."""
    args = ["bench", "--device", "cpu", "--threads", "2", "--models", "deepseek-v3.2:8",
            "--kv", "fp8,bf16", "--grid", "quick", "--fresh", "128", "--prefixes", "384",
            "--extends", "1", "--no-mixed", "--modes", "sparse", *FAST, "--sparse-rows", "staged",
            "--quiet"]
    for env, rows in [({}, "staged"), ({"DSAKIT_SPARSE_ROWS": "pool"}, "pool")]:
        out = tmp_path / f"{rows}.json"
        p = run(*args, "--json", out, env=env)
        assert p.returncode == 0, p.stderr
        doc = load(out)
        assert [r["group"] for r in doc["rows"]] == 2 * ["deepseek-v3.2 H=16 fp8 " + rows] + \
            2 * ["deepseek-v3.2 H=16 bf16"]
        for r in doc["rows"]:
            sparse = r["modes"]["sparse"]
            assert sparse["path"] == "sparse_mla" and sparse["ms"] > 0
            staged = r["layout"] == "fp8" and rows == "staged"
            assert ("stage_rows" in sparse["stages"]) == staged
            assert r["sparse_rows"] == rows
    p = run("bench", "--device", "cpu", "--kv", "fp8", "--sparse-rows", "copy")
    assert p.returncode == 2 and "sparse rows" in p.stderr, p.stderr


def test_bench_sparse_form(run, tmp_path):
    """--sparse-form masked-mha: the sparse rows run the masked dense form (topk_to_kv_mask and
    dense_mha stages, no sparse_mla), the group is marked and each row carries the form."""
    out = tmp_path / "masked.json"
    p = run("bench", "--device", "cpu", "--threads", "2", "--models", "deepseek-v3.2:8", "--kv",
            "bf16", "--grid", "quick", "--fresh", "128", "--prefixes", "384", "--extends", "1",
            "--no-mixed", "--modes", "sparse", *FAST, "--sparse-form", "masked-mha", "--quiet",
            "--json", out)
    assert p.returncode == 0, p.stderr
    doc = load(out)
    assert doc["rows"], doc
    for r in doc["rows"]:
        assert r["group"] == "deepseek-v3.2 H=16 bf16 masked-mha" and r["sparse_form"] == "masked-mha"
        stages = r["modes"]["sparse"]["stages"]
        assert "topk_to_kv_mask" in stages and "sparse_mla" not in stages, stages
    p = run("bench", "--device", "cpu", "--sparse-form", "dense")
    assert p.returncode == 2 and "sparse form" in p.stderr, p.stderr


def test_bench_masked_mode(run, tmp_path):
    """--modes with masked: the sparse path forced in the masked-MHA form beside the bench's own
    layers (auto: MLA when forced sparse), in the same rows; the oracle counts it."""
    out = tmp_path / "modes.json"
    p = run("bench", "--device", "cpu", "--threads", "2", "--models", "deepseek-v3.2:8", "--kv",
            "bf16", "--grid", "quick", "--fresh", "128", "--prefixes", "384", "--extends", "1",
            "--no-mixed", "--modes", "dense,sparse,masked", *FAST, "--quiet", "--json", out)
    assert p.returncode == 0, p.stderr
    assert "masked ms" in p.stdout
    doc = load(out)
    assert len(doc["rows"]) == 2, doc
    for r in doc["rows"]:
        m = r["modes"]
        assert r["group"] == "deepseek-v3.2 H=16 bf16" and r["sparse_form"] == "auto"
        assert m["sparse"]["sparse_form"] == "mla" and "sparse_mla" in m["sparse"]["stages"]
        assert m["masked"]["path"] == "sparse_mla" and m["masked"]["sparse_form"] == "masked-mha"
        assert "topk_to_kv_mask" in m["masked"]["stages"], m["masked"]["stages"]
        assert r["oracle_ms"] == min(m[k]["ms"] for k in ("dense", "sparse", "masked"))
    p = run("bench", "--device", "cpu", "--modes", "sparse,mask")
    assert p.returncode == 2 and "dense, sparse, masked, rule or cost" in p.stderr, p.stderr


def test_calibrated_profile_drives_cost_mode(run, profile, tmp_path):
    doc = load(profile)
    assert doc["format"] == "dsakit-cost-profile"
    (entry,) = doc["entries"]
    assert entry["key"]["heads"] == 16 and entry["key"]["layout"] == "bf16"
    assert entry["key"]["device"].startswith("cpu (")
    assert len(entry["samples"]) >= 20 and {"path", "T", "N", "ms"} <= set(entry["samples"][0])
    assert set(entry["dense"]["coef_ms"]) >= {"1", "N", "C*H"}
    assert all(v >= 0 for v in entry["sparse"]["coef_ms"].values())
    # plan and bench read it; predictions show up in the reason and the JSON.
    p = run("plan", "--device", "cpu", "--model", "deepseek-v3.2", "--tp", "8", "--kv", "bf16",
            "--dispatch", "cost", "--profile", profile, "--prompts", "1000", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert plan["mode"] == "cost" and plan["predicted_ms"]["plan"] > 0
    assert "predicted" in plan["reason"]
    # The CPU backend has the masked kernel: the sparse path was calibrated in both forms, and
    # under --sparse-form auto (the default) a prompt beyond index_topk takes the cheaper one.
    assert set(entry["masked"]["coef_ms"]) >= {"1", "N*H", "C*H", "C*Hi"}
    assert any(smp.get("form") == "masked-mha" for smp in entry["samples"])
    long_prompt = ["plan", "--device", "cpu", "--model", "deepseek-v3.2", "--tp", "8", "--kv",
                   "bf16", "--dispatch", "cost", "--profile", profile, "--prompts", "3000",
                   "--json"]
    plan = json.loads(run(*long_prompt).stdout)
    pred = plan["predicted_ms"]
    assert pred["dense"] < 0 and pred["sparse"] > 0 and pred["masked"] > 0, plan
    cheaper = "masked-mha" if pred["masked"] < pred["sparse"] else "mla"
    assert plan["sparse_form"] == cheaper and pred["plan"] == min(pred["sparse"], pred["masked"])
    assert "masked-mha" in plan["reason"], plan["reason"]
    plan = json.loads(run(*long_prompt, "--sparse-form", "mla").stdout)
    assert plan["sparse_form"] == "mla" and plan["predicted_ms"]["masked"] < 0, plan
    plan = json.loads(run(*long_prompt, "--sparse-form", "masked-mha").stdout)
    assert plan["sparse_form"] == "masked-mha" and plan["predicted_ms"]["sparse"] < 0, plan
    out = tmp_path / "b.json"
    p = run("bench", *QUICK, "--grid", "quick", *FAST, "--no-stages", "--profile", profile,
            "--json", out, "--quiet")
    assert p.returncode == 0, p.stderr
    for r in load(out)["rows"]:
        assert r["modes"]["cost"]["predicted_ms"] > 0
        assert "cost mode:" in r["modes"]["cost"]["reason"]
    # run --dispatch cost --verify with the profile
    p = run("run", "--device", "cpu", "--model", "deepseek-v3.2", "--tp", "8", "--kv", "bf16",
            "--prompts", "400,300", "--prefix", "380,0", "--dispatch", "cost", "--profile",
            profile, "--verify", "--verify-tokens", "8")
    assert p.returncode == 0, p.stdout + p.stderr


def test_mismatched_and_stale_profiles_are_refused(run, dsakit, profile, tmp_path):
    p = run("plan", "--device", "cpu", "--model", "deepseek-v3.2", "--tp", "8", "--kv", "fp8",
            "--dispatch", "cost", "--profile", profile, "--prompts", "1000")
    assert p.returncode == 2
    assert "has no entry for" in p.stderr and "fp8 pool" in p.stderr
    stale = tmp_path / "stale.json"
    doc = load(profile)
    doc["kernel_revision"] = 0
    stale.write_text(json.dumps(doc))
    p = run("plan", "--device", "cpu", "--dispatch", "cost", "--profile", stale)
    assert p.returncode == 2 and "stale" in p.stderr, p.stderr
    env_run = subprocess.run([str(dsakit), "plan", "--device", "cpu"],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "DSAKIT_PROFILE": str(stale),
                                  "DSAKIT_DISPATCH": "cost"})
    assert env_run.returncode == 2 and "DSAKIT_PROFILE" in env_run.stderr
    # calibrate refuses to overwrite a file that is not a profile
    other = tmp_path / "notes.json"
    other.write_text('{"hello": 1}')
    p = run("calibrate", *QUICK, "--out", other)
    assert p.returncode == 2 and "not a dsakit cost profile" in p.stderr
    assert other.read_text() == '{"hello": 1}'


def test_ctrl_c_leaves_valid_partial_json(dsakit, tmp_path):
    out = tmp_path / "partial.json"
    proc = subprocess.Popen([str(dsakit), "bench", *QUICK, "--grid", "small", "--runs", "3",
                             "--json", str(out), "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if out.exists() and load(out)["rows"]:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("no row written within 300 s")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    doc = load(out)
    assert doc["complete"] is False and doc["interrupted"] is True
    assert 1 <= len(doc["rows"]) < 20


@pytest.mark.parametrize("args, message", [
    (["--grid", "huge"], "--grid"),
    (["--kv", "int4"], "int4"),
    (["--models", "deepseek-v3.2:x"], "--models"),
    (["--models", ","], "--models"),
    (["--runs", "0"], "--runs"),
    (["--modes", "fast"], "--modes: expected dense, sparse, masked"),
    (["--fresh", "0"], "--fresh"),
    (["--plot-format", "gif"], "--plot-format"),
    (["--device", "tpu"], "--device"),
    (["--dcp", "2", "--fp8-weights"], "--fp8-weights"),
])
def test_bench_bad_flags(run, args, message):
    p = run("bench", "--device", "cpu", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_bench_plot(run, tmp_path):
    pytest.importorskip("matplotlib")
    prefix = tmp_path / "fig"
    p = run("bench", *QUICK, "--grid", "quick", *FAST, "--no-stages", "--plot", prefix,
            "--quiet")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "fig.json").exists()
    for name in ("fig-curves.png", "fig-decision.png", "fig-speedup.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.parametrize("args,message", [
    (["--kv", "fp4"], "--kv"),
    (["--filter", "glm-5 H=(64"], "--filter: not a regular expression"),
    (["--sparse", "--bogus"], "usage: dsakit_bench_cuda"),
])
def test_bench_cuda_bad_flags(dsakit, args, message):
    """The CUDA kernel benchmark refuses bad flags before it looks for a GPU (exit 2, a message)."""
    path = dsakit.parent.parent / "bench" / "dsakit_bench_cuda"
    if not path.exists():
        pytest.skip(f"{path} not built (no CUDA toolkit, or DSAKIT_BENCH=OFF)")
    p = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "no GPU visible" not in p.stderr
