"""Hostile inputs from Python (docs/reliability.md, docs/python.md#errors): a wrong dtype, shape,
stride or device, a non-array, a read-only output, a 0-size tensor or a freed pool gives a Python
exception carrying the library's message and naming the argument — never a crash — and a
rejected layer call leaves both pools byte-identical."""
import numpy as np
import pytest

import dsakit
import pydsakit_ref as ref
from pydsakit_ref import BF16, F32
from test_py_layer import Small


@pytest.fixture
def small(rng):
    s = Small(rng)
    # something in the pools first
    s.layer.forward(dsakit.Batch([0], [40], [[0, 1, 2]]), s.inputs(40))
    return s


def _batch():
    return dsakit.Batch([40], [20], [[0, 1, 2, 3]])


BAD_INPUTS = [  # (what, mutate inputs dict, exception, message fragment)
    ("dtype", lambda x: x.update(q_nope=x["q_nope"].astype(F32)), ValueError,
     "q_nope: expected dtype bf16, got f32"),
    ("unsupported element type", lambda x: x.update(idx_w=x["idx_w"].astype(np.float16)),
     ValueError, "idx_w: element type float16"),
    ("shape", lambda x: x.update(c_kv=x["c_kv"][:, :256].copy()), ValueError,
     "c_kv: expected shape [20, 512], got [20, 256]"),
    ("tokens", lambda x: x.update(k_pe=x["k_pe"][:19].copy()), ValueError,
     "k_pe: expected shape [20, 64], got [19, 64]"),
    ("stride", lambda x: x.update(q_pe=np.repeat(x["q_pe"], 2, axis=2)[:, :, ::2]), ValueError,
     "q_pe: expected a contiguous tensor"),
    ("rank", lambda x: x.update(idx_k=x["idx_k"].reshape(20, 2, 4, 4, 4)), ValueError,
     "idx_k: expected a tensor of 1 to 4 dims, got 5"),
    ("scalar", lambda x: x.update(idx_k=np.float32(1.0)), ValueError, "idx_k: expected a tensor"),
    ("not an array", lambda x: x.update(idx_q=[[1.0]]), TypeError, "idx_q: expected a tensor"),
    ("none", lambda x: x.update(q_nope=None), TypeError, "q_nope: expected a tensor, got None"),
]


