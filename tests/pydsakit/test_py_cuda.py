"""The Python package on a GPU (tools/device-python.sh runs these on the H200): the ops with torch
CUDA tensors against the golden files and the float64 references, zero-copy (data pointers),
the caller's stream honoured (a race if it were not), torch.compile(fullgraph=True) over
torch.ops.dsakit.*, a CUDA graph of a layer forward (and of an op) replayed bit-exactly, and the
layer against the CLI's --save on the CUDA backend. Skipped without torch, a CUDA build or a GPU.
"""
import json
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsakit  # noqa: E402
import pydsakit_ref as ref  # noqa: E402
import torch_util  # noqa: E402
from pydsakit_ref import BF16, F32  # noqa: E402
from torch_util import tn  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU for torch"),
    pytest.mark.skipif(not dsakit.cuda_compiled(), reason="dsakit built without CUDA"),
]
DEV = "cuda"


def tt(a, device=DEV):
    return torch_util.tt(a, device)


@pytest.fixture(scope="module")
def prefill():
    g, meta = ref.peer("sparse_prefill.safetensors")
    g.update(ref.peer("sparse_prefill_out.safetensors")[0])
    g.update(ref.peer("sparse_prefill_topk_length.safetensors")[0])
    g["sm_scale"] = float(meta.get("sm_scale", ref.PEER_SM_SCALE))
    return g


def test_device_is_the_cuda_backend():
    assert dsakit.cuda_device_count() >= 1 and dsakit.device_name("cuda:0")
    print(dsakit.device_name("cuda:0"), dsakit.kernel_instances("cuda:0"))


# ---- ops: golden files and references -------------------------------------------------------------

@pytest.mark.parametrize("with_length", [False, True])
def test_sparse_mla_prefill(prefill, with_length):
    g = prefill
    tl = tt(g["topk_length"]) if with_length else None
    q, kv, idx = tt(g["q"]), tt(g["kv"]), tt(g["indices"])
    out, mx, lse = dsakit.ops.sparse_mla_prefill(q, kv, idx, g["sm_scale"], topk_length=tl)
    assert out.is_cuda and out.dtype == torch.bfloat16
    sfx = "_tl" if with_length else ""
    assert ref.rel_l2(tn(out), g["out" + sfx]) <= ref.TOL_BF16
    assert ref.max_abs_diff(tn(lse), g["lse" + sfx]) <= ref.TOL_LSE
    assert ref.max_abs_diff(tn(mx), g["max_logits" + sfx]) <= ref.TOL_LSE
    o_ref, lse_ref, _ = ref.sparse_attention(g["q"], g["kv"][:, 0], g["indices"][:, 0],
                                             g["sm_scale"], g["topk_length"] if with_length else None)
    assert ref.rel_l2(tn(out), o_ref) <= ref.TOL_BF16
    assert ref.max_abs_diff(tn(lse), lse_ref) <= ref.TOL_LSE
    assert bool((out[5] == 0).all()) and bool((lse[5] == float("inf")).all())
    assert bool((mx[5] == float("-inf")).all())


def test_sparse_mla_decode():
    g, meta = ref.peer("sparse_decode_fp8.safetensors")
    scale = float(meta.get("sm_scale", ref.PEER_SM_SCALE))
    kcache = tt(g["kcache"]).view(68, 64, 1, 656).view(torch.float8_e4m3fn)
    out, lse = dsakit.ops.sparse_mla_decode(tt(g["q"]), kcache, tt(g["indices"]), scale)
    assert out.shape == (4, 1, 64, 512) and lse.shape == (4, 64, 1)
    assert ref.rel_l2(tn(out), g["out"]) <= ref.TOL_BF16
    assert ref.max_abs_diff(tn(lse.transpose(1, 2)), g["lse"]) <= ref.TOL_LSE


def test_fp8_quantizer_byte_for_byte():
    g, _ = ref.peer("fp8_656_pow2.safetensors")
    packed = dsakit.ops.quantize_kv_fp8(tt(g["input"]).view(8, 64, 1, 576), scales="pow2")
    assert np.array_equal(tn(packed).reshape(512, 656), g["packed"])
    back = dsakit.ops.dequantize_kv_fp8(tt(g["packed"]))
    assert np.array_equal(tn(back).view(np.uint16), g["dequantized"].view(np.uint16))


