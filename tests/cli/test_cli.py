"""End-to-end tests of the dsakit command line (runs on the CPU backend in CI)."""
import json
import pathlib
import struct

import numpy as np
import pytest


def read_safetensors(path: pathlib.Path):
    """Minimal independent reader: {name: (dtype, shape, bytes)}, metadata."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {k: (v["dtype"], v["shape"], raw[base + v["data_offsets"][0]:base + v["data_offsets"][1]])
           for k, v in header.items()}
    return out, meta


def write_safetensors(path: pathlib.Path, tensors, meta):
    """Minimal independent writer of {name: (dtype, shape, bytes)} and string metadata."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = meta
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def e4m3_values(codes):
    """e4m3 (OCP, no infinities) codes -> float64 values; 0x7F / 0xFF -> NaN."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 0x7
    v = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return np.where((c & 0x7F) == 0x7F, np.nan, sign * v)


def bf16_bits_rne(x32):
    """float32 array -> bf16 bits, rounded to nearest even."""
    b = x32.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def verdict(p):
    return "PASS" if "-> PASS" in p.stdout else "FAIL" if "-> FAIL" in p.stdout else "none"


@pytest.mark.parametrize("model,tp", [("deepseek-v3.2", 8), ("glm-5", 4)])
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp8-raw"])
@pytest.mark.parametrize("chunk", [0, 64])
def test_run_verify_presets_layouts(run, model, tp, kv, chunk):
    p = run("run", "--device", "cpu", "--model", model, "--tp", tp, "--kv", kv, "--prompts",
            "200,90", "--chunk", chunk, "--verify", "--verify-tokens", "16")
    assert p.returncode == 0, p.stdout + p.stderr
    assert verdict(p) == "PASS", p.stdout
    assert "dense_mha" in p.stdout and "all 8 rules hold" in p.stdout


def test_run_sparse_chunked_prefix_decode(run):
    """Long enough for the sparse path (L > index_topk), from a cached prefix, then decode."""
    p = run("run", "--device", "cpu", "--kv", "fp8", "--prompts", "2200", "--prefix", "900",
            "--chunk", "700", "--decode-steps", "2", "--verify", "--verify-tokens", "10", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    j = json.loads(p.stdout)
    assert j["verify"]["pass"] is True, j["verify"]
    plans = " ".join(x["plan"] for x in j["plans"])
    assert "rule 4: max L_r = 2200 > threshold 2048" in plans
    assert "rule 2: mode decode" in plans
    assert "dense MHA: all 8 rules hold" in plans  # the first chunk (L = 1600) is dense
    assert j["verify"]["o_rel_l2"] < 3e-2 and j["verify"]["lse_max_abs"] < 1e-3


def test_verify_failure_exits_1(run):
    p = run("run", "--device", "cpu", "--prompts", "64", "--verify", "--verify-tol", "1e-9")
    assert p.returncode == 1, p.stdout + p.stderr
    assert verdict(p) == "FAIL"


def test_save_then_inputs_reproduces_bit_for_bit(run, tmp_path):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    common = ["--device", "cpu", "--dispatch", "sparse", "--kv", "fp8", "--page-size", "16"]
    p = run("run", *common, "--prompts", "150,60", "--prefix", "40,0", "--decode-steps", "2",
            "--save", a)
    assert p.returncode == 0, p.stderr
    q = run("run", *common, "--inputs", a, "--save", b)
    assert q.returncode == 0, q.stderr
    ta, ma = read_safetensors(a)
    tb, mb = read_safetensors(b)
    for name in ["q_nope", "q_pe", "c_kv", "k_pe", "idx_q", "idx_k", "idx_w", "kv_b_proj", "o",
                 "lse", "topk", "kv_pool", "index_pool"]:
        assert name in ta and name in tb, name
        assert ta[name] == tb[name], f"{name} differs"
    assert ta["kv_pool"][1] == [214, 656] and ta["index_pool"][1] == [214, 132]
    assert ta["topk"][1] == [214, 2048] and ta["o"][1] == [214, 16, 128]
    for key in ["config", "layout", "page_size", "prompts", "prefix", "sm_scale", "plan"]:
        assert key in ma, key
    assert ma["prompts"] == "150,60" and ma["prefix"] == "40,0" and ma["layout"] == "fp8"
    # Top-k positions lie within each token's causal context.
    topk = np.frombuffer(ta["topk"][2], dtype=np.int32).reshape(214, 2048)
    pos = np.concatenate([np.arange(152), np.arange(62)])
    assert (topk.max(axis=1) <= pos).all()
    o = np.frombuffer(ta["o"][2], dtype=np.uint16)
    assert not np.any((o & 0x7F80) == 0x7F80), "o holds NaN/inf"


def test_inputs_conflicting_flags_rejected(run, tmp_path):
    a = tmp_path / "a.safetensors"
    assert run("run", "--device", "cpu", "--prompts", "20", "--save", a).returncode == 0
    p = run("run", "--device", "cpu", "--inputs", a, "--prompts", "30")
    assert p.returncode == 2 and "--inputs" in p.stderr
    p = run("run", "--device", "cpu", "--inputs", a, "--fp8-weights")
    assert p.returncode == 2 and "--fp8-weights" in p.stderr and "--inputs" in p.stderr


def test_fp8_weights_save_then_inputs(run, tmp_path):
    """--fp8-weights --save writes kv_b_proj's FP8 form; --inputs runs it again bit for bit, with
    or without the bf16 form in the file and with the codes typed F8_E4M3 (a checkpoint's dtype).
    Block scales that are not powers of two (a real checkpoint's) give the bf16 form as the
    rounding of e4m3(code) * scale; a bf16 form that is not that rounding is refused."""
    a, b, c = (tmp_path / f"{x}.safetensors" for x in "abc")
    common = ["--device", "cpu", "--dispatch", "dense", "--kv", "fp8", "--page-size", "16"]
    p = run("run", *common, "--prompts", "150,60", "--prefix", "40,0", "--fp8-weights",
            "--save", a)
    assert p.returncode == 0, p.stderr
    ta, ma = read_safetensors(a)
    rows = 16 * (128 + 128)
    assert ta["kv_b_proj_fp8"][:2] == ("U8", [rows, 512])
    assert ta["kv_b_proj_fp8_scales"][:2] == ("F32", [rows // 128, 4])

    without_bf16 = {k: v for k, v in ta.items() if k != "kv_b_proj"}
    without_bf16["kv_b_proj_fp8"] = ("F8_E4M3",) + ta["kv_b_proj_fp8"][1:]
    write_safetensors(c, without_bf16, ma)
    for src in (a, c):
        q = run("run", *common, "--inputs", src, "--save", b, "--json")
        assert q.returncode == 0, q.stderr
        report = json.loads(q.stdout)
        assert report["weights"] == "bf16+fp8" and "gather" not in report["stages_ms"]
        tb, _ = read_safetensors(b)
        for name in ["kv_b_proj", "kv_b_proj_fp8_scales", "o", "lse", "kv_pool", "index_pool"]:
            assert ta[name] == tb[name], f"{name} differs (from {src.name})"
        assert tb["kv_b_proj_fp8"][2] == ta["kv_b_proj_fp8"][2]

    # Scales off the powers of two: the bf16 form is derived, the run verifies.
    scales = np.frombuffer(ta["kv_b_proj_fp8_scales"][2], np.float32) * np.float32(1.1)
    odd = dict(without_bf16)
    odd["kv_b_proj_fp8_scales"] = ("F32", ta["kv_b_proj_fp8_scales"][1], scales.tobytes())
    write_safetensors(c, odd, ma)
    q = run("run", *common, "--inputs", c, "--save", b, "--verify", "--verify-tokens", "12",
            "--json")
    assert q.returncode == 0, q.stdout + q.stderr
    assert json.loads(q.stdout)["verify"]["pass"]
    codes = np.frombuffer(ta["kv_b_proj_fp8"][2], np.uint8).reshape(rows, 512)
    block = np.repeat(np.repeat(scales.reshape(rows // 128, 4), 128, 0), 128, 1)
    want = bf16_bits_rne(e4m3_values(codes).astype(np.float32) * block)
    got = np.frombuffer(read_safetensors(b)[0]["kv_b_proj"][2], np.uint16).reshape(rows, 512)
    assert np.array_equal(got, want)

    # Both forms given, one bf16 element off the FP8 form's rounding.
    bad = dict(ta)
    w = bytearray(ta["kv_b_proj"][2])
    w[2 * 1000] ^= 1
    bad["kv_b_proj"] = ("BF16", ta["kv_b_proj"][1], bytes(w))
    write_safetensors(c, bad, ma)
    r = run("run", *common, "--inputs", c)
    assert r.returncode == 2 and "hold different weights: element [1, 488]" in r.stderr, r.stderr
    # --fp8-weights with a file that has no FP8 form.
    run("run", *common, "--prompts", "20", "--save", b)
    r = run("run", *common, "--inputs", b, "--fp8-weights")
    assert r.returncode == 2 and "has no kv_b_proj_fp8" in r.stderr, r.stderr


@pytest.mark.parametrize("kv", ["fp8", "fp8-raw", "bf16"])
def test_run_fp8_weights_verify(run, kv):
    """kv_b_proj's FP8 form: on FP8 pools the dense path's up-projection reads the pool's codes
    itself (no gather stage); a bf16 pool gathers as before; both match the float64 reference."""
    p = run("run", "--device", "cpu", "--kv", kv, "--prompts", "150,60", "--prefix", "40,0",
            "--dispatch", "dense", "--fp8-weights", "--verify", "--verify-tokens", "16", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["verify"]["pass"], report["verify"]
    stages = report["stages_ms"]
    assert "up_proj_kv" in stages and ("gather" in stages) == (kv == "bf16"), stages


def test_run_sparse_rows(run):
    """--sparse-rows staged: the sparse path reads a bf16 copy of the context rows (stage
    stage_rows) and still matches the float64 reference; pool reads the pool; a pool whose values
    bf16 does not hold (amax scales) refuses staged."""
    args = ["run", "--device", "cpu", "--tp", "8", "--kv", "fp8", "--prompts", "260,90",
            "--prefix", "120,0", "--dispatch", "sparse", "--verify", "--verify-tokens", "12",
            "--json"]
    for rows in ("staged", "pool"):
        p = run(*args, "--sparse-rows", rows)
        assert p.returncode == 0, p.stdout + p.stderr
        report = json.loads(p.stdout)
        assert report["verify"]["pass"], report["verify"]
        assert ("stage_rows" in report["stages_ms"]) == (rows == "staged"), report["stages_ms"]
    p = run(*args, "--sparse-rows", "staged", "--scale-policy", "amax")
    assert p.returncode == 2 and "sparse_rows staged" in p.stderr, p.stderr


def test_run_sparse_form_masked_mha(run):
    """--sparse-form masked-mha: the sparse path attends to its top-k as dense MHA under a mask
    (stages topk_to_kv_mask and dense_mha, no sparse_mla) over a prefix and chunks past the
    top-k, and matches the float64 reference; a bad value and --dcp are refused."""
    p = run("run", "--device", "cpu", "--tp", "8", "--prompts", "2200", "--prefix", "900",
            "--chunk", "700", "--dispatch", "sparse", "--sparse-form", "masked-mha", "--verify",
            "--verify-tokens", "10", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["verify"]["pass"] and report["verify"]["sparse_tokens"] > 0, report["verify"]
    assert report["sparse_form"] == "masked-mha"
    stages = report["stages_ms"]
    assert "topk_to_kv_mask" in stages and "dense_mha" in stages, stages
    assert "sparse_mla" not in stages, stages
    p = run("run", "--device", "cpu", "--prompts", "64", "--sparse-form", "masked")
    assert p.returncode == 2 and "masked-mha" in p.stderr, p.stderr
    p = run("run", "--device", "cuda", "--prompts", "64", "--dcp", "2", "--sparse-form",
            "masked-mha")  # refused before any GPU is looked for
    assert p.returncode == 2 and "--sparse-form" in p.stderr, p.stderr


@pytest.mark.parametrize("args,needle", [
    (["run", "--prompts", "abc"], "--prompts"),
    (["run", "--prompts", "100,-5"], "--prompts"),
    (["run", "--prompts", "100", "--prefix", "100"], "--prefix"),
    (["run", "--prompts", "100,50", "--prefix", "1"], "--prefix"),
    (["run", "--kv", "fp16"], "kv layout"),
    (["run", "--scale-policy", "max"], "scale policy"),
    (["run", "--page-size", "0"], "--page-size"),
    (["run", "--tp", "3"], "tp"),
    (["run", "--model", "no/such/config.json"], "deepseek-v3.2"),
    (["run", "--dispatch", "fastest"], "dispatch"),
    (["run", "--sparse-rows", "copy"], "sparse rows"),
    (["run", "--device", "tpu"], "device"),
    (["run", "--threshold", "5000"], "approximation"),
    (["run", "--no-such-flag"], "no-such-flag"),
    (["plan", "--mode", "prefill"], "forward mode"),
    (["plan", "--prompts", ""], "--prompts"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_flags_exit_2_with_a_message(run, args, needle):
    p = run(*args[:1], *(["--device", "cpu"] if args[0] == "run" and "--device" not in args else []),
            *args[1:])
    assert p.returncode == 2, (args, p.returncode, p.stdout, p.stderr)
    assert p.stderr.startswith("dsakit: error:"), p.stderr
    assert needle.lower() in p.stderr.lower(), p.stderr
    assert p.stderr.count("\n") <= 2, p.stderr  # one line, no stack trace


def test_malformed_config_file(run, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_attention_heads": 128, "kv_lora_rank": 512}))
    p = run("run", "--device", "cpu", "--model", cfg, "--prompts", "10")
    assert p.returncode == 2 and "qk_nope_head_dim" in p.stderr, p.stderr
    cfg.write_text("{not json")
    p = run("run", "--device", "cpu", "--model", cfg, "--prompts", "10")
    assert p.returncode == 2 and "dsakit: error:" in p.stderr, p.stderr


@pytest.mark.parametrize("content", [b"", b"\x01\x00", b"\xff" * 8 + b"{}", struct.pack("<Q", 2) + b"[]",
                                     struct.pack("<Q", 10) + b'{"a": 1}  '])
def test_malformed_inputs_file(run, tmp_path, content):
    f = tmp_path / "bad.safetensors"
    f.write_bytes(content)
    p = run("run", "--device", "cpu", "--inputs", f)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "dsakit: error:" in p.stderr and "bad.safetensors" in p.stderr, p.stderr


def test_truncated_inputs_file(run, tmp_path):
    a = tmp_path / "a.safetensors"
    assert run("run", "--device", "cpu", "--prompts", "20", "--save", a).returncode == 0
    raw = a.read_bytes()
    for cut in [len(raw) // 2, len(raw) - 1, 9]:
        t = tmp_path / f"t{cut}.safetensors"
        t.write_bytes(raw[:cut])
        p = run("run", "--device", "cpu", "--inputs", t)
        assert p.returncode == 2 and "dsakit: error:" in p.stderr, p.stderr


@pytest.mark.parametrize("sub", [[], ["run"], ["plan"], ["info"]])
def test_help_on_every_subcommand(run, sub):
    p = run(*sub, "--help")
    assert p.returncode == 0
    assert "Usage" in p.stdout or "usage" in p.stdout.lower()


def test_plan_reports_reason(run):
    p = run("plan", "--prompts", "1500,700", "--prefix", "0,512")
    assert p.returncode == 0 and p.stdout.startswith("dense_mha:"), p.stdout
    p = run("plan", "--prompts", "1950", "--prefix", "1900", "--json")  # rule mode: dense
    j = json.loads(p.stdout)
    assert j["path"] == "dense_mha" and j["rule"] == 0, j
    p = run("plan", "--prompts", "2100", "--prefix", "2050", "--json")
    j = json.loads(p.stdout)
    assert j["path"] == "sparse_mla" and j["rule"] == 4 and "2100 > threshold 2048" in j["reason"], j
    p = run("plan", "--prompts", "100", "--mode", "decode", "--prefix", "99")
    assert "rule 2" in p.stdout
    p = run("plan", "--prompts", "100", "--arch", "80")
    assert p.stdout.startswith("sparse_mla:") and "rule 3" in p.stdout


def test_env_override_echoed(run, dsakit):
    import os
    import subprocess
    env = dict(os.environ, DSAKIT_DISPATCH="sparse")
    p = subprocess.run([str(dsakit), "plan", "--prompts", "100"], capture_output=True, text=True, env=env)
    assert p.returncode == 0 and "[env: DSAKIT_DISPATCH=sparse]" in p.stdout, p.stdout
    env = dict(os.environ, DSAKIT_DENSE_KV_LEN_THRESHOLD="lots")
    p = subprocess.run([str(dsakit), "plan", "--prompts", "100"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "DSAKIT_DENSE_KV_LEN_THRESHOLD" in p.stderr
    env = dict(os.environ, DSAKIT_SPARSE_FORM="masked")  # plan reads it as a layer would
    p = subprocess.run([str(dsakit), "plan", "--prompts", "100"], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "DSAKIT_SPARSE_FORM" in p.stderr, p.stderr


def test_info(run):
    p = run("info")
    assert p.returncode == 0 and "backends: cpu" in p.stdout and "deepseek-v3.2" in p.stdout
    assert "FP8 up-projection: yes" in p.stdout  # the CPU backend has it