@pytest.mark.parametrize("what,mutate,exc,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_layer_inputs_raise_and_leave_the_pools_untouched(small, what, mutate, exc, message):
    x = small.inputs(20)._asdict()
    mutate(x)
    before = small.pools()
    with pytest.raises(exc) as e:
        small.layer.forward(_batch(), x)
    assert message in str(e.value)
    if isinstance(e.value, dsakit.Error):
        assert isinstance(e.value, dsakit.InvalidArgumentError)
    assert small.pools() == before


def test_bad_batches_and_outputs_raise_and_leave_the_pools_untouched(small):
    x = small.inputs(20)
    before = small.pools()
    cases = [
        (lambda: small.layer.forward(dsakit.Batch([40], [20], [[0, 1, 2, 99]]), x), ValueError,
         "page_table[3]: expected a page id in [0, 24), got 99"),
        (lambda: small.layer.forward(dsakit.Batch([40], [20], [[0, 1]]), x), ValueError,
         "needs 4 pages"),
        (lambda: small.layer.forward(dsakit.Batch([40], [20], [[0, 1, 2, 3]], mode="decode"), x),
         ValueError, "decode"),
        (lambda: small.layer.forward(_batch(), x, o=np.empty((20, 16, 128), F32)), ValueError,
         "o: expected dtype bf16, got f32"),
        (lambda: small.layer.forward(_batch(), x, lse=np.empty((21, 16), F32)), ValueError,
         "lse: expected shape [20, 16], got [21, 16]"),
        (lambda: small.layer.forward(_batch(), x, topk=np.empty((20, 64), np.int32)[:, ::-1]),
         ValueError, "topk"),
        (lambda: small.layer.forward(_batch(), x, lse=np.frombuffer(bytes(20 * 16 * 4), F32)
                                     .reshape(20, 16)), TypeError, "lse: expected a writable"),
        (lambda: small.layer.forward("batch", x), TypeError, "batch: expected a dsakit.Batch"),
        (lambda: small.layer.forward(_batch(), x[:6]), TypeError, "inputs"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc) as e:
            call()
        assert message in str(e.value), (message, str(e.value))
        assert small.pools() == before, message
    small.layer.forward(_batch(), x)  # and a good call still works afterwards
    assert small.pools() != before


def test_batch_construction_errors():
    with pytest.raises(ValueError, match="forward mode"):
        dsakit.Batch([0], [1], [[0]], mode="prefill")
    with pytest.raises(ValueError, match="extend_lens: 2 values for 1 requests"):
        dsakit.Batch([0], [1, 2], [[0]])
    with pytest.raises(ValueError, match="page_tables: element type int64"):
        dsakit.Batch([0], [1], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="needs 2 pages for 100 positions"):
        dsakit.Batch([0], [100], np.zeros((1, 1), np.int32), page_size=64)
    with pytest.raises(TypeError, match="prefix_lens"):
        dsakit.Batch("abc", [1], [[0]])


def test_freed_pools_refuse_every_use(rng):
    s = Small(rng)
    view = s.kv.storage  # a view taken before free() stays valid (it owns a reference)
    s.kv.free()
    assert s.kv.freed and view.sum() == 0
    for call in (lambda: s.layer.forward(_batch(), s.inputs(20)), lambda: s.layer.plan(_batch()),
                 lambda: s.kv.storage, lambda: s.kv.layout, lambda: s.layer.prepare(_batch()),
                 lambda: dsakit.DsaAttention(s.cfg, s.kv, s.ix, s.w)):
        with pytest.raises(ValueError, match="the kv pool was freed"):
            call()
    s.ix.free()
    with pytest.raises(ValueError, match="the index pool was freed"):
        s.ix.storage
    s.kv.free()  # twice is fine


def test_wrapped_pool_storage_is_checked_and_read_in_place(rng):
    good = np.zeros((64, 656), np.uint8)
    kv = dsakit.KvPool.wrap(good, "fp8", 16)
    assert kv.num_pages == 4 and kv.storage is good and kv.wrapped
    with pytest.raises(dsakit.LayoutMismatchError, match="576 B are the fp8-raw layout"):
        dsakit.KvPool.wrap(np.zeros((64, 576), np.uint8), "fp8", 16)
    with pytest.raises(ValueError, match="not a whole number of pages"):
        dsakit.KvPool.wrap(np.zeros((60, 656), np.uint8), "fp8", 16)
    with pytest.raises(ValueError, match="storage: expected a contiguous tensor"):
        dsakit.KvPool.wrap(np.zeros((64, 1312), np.uint8)[:, ::2], "fp8", 16)
    with pytest.raises(TypeError, match="storage: expected a writable"):
        dsakit.KvPool.wrap(np.frombuffer(bytes(64 * 656), np.uint8).reshape(64, 656), "fp8", 16)
    ix = dsakit.IndexPool.wrap(np.zeros((4, 16 * 132), np.uint8), 16)
    assert ix.num_pages == 4
    with pytest.raises(ValueError, match="index pool d_i"):
        dsakit.IndexPool.wrap(np.zeros((4, 16 * 132), np.uint8), 16, d_i=100)


def test_bad_op_arguments_raise_naming_them(rng):
    q = np.zeros((4, 16, 576), BF16)
    kv = np.zeros((10, 1, 576), BF16)
    idx = np.zeros((4, 1, 8), np.int32)
    cases = [
        (lambda: dsakit.ops.sparse_mla_prefill(q[:, :, :512], kv, idx, 0.1), ValueError,
         "q: expected shape [*, *, 576]"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, np.zeros((10, 2, 576), BF16), idx, 0.1),
         ValueError, "kv: expected shape [*, 1, 576]"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, kv, idx.astype(np.int64), 0.1), ValueError,
         "indices: element type int64"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, kv[:0], idx, 0.1), ValueError,
         "kv: expected at least one token row"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, kv, idx, 0.1, d_v=256), ValueError, "d_v"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, kv, idx, -1.0), ValueError, "sm_scale"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, kv, idx, 0.1, topk_length=np.zeros(3, np.int32)),
         ValueError, "topk_length: expected shape [4]"),
        (lambda: dsakit.ops.sparse_mla_prefill(q, kv, idx, 0.1, out=np.zeros((4, 16, 512), F32)
                                               [:, :, ::1][:, ::2]), ValueError, "out"),
        (lambda: dsakit.ops.sparse_mla_prefill("q", kv, idx, 0.1), TypeError, "q: expected a tensor"),
        (lambda: dsakit.ops.quantize_kv_fp8(np.zeros((3, 576), F32)), ValueError,
         "kv: expected dtype bf16"),
        (lambda: dsakit.ops.quantize_kv_fp8(np.zeros((3, 576), BF16), "v99"), ValueError, "layout"),
        (lambda: dsakit.ops.dequantize_kv_fp8(np.zeros((3, 576), np.uint8)), ValueError,
         "packed: expected a last dim of 656"),
        (lambda: dsakit.ops.dequantize_kv_fp8(np.zeros((3, 656), np.uint8),
                                              out=np.zeros((3, 576), np.uint8)), ValueError,
         "out: expected dtype bf16 or f32"),
        (lambda: dsakit.ops.dequantize_kv_fp8(np.zeros((3, 656), np.uint8),
                                              out=np.zeros((3, 1152), F32)[:, ::2]), ValueError,
         "out"),
        (lambda: dsakit.ops.fp8_mqa_logits(np.zeros((4, 2, 64), np.uint8), np.zeros((5, 32), np.uint8),
                                           np.ones(5, F32), np.ones((4, 2), F32),
                                           np.zeros(4, np.int32), np.full(4, 5, np.int32)),
         ValueError, "kv: expected shape [*, 64]"),
        (lambda: dsakit.ops.fp8_mqa_logits(np.zeros((4, 2, 64), np.uint8), np.zeros((5, 64), np.uint8),
                                           np.ones(5, F32), np.ones((4, 2), F32),
                                           np.zeros(4, np.int32), np.full(4, 6, np.int32)),
         ValueError, "ctx_len"),
        (lambda: dsakit.ops.topk(np.zeros((2, 5), F32), 0), ValueError, "k: expected >= 1"),
        (lambda: dsakit.ops.topk(np.zeros((2, 5), F32), 2, np.array([9, 1], np.int32)), ValueError,
         "ctx_len[0]"),
        (lambda: dsakit.ops.dense_mha_prefill(np.zeros((3, 2, 192), F32), np.zeros((3, 1, 192), F32),
                                              np.zeros((3, 2, 128), F32), np.array([0, 3], np.int32),
                                              np.array([0, 3], np.int32), 0.1), ValueError,
         "k: expected shape [*, 2, 192]"),
        (lambda: dsakit.ops.dense_mha_prefill(np.zeros((3, 2, 192), F32), np.zeros((2, 2, 192), F32),
                                              np.zeros((2, 2, 128), F32), np.array([0, 3], np.int32),
                                              np.array([0, 2], np.int32), 0.1), ValueError,
         "extend (3) <= kv length (2)"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc) as e:
            call()
        assert message in str(e.value), (message, str(e.value))