def test_fp8_mqa_logits():
    g, _ = ref.peer("indexer_logits.safetensors")
    logits = dsakit.ops.fp8_mqa_logits(tt(g["q_fp8"]).view(torch.float8_e4m3fn),
                                       (tt(g["k_fp8"]).view(torch.float8_e4m3fn), tt(g["k_scale"])),
                                       tt(g["weights"]), tt(g["ks"]), tt(g["ke"]))
    _, mask = ref.indexer_logits(g["q_fp8"], g["k_fp8"], g["k_scale"], g["weights"], g["ks"],
                                 g["ke"])
    got = tn(logits)
    assert ref.rel_l2(got[mask], g["logits"][mask]) <= ref.TOL_INDEXER_REL
    assert np.abs(got[mask] - g["logits"][mask]).max() <= \
        ref.TOL_INDEXER_ABS_OF_MAX * np.abs(g["logits"][mask]).max()
    assert np.all(got[~mask] == -np.inf)


def test_fp8_mqa_topk():
    """On DeepGEMM's golden inputs: the same positions as topk over fp8_mqa_logits' [ks, ke)
    columns on the GPU, and through torch.compile."""
    g, _ = ref.peer("indexer_logits.safetensors")
    args = (tt(g["q_fp8"]).view(torch.float8_e4m3fn),
            (tt(g["k_fp8"]).view(torch.float8_e4m3fn), tt(g["k_scale"])), tt(g["weights"]),
            tt(g["ks"]), tt(g["ke"]))
    k = 32
    logits = tn(dsakit.ops.fp8_mqa_logits(*args))
    ks, ke = g["ks"].astype(np.int64), g["ke"].astype(np.int64)
    local = np.full(logits.shape, -np.inf, F32)
    for i in range(logits.shape[0]):
        local[i, :ke[i] - ks[i]] = logits[i, ks[i]:ke[i]]
    want = tn(dsakit.ops.topk(tt(local), k, tt((ke - ks).astype(np.int32))))
    got = dsakit.ops.fp8_mqa_topk(*args, k)
    assert got.is_cuda and got.dtype == torch.int32
    assert np.array_equal(tn(got), want)
    # ks / ke on the host (read in place, no device-to-host copy)
    host = dsakit.ops.fp8_mqa_topk(*args[:3], g["ks"], g["ke"], k)
    assert host.is_cuda and np.array_equal(tn(host), want)
    compiled = torch.compile(lambda *a: dsakit.ops.fp8_mqa_topk(*a, k), fullgraph=True)
    assert np.array_equal(tn(compiled(*args)), want)


def test_topk(rng):
    x = rng.standard_normal((9, 3000)).astype(F32)
    x[1] = 0.25
    x[2, ::5] = np.nan
    lengths = rng.integers(200, 3001, 9).astype(np.int32)
    lengths[3] = 100
    got = dsakit.ops.topk(tt(x), 128, tt(lengths))
    assert np.array_equal(tn(got), ref.topk(x, 128, lengths))


