"""The layer from Python on the CPU (NumPy arrays): the same bits as the C++ CLI's `--save` file
on the same inputs and call sequence, given outputs written in place, prepared batches, plans,
and the engine example."""
import json
import pathlib
import runpy
import subprocess

import numpy as np
import pytest

import dsakit
import pydsakit_ref as ref
from pydsakit_ref import BF16, F32

REPO = pathlib.Path(__file__).resolve().parents[2]
NAMES = ("q_nope", "q_pe", "c_kv", "k_pe", "idx_q", "idx_k", "idx_w")


def small_topk_config(tmp_path, k=128):
    """deepseek-v3.2's config.json with index_topk = k: both paths at a few hundred tokens."""
    c = json.loads(dsakit.ModelConfig.load("deepseek-v3.2").to_json())
    c["index_topk"] = k
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c))
    return path


def run_schedule(layer, tables, tokens, offsets, begin, end, chunk, mode, outs):
    """tools/../src/layer/driver.cc's run_schedule: every request with positions left sends the
    next min(chunk, left) of them, as one extend (or decode) per step."""
    pos = list(begin)
    while True:
        prefix, extend, tabs, rows = [], [], [], []
        for r in range(len(pos)):
            left = end[r] - pos[r]
            if left <= 0:
                continue
            e = min(chunk, left) if chunk > 0 else left
            prefix.append(pos[r])
            extend.append(e)
            tabs.append(tables[r])
            rows += [offsets[r] + pos[r] + i for i in range(e)]
            pos[r] += e
        if not prefix:
            return
        res = layer.forward(dsakit.Batch(prefix, extend, tabs, mode=mode),
                            dsakit.LayerInputs(*(tokens[n][rows] for n in NAMES)))
        outs["o"][rows] = res.o
        outs["lse"][rows] = res.lse
        if res.topk is not None:
            outs["topk"][rows] = res.topk


CASES = [  # layout, prompts, prefix, chunk, decode steps, extra flags
    ("fp8", [300, 120], [0, 0], 64, 2, []),              # dense steps, then sparse, then decode
    ("bf16", [200], [150], 0, 1, []),                     # a cached prefix, sparse
    ("fp8", [90, 40], [30, 0], 0, 0, ["--scale-policy", "amax"]),  # dense over a prefix
    ("fp8-raw", [170], [0], 100, 1, ["--k-scale", "0.5"]),
]