def test_zero_size_tensors_work_or_raise_cleanly(small):
    q0 = np.zeros((0, 16, 576), BF16)
    out, mx, lse = dsakit.ops.sparse_mla_prefill(q0, np.zeros((3, 1, 576), BF16),
                                                 np.zeros((0, 1, 4), np.int32), 0.1)
    assert out.shape == (0, 16, 512) and lse.shape == (0, 16)
    assert dsakit.ops.quantize_kv_fp8(np.zeros((0, 576), BF16)).shape == (0, 656)
    assert dsakit.ops.dequantize_kv_fp8(np.zeros((0, 656), np.uint8)).shape == (0, 576)
    assert dsakit.ops.topk(np.zeros((0, 5), F32), 3).shape == (0, 3)
    logits = dsakit.ops.fp8_mqa_logits(np.zeros((2, 1, 64), np.uint8), np.zeros((0, 64), np.uint8),
                                       np.zeros(0, F32), np.ones((2, 1), F32),
                                       np.zeros(2, np.int32), np.zeros(2, np.int32))
    assert logits.shape == (2, 0)
    top = dsakit.ops.fp8_mqa_topk(np.zeros((2, 1, 64), np.uint8), np.zeros((0, 64), np.uint8),
                                  np.zeros(0, F32), np.ones((2, 1), F32), np.zeros(2, np.int32),
                                  np.zeros(2, np.int32), 3)
    assert top.tolist() == [[-1] * 3] * 2  # no keys: all padding
    assert dsakit.ops.fp8_mqa_topk(np.zeros((0, 1, 64), np.uint8), np.zeros((4, 64), np.uint8),
                                   np.ones(4, F32), np.ones((0, 1), F32), np.zeros(0, np.int32),
                                   np.zeros(0, np.int32), 3).shape == (0, 3)
    before = small.pools()
    res = small.layer.forward(dsakit.Batch([40], [0], [[0, 1, 2]]), small.inputs(0))
    assert res.o.shape == (0, 16, 128) and small.pools() == before
    with pytest.raises(ValueError, match="q_nope: expected shape"):
        small.layer.forward(_batch(), small.inputs(0))
    assert small.pools() == before