def test_dense_mha_prefill(rng):
    h, d_nope, d_rope, d_v = 16, 128, 64, 128  # DeepSeek-V3.2's compiled dense instance
    q_lens, k_lens = [40, 7], [40, 300]
    cu_q = np.array([0, 40, 47], np.int32)
    cu_k = np.array([0, 40, 340], np.int32)
    q = rng.standard_normal((47, h, d_nope + d_rope)).astype(BF16)
    k_nope = rng.standard_normal((340, h, d_nope))
    k_pe = np.broadcast_to(rng.standard_normal((340, 1, d_rope)), (340, h, d_rope))
    k = np.concatenate([k_nope, k_pe], axis=2).astype(BF16)
    v = rng.standard_normal((340, h, d_v)).astype(BF16)
    scale = 192 ** -0.5
    out, lse = dsakit.ops.dense_mha_prefill(tt(q), tt(k), tt(v), tt(cu_q), tt(cu_k), scale,
                                            cu_seqlens_q_host=torch.from_numpy(cu_q),
                                            cu_seqlens_k_host=torch.from_numpy(cu_k))
    o_ref, lse_ref = ref.dense_mha(q, k, v, cu_q, cu_k, scale)
    assert ref.rel_l2(tn(out), o_ref) <= ref.TOL_BF16
    assert ref.max_abs_diff(tn(lse).T, lse_ref) <= 5e-3  # bf16 intermediates (numerics.md)
    with pytest.raises(NotImplementedError, match="causal=False"):
        dsakit.ops.dense_mha_prefill(tt(q), tt(k), tt(v), tt(cu_q), tt(cu_k), scale, causal=False)
    # Under a top-64 mask built on the GPU (the wgmma kernel's masked instance), also compiled.
    lengths = np.concatenate([np.arange(1, 41), np.arange(294, 301)]).astype(np.int32)
    positions = dsakit.ops.topk(tt(rng.standard_normal((47, 300)).astype(np.float32)), 64,
                                tt(lengths))
    mask = dsakit.ops.topk_to_kv_mask(positions, 300)
    o_ref, lse_ref = ref.dense_mha(q, k, v, cu_q, cu_k, scale, kv_mask=tn(mask))
    for op in (dsakit.ops.dense_mha_prefill, torch.compile(dsakit.ops.dense_mha_prefill)):
        out, lse = op(tt(q), tt(k), tt(v), tt(cu_q), tt(cu_k), scale, kv_mask=mask,
                      cu_seqlens_q_host=torch.from_numpy(cu_q),
                      cu_seqlens_k_host=torch.from_numpy(cu_k))
        assert ref.rel_l2(tn(out), o_ref) <= ref.TOL_BF16
        assert ref.max_abs_diff(tn(lse).T, lse_ref) <= 5e-3


# ---- zero-copy, streams ---------------------------------------------------------------------------

