"""The wheel installs and runs in a fresh virtual environment (no dependencies, nothing fetched):
DSAKIT_WHEEL_DIR holds the wheel scripts/test.sh (CPU-only) or tools/device-python.sh (CUDA)
built; without it the test is skipped."""
import os
import pathlib
import subprocess
import sys

import pytest

SMOKE = r'''
import sys
import dsakit
assert "numpy" not in sys.modules, "importing dsakit imported numpy"
print(dsakit.__file__)
cfg = dsakit.ModelConfig.load("deepseek-v3.2").with_tp(8)
cfg.index_topk = 64
kv = dsakit.KvPool("fp8", 16, 8)
ix = dsakit.IndexPool(16, 8, d_i=cfg.index_head_dim)
empty = dsakit._dsakit.empty  # dsakit's own DLPack arrays: no framework in this venv
w = empty("bf16", [16 * 256, 512], "cpu")
t = 80
x = dsakit.LayerInputs(empty("bf16", [t, 16, 128], "cpu"), empty("bf16", [t, 16, 64], "cpu"),
                       empty("bf16", [t, 512], "cpu"), empty("bf16", [t, 64], "cpu"),
                       empty("bf16", [t, 64, 128], "cpu"), empty("bf16", [t, 128], "cpu"),
                       empty("f32", [t, 64], "cpu"))
layer = dsakit.DsaAttention(cfg, kv, ix, w)
res = layer.forward(dsakit.Batch([0], [t], [[0, 1, 2, 3, 4]]), x)
assert res.plan.path == "sparse_mla", res.plan
assert tuple(res.o.shape) == (t, 16, 128) and tuple(res.topk.shape) == (t, 64)
try:
    dsakit.Batch([0], [t], [[0, 1, 2, 3, 99]]).validate(16, 8)
except ValueError as e:
    assert "page_table" in str(e)
print("cuda compiled:", dsakit.cuda_compiled(), "ok")
'''


def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    wheel_dir = os.environ.get("DSAKIT_WHEEL_DIR")
    if not wheel_dir:
        pytest.skip("DSAKIT_WHEEL_DIR is not set (scripts/test.sh builds the wheel and sets it)")
    wheels = sorted(pathlib.Path(wheel_dir).glob("dsakit-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-index", "--no-deps", "--disable-pip-version-check", str(wheels[0])],
                   check=True)
    p = subprocess.run([str(py), "-I", "-c", SMOKE], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert str(venv) in p.stdout.splitlines()[0]  # the venv's copy, not a source tree's
    assert p.stdout.rstrip().endswith("ok")
