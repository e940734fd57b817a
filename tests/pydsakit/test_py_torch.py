"""PyTorch on the CPU (skipped where torch is not installed, as in CI): torch tensors through
DLPack zero-copy, torch.ops.dsakit.* with fake implementations under
torch.compile(fullgraph=True), the layer with torch tensors. tests/pydsakit/test_py_cuda.py has
the CUDA side."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsakit  # noqa: E402
import pydsakit_ref as ref  # noqa: E402
from test_py_layer import Small  # noqa: E402
from torch_util import tn, tt  # noqa: E402


@pytest.fixture(scope="module")
def prefill():
    g, meta = ref.peer("sparse_prefill.safetensors")
    g.update(ref.peer("sparse_prefill_out.safetensors")[0])
    return g


def test_ops_are_registered_with_torch_library():
    for name in ("sparse_mla_prefill", "sparse_mla_decode", "quantize_kv_fp8",
                 "dequantize_kv_fp8", "fp8_mqa_logits", "fp8_mqa_topk", "topk", "topk_to_kv_mask",
                 "dense_mha_prefill"):
        assert hasattr(torch.ops.dsakit, name), name
    # topk_to_kv_mask's fake: one i32 word per 32 positions.
    with torch._subclasses.fake_tensor.FakeTensorMode():
        positions = torch.empty(5, 8, dtype=torch.int32)
        assert torch.ops.dsakit.topk_to_kv_mask(positions, 70).shape == (5, 3)


def test_sparse_prefill_with_torch_tensors_zero_copy(prefill):
    g = prefill
    q, kv, idx = tt(g["q"]), tt(g["kv"]), tt(g["indices"])
    out, mx, lse = dsakit.ops.sparse_mla_prefill(q, kv, idx, ref.PEER_SM_SCALE)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (32, 64, 512)
    assert ref.rel_l2(tn(out), g["out"]) <= ref.TOL_BF16
    assert ref.max_abs_diff(tn(lse), g["lse"]) <= ref.TOL_LSE
    o2 = torch.empty_like(out)
    r = dsakit.ops.sparse_mla_prefill(q, kv, idx, ref.PEER_SM_SCALE, out=o2)
    assert r[0] is o2 and o2.data_ptr() == r[0].data_ptr() and torch.equal(o2, out)
    # the op through torch.ops gives the same bits
    t_out, t_mx, t_lse = torch.ops.dsakit.sparse_mla_prefill(q, kv, idx, ref.PEER_SM_SCALE)
    assert torch.equal(t_out, out) and torch.equal(t_lse, lse) and torch.equal(t_mx, mx)
    # an input that requires grad is read as is (detached)
    qg = q.float().requires_grad_().bfloat16()
    assert torch.equal(dsakit.ops.sparse_mla_prefill(qg, kv, idx, ref.PEER_SM_SCALE)[0], out)


def test_fake_implementations_give_the_real_shapes(prefill):
    from torch._subclasses.fake_tensor import FakeTensorMode
    g = prefill
    real = torch.ops.dsakit.sparse_mla_prefill(tt(g["q"]), tt(g["kv"]), tt(g["indices"]), 0.1)
    with FakeTensorMode() as mode:
        fq, fkv, fidx = (mode.from_tensor(tt(g[k])) for k in ("q", "kv", "indices"))
        fake = torch.ops.dsakit.sparse_mla_prefill(fq, fkv, fidx, 0.1)
        fd = torch.ops.dsakit.dense_mha_prefill(torch.empty(5, 2, 192), torch.empty(7, 2, 192),
                                                torch.empty(7, 2, 128),
                                                torch.empty(2, dtype=torch.int32),
                                                torch.empty(2, dtype=torch.int32), 0.1)
        fq8 = torch.ops.dsakit.quantize_kv_fp8(torch.empty(3, 4, 576, dtype=torch.bfloat16))
    for f, r in zip(fake, real):
        assert f.shape == r.shape and f.dtype == r.dtype and f.stride() == r.stride()
    assert fd[0].shape == (5, 2, 128) and fd[1].shape == (2, 5)
    assert fq8.shape == (3, 4, 656) and fq8.dtype == torch.uint8


def test_torch_compile_fullgraph_over_dsakit_ops(prefill):
    g = prefill
    q, kv, idx = tt(g["q"]), tt(g["kv"]), tt(g["indices"])

    def f(q, kv, idx):
        out, mx, lse = torch.ops.dsakit.sparse_mla_prefill(q, kv, idx, 0.1352)
        sel = torch.ops.dsakit.topk(lse, 8, None)
        return out.float().sum(dim=-1) * 2.0, sel

    want = f(q, kv, idx)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, kv, idx)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fp8_tensors_and_quantizer_with_torch():
    g, _ = ref.peer("fp8_656_pow2.safetensors")
    packed = dsakit.ops.quantize_kv_fp8(tt(g["input"]).view(8, 64, 1, 576))
    assert packed.dtype == torch.uint8 and packed.shape == (8, 64, 1, 656)
    assert np.array_equal(tn(packed).reshape(512, 656), g["packed"])
    back = dsakit.ops.dequantize_kv_fp8(packed.view(torch.float8_e4m3fn))  # FlashMLA's dtype
    assert np.array_equal(tn(back).reshape(512, 576).view(np.uint16),
                          g["dequantized"].view(np.uint16))
    ig, _ = ref.peer("indexer_logits.safetensors")
    q8 = tt(ig["q_fp8"]).view(torch.float8_e4m3fn)
    k8 = tt(ig["k_fp8"]).view(torch.float8_e4m3fn)
    logits = dsakit.ops.fp8_mqa_logits(q8, (k8, tt(ig["k_scale"])), tt(ig["weights"]),
                                       tt(ig["ks"]), tt(ig["ke"]))
    _, mask = ref.indexer_logits(ig["q_fp8"], ig["k_fp8"], ig["k_scale"], ig["weights"],
                                 ig["ks"], ig["ke"])
    assert ref.rel_l2(tn(logits)[mask], ig["logits"][mask]) <= ref.TOL_INDEXER_REL
    assert bool(torch.all(logits[torch.from_numpy(~mask)] == float("-inf")))


def test_layer_with_torch_tensors_writes_given_outputs(rng):
    s = Small(rng)
    x = dsakit.LayerInputs(*(tt(a) for a in s.inputs(90)))
    batch = dsakit.Batch([0], [90], [list(range(6))])
    res = s.layer.forward(batch, x)
    assert isinstance(res.o, torch.Tensor) and isinstance(res.topk, torch.Tensor)
    o = torch.empty_like(res.o)
    lse = torch.empty_like(res.lse)
    res2 = s.layer.forward(batch, x, o=o, lse=lse)
    assert res2.o.data_ptr() == o.data_ptr() and torch.equal(o, res.o) and torch.equal(lse, res.lse)
    # the kv pool over a torch tensor: the layer writes the tensor's memory (pow2 scales, as
    # Small's pool: wrap's default, amax, would quantize differently)
    cfg = s.cfg
    storage = torch.zeros(6 * 16, 656, dtype=torch.uint8)
    kv = dsakit.KvPool.wrap(storage, "fp8", 16, scale_policy="pow2")
    ix = dsakit.IndexPool(16, 6, d_i=cfg.index_head_dim)
    layer = dsakit.DsaAttention(cfg, kv, ix, tt(s.w))
    assert kv.storage is storage
    r3 = layer.forward(batch, x)
    assert storage.any() and torch.equal(r3.o, res.o)