@pytest.mark.parametrize("layout,prompts,prefix,chunk,decode,flags", CASES)
def test_layer_matches_the_cli_bit_for_bit(cli, tmp_path, layout, prompts, prefix, chunk, decode,
                                           flags):
    cfg_path = small_topk_config(tmp_path)
    save = tmp_path / "run.safetensors"
    args = [str(cli), "run", "--device", "cpu", "--model", str(cfg_path), "--tp", "8", "--kv",
            layout, "--prompts", ",".join(map(str, prompts)), "--prefix",
            ",".join(map(str, prefix)), "--chunk", str(chunk), "--decode-steps", str(decode),
            "--seed", "7", "--save", str(save), "--quiet", *flags]
    p = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    t, meta = ref.read_safetensors(save)
    cfg = dsakit.ModelConfig.from_json(meta["config"])
    assert cfg.num_heads == 16 and cfg.index_topk == 128

    page = int(meta["page_size"])
    lengths = [n + decode for n in prompts]
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    pages = [(n + page - 1) // page for n in lengths]
    tables = [list(range(sum(pages[:r]), sum(pages[:r + 1]))) for r in range(len(lengths))]
    kv = dsakit.KvPool(meta["layout"], page, sum(pages) + 1, "cpu",
                       scale_policy=meta["scale_policy"],
                       k_scale=float(flags[1]) if "--k-scale" in flags else 1.0)
    ix = dsakit.IndexPool(page, sum(pages) + 1, "cpu", d_i=cfg.index_head_dim)
    layer = dsakit.DsaAttention(cfg, kv, ix, t["kv_b_proj"])
    assert layer.sm_scale == pytest.approx(float(meta["sm_scale"]), rel=1e-15)

    rows = sum(lengths)
    outs = {"o": np.full((rows, 16, 128), np.nan, dtype=BF16),
            "lse": np.full((rows, 16), np.nan, dtype=F32),
            "topk": np.full((rows, 128), -1, dtype=np.int32)}
    zeros = [0] * len(prompts)
    if any(prefix):
        run_schedule(layer, tables, t, offsets, zeros, prefix, 0, "extend", outs)
    run_schedule(layer, tables, t, offsets, prefix, prompts, chunk, "extend", outs)
    if decode:
        run_schedule(layer, tables, t, offsets, prompts, lengths, 1, "decode", outs)

    assert np.array_equal(outs["o"].view(np.uint16), t["o"].view(np.uint16))
    assert np.array_equal(outs["lse"].view(np.uint32), t["lse"].view(np.uint32))
    if "topk" in t:
        assert np.array_equal(outs["topk"], t["topk"])
    # the pools hold the same rows, position by position
    kv_bytes = kv.storage
    ix_pages = ix.storage
    d_i = cfg.index_head_dim
    for r, n in enumerate(lengths):
        for pos in range(n):
            row = offsets[r] + pos
            pg, slot = tables[r][pos // page], pos % page
            assert np.array_equal(kv_bytes[pg * page + slot], t["kv_pool"][row]), (r, pos)
            codes = ix_pages[pg, slot * d_i:(slot + 1) * d_i]
            scale = ix_pages[pg, page * d_i + 4 * slot:page * d_i + 4 * slot + 4]
            assert np.array_equal(np.concatenate([codes, scale]), t["index_pool"][row]), (r, pos)


# ---- a small layer for the API tests -----------------------------------------------------------

class Small:
    """deepseek-v3.2 at TP8 (16 heads) with index_topk 64, page size 16, on the CPU."""

    def __init__(self, rng, layout="fp8", pages=24, topk=64, **options):
        self.cfg = dsakit.ModelConfig.load("deepseek-v3.2").with_tp(8)
        self.cfg.index_topk = topk
        c = self.cfg
        self.kv = dsakit.KvPool(layout, 16, pages)
        self.ix = dsakit.IndexPool(16, pages, d_i=c.index_head_dim)
        self.w = (rng.standard_normal((c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                       c.kv_lora_rank)) / np.sqrt(c.kv_lora_rank)).astype(BF16)
        self.layer = dsakit.DsaAttention(c, self.kv, self.ix, self.w,
                                         dsakit.LayerOptions(**options))
        self.rng = rng

    def inputs(self, t):
        c, g = self.cfg, self.rng
        return dsakit.LayerInputs(
            g.standard_normal((t, c.num_heads, c.qk_nope_head_dim)).astype(BF16),
            g.standard_normal((t, c.num_heads, c.qk_rope_head_dim)).astype(BF16),
            (g.standard_normal((t, c.kv_lora_rank)) * 0.3).astype(BF16),
            g.standard_normal((t, c.qk_rope_head_dim)).astype(BF16),
            g.standard_normal((t, c.index_n_heads, c.index_head_dim)).astype(BF16),
            g.standard_normal((t, c.index_head_dim)).astype(BF16),
            g.standard_normal((t, c.index_n_heads)).astype(F32))

    def pools(self):
        return self.kv.storage.tobytes() + self.ix.storage.tobytes()


def test_forward_writes_given_outputs_and_prepared_batches_match(rng):
    s = Small(rng)
    batch = dsakit.Batch([0, 0], [100, 30], [list(range(0, 7)), list(range(7, 9))])
    assert batch.num_new_tokens == 130 and batch.total_kv_len == 130
    x = s.inputs(130)
    plain = s.layer.forward(batch, x)
    assert plain.plan.path == "sparse_mla" and "rule 4" in plain.plan.reason
    assert plain.topk.shape == (130, 64) and plain.topk.dtype == np.int32
    o = np.full((130, 16, 128), np.nan, dtype=BF16)
    lse = np.full((130, 16), np.nan, dtype=F32)
    topk = np.full((130, 64), -7, dtype=np.int32)
    prepared = s.layer.prepare(batch)
    assert prepared.plan.path == "sparse_mla" and prepared.batch.num_new_tokens == 130
    for b in (batch, prepared):
        res = s.layer.forward(b, x, o=o, lse=lse, topk=topk)
        assert res.o is o and res.lse is lse and res.topk is topk  # written in place
        assert np.array_equal(o.view(np.uint16), plain.o.view(np.uint16))
        assert np.array_equal(lse, plain.lse) and np.array_equal(topk, plain.topk)
    other = Small(rng)
    with pytest.raises(ValueError, match="prepared by another layer"):
        other.layer.forward(prepared, x)


@pytest.mark.parametrize("layout", ["fp8", "fp8-raw", "bf16"])
def test_fp8_weights_match_the_bf16_weights(rng, layout):
    """kv_b_proj's FP8 form (e4m3 codes as float8_e4m3fn, power-of-two 128 x 128 block scales,
    so the bf16 weights are the same values): the dense layer with it agrees with the layer
    without, and on FP8 pools its up-projection reads the pool itself (no gather stage)."""
    s = Small(rng, layout=layout, topk=128)
    c = s.cfg
    rows, d_c = c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank
    codes = rng.uniform(-448, 448, (rows, d_c)).astype(ref.E4M3)
    scales = np.exp2(-rng.integers(12, 15, ((rows + 127) // 128, d_c // 128))).astype(F32)
    w = (codes.astype(F32) * np.repeat(np.repeat(scales, 128, 0), 128, 1)[:rows]).astype(BF16)
    assert np.array_equal(w.astype(F32) / np.repeat(np.repeat(scales, 128, 0), 128, 1)[:rows],
                          codes.astype(F32))  # bf16-exact
    options = dsakit.LayerOptions(dispatch="dense", time_stages=True)
    plain = dsakit.DsaAttention(c, s.kv, s.ix, w, options)
    fp8 = dsakit.DsaAttention(c, s.kv, s.ix, w, options, kv_b_proj_fp8=(codes, scales))
    batch = dsakit.Batch([0], [90], [list(range(0, 6))])
    x = s.inputs(90)
    a = plain.forward(batch, x)
    b = fp8.forward(batch, x)  # the same tokens stored again at the same locations
    assert a.plan.path == b.plan.path == "dense_mha"
    oa, ob = a.o.astype(np.float64), b.o.astype(np.float64)
    assert np.linalg.norm(oa - ob) <= 1e-2 * np.linalg.norm(oa)
    assert np.max(np.abs(a.lse - b.lse)) <= 1e-3
    stages = dict(b.stages)
    assert "up_proj_kv" in stages and ("gather" in stages) == (layout == "bf16"), stages
    with pytest.raises(TypeError, match="kv_b_proj_fp8"):
        dsakit.DsaAttention(c, s.kv, s.ix, w, options, kv_b_proj_fp8=codes)
    with pytest.raises(ValueError, match="kv_b_proj_fp8.scales"):
        dsakit.DsaAttention(c, s.kv, s.ix, w, options, kv_b_proj_fp8=(codes, scales[:1]))


def test_plan_batch_tables_and_options(rng):
    s = Small(rng, dispatch="dense", time_stages=True)
    table = np.array([[3, 4, 5, 9, 9], [6, 7, -1, -1, -1]], dtype=np.int32)  # engine-style, padded
    batch = dsakit.Batch(np.array([10, 0], np.int32), [20, 17], table, page_size=16)
    assert batch.page_tables == [[3, 4], [6, 7]]
    plan = s.layer.plan(batch)
    assert plan.path == "dense_mha" and plan.mode == "dense"
    assert s.layer.workspace_bytes(batch) > 0
    res = s.layer.forward(batch, s.inputs(37), topk=np.full((37, 64), 5, np.int32))
    assert res.topk is None and res.plan.path == "dense_mha"  # a given topk is not written
    assert [name for name, _ in res.stages][:1] == ["store"] and all(ms >= 0 for _, ms in res.stages)
    # in rule mode decode routes to sparse (rule 2); an empty batch returns empty outputs
    s.layer.set_dispatch("rule")
    dec = dsakit.Batch([30, 17], [1, 1], [[3, 4], [6, 7]], mode="decode")
    assert s.layer.plan(dec).path == "sparse_mla" and s.layer.plan(dec).rule == 2
    empty = s.layer.forward(dsakit.Batch([0], [0], [[]]), s.inputs(0))
    assert empty.o.shape == (0, 16, 128) and empty.lse.shape == (0, 16)
    cfg = dsakit.ModelConfig.load(str(REPO / "tests/data/configs/glm-5.json")).with_tp(4)
    assert cfg.num_heads == cfg.num_heads_total // 4 and cfg.v_head_dim == 256


def test_engine_backend_example_runs(capsys):
    mod = runpy.run_path(str(REPO / "examples" / "engine_backend.py"))
    mod["main"](["--device", "cpu", "--prompts", "150,70", "--chunk", "64", "--topk", "128"])
    out = capsys.readouterr().out
    assert "chunked prefill matches one-shot" in out


def test_concurrent_calls_from_threads_match_one_thread(rng):
    """Calls from several Python threads (the GIL released while they run, one call at a time
    per backend) give the single-thread bits, and a pool freed meanwhile is refused cleanly."""
    import threading
    g, meta = ref.peer("sparse_prefill.safetensors")
    want = dsakit.ops.sparse_mla_prefill(g["q"], g["kv"], g["indices"], 0.1352)[0]
    s = Small(rng)
    batch = dsakit.Batch([0], [70], [list(range(5))])
    x = s.inputs(70)
    layer_want = s.layer.forward(batch, x).o
    errors = []

    def work(i):
        try:
            for _ in range(5):
                if i % 2:
                    got = dsakit.ops.sparse_mla_prefill(g["q"], g["kv"], g["indices"], 0.1352)[0]
                    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
                else:
                    got = s.layer.forward(batch, x).o
                    assert np.array_equal(got.view(np.uint16), layer_want.view(np.uint16))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    other = Small(rng)
    stop = []

    def forward_until_freed():
        while True:
            try:
                other.layer.forward(batch, x)
            except ValueError as e:
                stop.append(str(e))
                return

    t = threading.Thread(target=forward_until_freed)
    t.start()
    other.kv.free()
    t.join(timeout=60)
    assert stop and "freed" in stop[0]


def test_staged_rows_read_the_pools_values(rng):
    """LayerOptions(sparse_rows=...): the sparse path reading a bf16 copy of the context rows
    returns the bits of reading the FP8 pool (the CPU's arithmetic is the same either way), shows
    its copy as the stage_rows stage, and a copy bf16 cannot hold is refused at construction."""
    batch = dsakit.Batch([0, 0], [100, 30], [list(range(0, 7)), list(range(7, 9))])
    results = {}
    for rows in ("pool", "staged"):
        s = Small(np.random.default_rng(7), dispatch="sparse", time_stages=True, sparse_rows=rows)
        assert s.layer.options.sparse_rows == rows
        results[rows] = s.layer.forward(batch, s.inputs(130))
    a, b = results["pool"], results["staged"]
    assert a.plan.path == b.plan.path == "sparse_mla"
    assert "stage_rows" not in dict(a.stages) and "stage_rows" in dict(b.stages)
    assert np.array_equal(a.o.view(np.uint16), b.o.view(np.uint16))
    assert np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32))
    assert np.array_equal(a.topk, b.topk)
    with pytest.raises(ValueError, match="sparse rows: expected 'auto', 'pool' or 'staged'"):
        dsakit.LayerOptions(sparse_rows="copy")
    s = Small(rng)
    amax = dsakit.KvPool("fp8", 16, 24, scale_policy="amax")
    with pytest.raises(ValueError, match="sparse_rows staged"):
        dsakit.DsaAttention(s.cfg, amax, s.ix, s.w, dsakit.LayerOptions(sparse_rows="staged"))


def test_sparse_form_masked_mha_equals_mla():
    """LayerOptions(sparse_form="masked-mha"): the sparse path attends to the same top-k as dense
    MHA under a mask (topk_to_kv_mask and dense_mha stages, no sparse_mla) with the MLA form's
    outputs (f32 arithmetic on the CPU: within its rounding), over 130 tokens past a top-k of 64."""
    batch = dsakit.Batch([0, 0], [100, 30], [list(range(0, 7)), list(range(7, 9))])
    results = {}
    for form in ("mla", "masked-mha"):
        s = Small(np.random.default_rng(11), dispatch="sparse", time_stages=True,
                  sparse_form=form, output_dtype="f32")
        assert s.layer.options.sparse_form == form
        results[form] = s.layer.forward(batch, s.inputs(130))
    a, b = results["mla"], results["masked-mha"]
    assert a.plan.path == b.plan.path == "sparse_mla"
    assert (a.plan.sparse_form, b.plan.sparse_form) == ("mla", "masked-mha")
    assert a.plan.predicted_masked_ms == -1  # forced sparse: nothing priced
    assert "sparse_mla" in dict(a.stages) and "sparse_mla" not in dict(b.stages)
    assert "topk_to_kv_mask" in dict(b.stages) and "dense_mha" in dict(b.stages)
    assert np.array_equal(a.topk, b.topk) and (a.topk[:, -1] >= 0).any()  # a real selection
    oa, ob = a.o.astype(np.float64), b.o.astype(np.float64)
    assert np.linalg.norm(oa - ob) <= 1e-5 * np.linalg.norm(oa)
    assert np.abs(a.lse - b.lse).max() <= 1e-3
    assert dsakit.LayerOptions().sparse_form == "auto"  # cost mode may pick; mla here
    with pytest.raises(ValueError, match="sparse form: expected 'auto', 'mla' or 'masked-mha'"):
        dsakit.LayerOptions(sparse_form="dense")