def test_zero_copy_data_pointers(prefill):
    g = prefill
    q, kv, idx = tt(g["q"]), tt(g["kv"]), tt(g["indices"])
    out = torch.empty(32, 64, 512, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(32, 64, dtype=torch.float32, device=DEV)
    mx = torch.empty(32, 64, dtype=torch.float32, device=DEV)
    r = dsakit.ops.sparse_mla_prefill(q, kv, idx, g["sm_scale"], out=out, max_logits=mx, lse=lse)
    assert [t.data_ptr() for t in r] == [out.data_ptr(), mx.data_ptr(), lse.data_ptr()]
    storage = torch.zeros(4 * 64, 656, dtype=torch.uint8, device=DEV)
    pool = dsakit.KvPool.wrap(storage, "fp8", 64)
    assert pool.storage.data_ptr() == storage.data_ptr() and pool.device == "cuda:0"
    own = dsakit.KvPool("bf16", 16, 4, "cuda")
    s1, s2 = own.storage, own.storage  # views of the same dsakit memory
    assert s1.is_cuda and s1.data_ptr() == s2.data_ptr() and s1.shape == (64, 1152)


def test_ops_run_on_the_callers_stream(prefill):
    g = prefill
    q_src, kv, idx = tt(g["q"]), tt(g["kv"]), tt(g["indices"])
    want = dsakit.ops.sparse_mla_prefill(q_src, kv, idx, g["sm_scale"])[0]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    for explicit in (False, True):
        q = torch.zeros_like(q_src)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before q is filled, on `side`
            q.copy_(q_src)
            out = dsakit.ops.sparse_mla_prefill(q, kv, idx, g["sm_scale"],
                                                stream=side if explicit else None)[0]
        side.synchronize()
        # on any other stream the kernel would have read the zeros
        assert torch.equal(out, want), f"explicit stream={explicit}"


# ---- the layer --------------------------------------------------------------------------------------

class CudaLayer:
    def __init__(self, rng, layout="fp8", pages=16, page_size=64, topk=128):
        self.cfg = dsakit.ModelConfig.load("deepseek-v3.2").with_tp(8)
        self.cfg.index_topk = topk
        c = self.cfg
        self.kv = dsakit.KvPool(layout, page_size, pages, DEV)
        self.ix = dsakit.IndexPool(page_size, pages, DEV, d_i=c.index_head_dim)
        w = rng.standard_normal((c.num_heads * (c.qk_nope_head_dim + c.v_head_dim),
                                 c.kv_lora_rank)) / np.sqrt(c.kv_lora_rank)
        self.w = tt(w.astype(BF16))
        self.layer = dsakit.DsaAttention(c, self.kv, self.ix, self.w)
        self.rng = rng

    def inputs(self, t):
        c, g = self.cfg, self.rng
        shapes = [(t, c.num_heads, c.qk_nope_head_dim), (t, c.num_heads, c.qk_rope_head_dim),
                  (t, c.kv_lora_rank), (t, c.qk_rope_head_dim),
                  (t, c.index_n_heads, c.index_head_dim), (t, c.index_head_dim)]
        xs = [tt(g.standard_normal(s).astype(BF16)) for s in shapes]
        xs.append(tt(g.standard_normal((t, c.index_n_heads)).astype(F32)))
        return dsakit.LayerInputs(*xs)


def test_layer_forward_on_the_callers_stream_into_given_outputs(rng):
    s = CudaLayer(rng)
    batch = dsakit.Batch([0, 0], [300, 100], [[0, 1, 2, 3, 4], [5, 6]])
    x = s.inputs(400)
    want = s.layer.forward(batch, x)
    assert want.plan.path in ("sparse_mla", "mixed") and want.o.is_cuda
    torch.cuda.synchronize()
    zeros = dsakit.LayerInputs(*(torch.zeros_like(t) for t in x))
    o = torch.empty_like(want.o)
    lse = torch.empty_like(want.lse)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        for dst, src in zip(zeros, x):
            dst.copy_(src)
        res = s.layer.forward(batch, zeros, o=o, lse=lse)
    side.synchronize()
    assert res.o.data_ptr() == o.data_ptr() and res.lse.data_ptr() == lse.data_ptr()
    assert torch.equal(o, want.o) and torch.equal(lse, want.lse)


def test_fp8_weights_as_torch_float8(rng):
    """kv_b_proj's FP8 form as torch.float8_e4m3fn codes and f32 block scales on the GPU (power
    of two, so the bf16 weights are the same values): the dense layer's FP8 up-projection (no
    gather stage) agrees with the bf16 weights' layer, from a cached prefix."""
    s = CudaLayer(rng)
    c = s.cfg
    rows, d_c = c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank
    codes = torch.empty(rows, d_c, device=DEV).uniform_(-448, 448).to(torch.float8_e4m3fn)
    e = torch.randint(12, 15, ((rows + 127) // 128, d_c // 128), device=DEV)
    scales = torch.exp2(-e.float())
    w = (codes.float() * scales.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1))
    w = w.to(torch.bfloat16)
    options = dsakit.LayerOptions(dispatch="dense", time_stages=True)
    plain = dsakit.DsaAttention(c, s.kv, s.ix, w, options)
    fp8 = dsakit.DsaAttention(c, s.kv, s.ix, w, options, kv_b_proj_fp8=(codes, scales))
    x = s.inputs(120)
    first = dsakit.Batch([0], [100], [[0, 1]])
    plain.forward(first, dsakit.LayerInputs(*(t[:100] for t in x)))
    rest = dsakit.Batch([100], [20], [[0, 1]])  # the first 100 positions re-read from the pool
    tail = dsakit.LayerInputs(*(t[100:] for t in x))
    a, b = plain.forward(rest, tail), fp8.forward(rest, tail)
    assert a.plan.path == b.plan.path == "dense_mha"
    assert "gather" in dict(a.stages) and "gather" not in dict(b.stages), b.stages
    oa, ob = a.o.double(), b.o.double()
    assert torch.linalg.norm(oa - ob) <= 1e-2 * torch.linalg.norm(oa)
    # The FP8 GEMM's tensor cores sum each 128-value block narrower than f32, so ~5% of the bf16
    # K / V elements land a neighbouring value: the lse bound after the FP8 up-projection is
    # numerics.md's 3e-2 (reference::lse_bound), not the bit-level agreement of one GEMM.
    assert torch.max(torch.abs(a.lse - b.lse)) <= 3e-2


def test_cuda_graph_of_a_layer_forward_replays_bit_exactly(rng):
    s = CudaLayer(rng)
    # cuda_graph=True: the dispatcher's rule 1 keeps the batch on the sparse path
    batch = dsakit.Batch([0, 0], [200, 60], [[0, 1, 2, 3], [4]], cuda_graph=True)
    static = s.inputs(260)
    t, c = 260, s.cfg
    o = torch.empty(t, c.num_heads, c.v_head_dim, dtype=torch.bfloat16, device=DEV)
    lse = torch.empty(t, c.num_heads, dtype=torch.float32, device=DEV)
    topk = torch.empty(t, c.index_topk, dtype=torch.int32, device=DEV)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prepared = s.layer.prepare(batch)
        assert prepared.plan.path == "sparse_mla" and prepared.plan.rule == 1
        for _ in range(2):  # warm the backend's memory on the capture stream
            s.layer.forward(prepared, static, o=o, lse=lse, topk=topk)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        s.layer.forward(prepared, static, o=o, lse=lse, topk=topk)
    for _ in range(3):
        new = s.inputs(t)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = s.layer.forward(batch, new)  # the same positions rewritten with the same rows
        torch.cuda.synchronize()
        assert torch.equal(o, eager.o) and torch.equal(lse, eager.lse)
        assert torch.equal(topk, eager.topk)


def test_cuda_graph_of_an_op_and_torch_compile(prefill):
    g = prefill
    q, kv, idx = tt(g["q"]), tt(g["kv"]), tt(g["indices"])
    want = torch.ops.dsakit.sparse_mla_prefill(q, kv, idx, g["sm_scale"])

    def f(q, kv, idx):
        out, mx, lse = torch.ops.dsakit.sparse_mla_prefill(q, kv, idx, 0.1352)
        return out, torch.ops.dsakit.topk(lse, 16, None), mx

    compiled = torch.compile(f, fullgraph=True)
    got = compiled(q, kv, idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[1])
    assert torch.equal(got[1], torch.ops.dsakit.topk(want[2], 16, None))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    static_q = q.clone()
    with torch.cuda.stream(stream):
        for _ in range(2):
            f(static_q, kv, idx)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = f(static_q, kv, idx)
    static_q.copy_(q.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    eager = f(q.flip(0).contiguous(), kv, idx)
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))


def test_layer_matches_the_cli_on_cuda(cli, tmp_path):
    """The layer from Python and `dsakit run --device cuda --save` on the same inputs: the same
    bits (one call, so the call sequence is trivially the same)."""
    c = json.loads(dsakit.ModelConfig.load("deepseek-v3.2").to_json())
    c["index_topk"] = 256
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(c))
    save = tmp_path / "run.safetensors"
    p = subprocess.run([str(cli), "run", "--device", "cuda", "--model", str(cfg_path), "--tp",
                        "8", "--kv", "fp8", "--prompts", "700,300", "--save", str(save),
                        "--quiet"], capture_output=True, text=True, timeout=600)
    if p.returncode != 0 and "no CUDA backend" in p.stderr:
        pytest.skip("the CLI in DSAKIT_BUILD_DIR has no CUDA backend")
    assert p.returncode == 0, p.stderr
    t, meta = ref.read_safetensors(save)
    cfg = dsakit.ModelConfig.from_json(meta["config"])
    kv = dsakit.KvPool("fp8", 64, 17, DEV)
    ix = dsakit.IndexPool(64, 17, DEV, d_i=cfg.index_head_dim)
    layer = dsakit.DsaAttention(cfg, kv, ix, tt(t["kv_b_proj"]))
    names = ("q_nope", "q_pe", "c_kv", "k_pe", "idx_q", "idx_k", "idx_w")
    res = layer.forward(dsakit.Batch([0, 0], [700, 300], [list(range(11)), list(range(11, 16))]),
                        dsakit.LayerInputs(*(tt(t[n]) for n in names)))
    assert np.array_equal(tn(res.o).view(np.uint16), t["o"].view(np.uint16))
    assert np.array_equal(tn(res.lse).view(np.uint32), t["lse"].view(np.uint32))
    assert np.array_equal(tn(res.topk), t["topk"])
