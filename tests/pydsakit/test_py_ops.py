"""dsakit.ops on the CPU with NumPy arrays (and a bare DLPack producer): every op against the
peers' golden files (tests/data/peers, the tolerances of tests/reference/test_peers.cc) and
against an independent float64 reference (pydsakit_ref)."""
import re

import numpy as np
import pytest

import dsakit
import pydsakit_ref as ref
from pydsakit_ref import BF16, F32


class Producer:
    """A DLPack producer that is neither NumPy nor torch (only __dlpack__/__dlpack_device__)."""

    def __init__(self, a):
        self.a = a
        self.shape = a.shape

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def bf16(x):
    return np.asarray(x, dtype=F32).astype(BF16)


# ---- FlashMLA sparse prefill ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def prefill():
    g, meta = ref.peer("sparse_prefill.safetensors")
    g.update(ref.peer("sparse_prefill_out.safetensors")[0])
    g.update(ref.peer("sparse_prefill_topk_length.safetensors")[0])
    g["sm_scale"] = float(meta.get("sm_scale", ref.PEER_SM_SCALE))
    return g


def _empty_query(out, lse, max_logits, t):
    assert np.all(np.asarray(out[t], dtype=F32) == 0), f"query {t}: out is not 0"
    assert np.all(lse[t] == np.inf), f"query {t}: lse is not +inf"
    if max_logits is not None:
        assert np.all(max_logits[t] == -np.inf), f"query {t}: max_logits is not -inf"


@pytest.mark.parametrize("with_length", [False, True])
def test_sparse_mla_prefill_matches_flashmla_and_reference(prefill, with_length):
    g = prefill
    tl = g["topk_length"] if with_length else None
    out, max_logits, lse = dsakit.ops.sparse_mla_prefill(g["q"], g["kv"], g["indices"],
                                                         g["sm_scale"], topk_length=tl)
    assert out.dtype == BF16 and out.shape == (32, 64, 512)
    assert lse.dtype == F32 and lse.shape == (32, 64) and max_logits.shape == (32, 64)
    sfx = "_tl" if with_length else ""
    assert ref.rel_l2(out, g["out" + sfx]) <= ref.TOL_BF16
    assert ref.max_abs_diff(lse, g["lse" + sfx]) <= ref.TOL_LSE  # +inf exactly where FlashMLA's
    assert ref.max_abs_diff(max_logits, g["max_logits" + sfx]) <= ref.TOL_LSE
    o_ref, lse_ref, max_ref = ref.sparse_attention(g["q"], g["kv"][:, 0], g["indices"][:, 0],
                                                   g["sm_scale"], tl)
    assert ref.rel_l2(out, o_ref) <= ref.TOL_BF16
    assert ref.max_abs_diff(lse, lse_ref) <= ref.TOL_LSE
    assert ref.max_abs_diff(max_logits, max_ref) <= ref.TOL_LSE
    _empty_query(out, lse, max_logits, 5)  # no valid slot: -1, 700, 2147483647
    if with_length:
        _empty_query(out, lse, max_logits, 1)  # topk_length 0


def test_sparse_mla_prefill_random_against_reference(rng):
    s_q, h_q, s_kv, k = 7, 16, 90, 40
    q = bf16(rng.standard_normal((s_q, h_q, 576)))
    kv = bf16(rng.standard_normal((s_kv, 1, 576)) * 0.5)
    idx = rng.integers(-3, s_kv + 5, (s_q, 1, k)).astype(np.int32)
    idx[2, 0, :] = -1                       # a query with no valid slot
    idx[3, 0, 1] = idx[3, 0, 0] = 11        # a duplicate counts twice
    tl = rng.integers(0, k + 1, s_q).astype(np.int32)
    for lengths in (None, tl):
        out, mx, lse = dsakit.ops.sparse_mla_prefill(q, kv, idx, 0.07, topk_length=lengths)
        o_ref, lse_ref, mx_ref = ref.sparse_attention(q, kv[:, 0], idx[:, 0], 0.07, lengths)
        assert ref.rel_l2(out, o_ref) <= ref.TOL_BF16
        assert ref.max_abs_diff(lse, lse_ref) <= ref.TOL_LSE
        assert ref.max_abs_diff(mx, mx_ref) <= ref.TOL_LSE
        _empty_query(out, lse, mx, 2)


def test_sparse_mla_prefill_writes_given_outputs_in_place(prefill):
    g = prefill
    out = np.full((32, 64, 512), np.nan, dtype=BF16)
    lse = np.full((32, 64), np.nan, dtype=F32)
    mx = np.full((32, 64), np.nan, dtype=F32)
    r = dsakit.ops.sparse_mla_prefill(g["q"], g["kv"], g["indices"], g["sm_scale"], out=out,
                                      max_logits=mx, lse=lse)
    assert r[0] is out and r[1] is mx and r[2] is lse
    assert ref.rel_l2(out, g["out"]) <= ref.TOL_BF16


# ---- FlashMLA sparse decode over the FP8 cache ----------------------------------------------------

def test_sparse_mla_decode_matches_flashmla_and_reference():
    g, meta = ref.peer("sparse_decode_fp8.safetensors")
    scale = float(meta.get("sm_scale", ref.PEER_SM_SCALE))
    kcache = g["kcache"].reshape(68, 64, 1, 656)  # FlashMLA's [blocks, 64, 1, 656]
    out, lse = dsakit.ops.sparse_mla_decode(g["q"], kcache, g["indices"], scale)
    assert out.shape == (4, 1, 64, 512) and lse.shape == (4, 64, 1)  # FlashMLA's [b, h_q, s_q]
    lse_rows = lse.transpose(0, 2, 1)
    assert ref.rel_l2(out, g["out"]) <= ref.TOL_BF16
    assert ref.max_abs_diff(lse_rows, g["lse"]) <= ref.TOL_LSE
    pool = ref.dequantize_656(g["kcache"].reshape(-1, 656)).astype(np.float64)
    o_ref, lse_ref, _ = ref.sparse_attention(g["q"][:, 0], pool, g["indices"][:, 0], scale)
    assert ref.rel_l2(out[:, 0], o_ref) <= ref.TOL_BF16
    assert ref.max_abs_diff(lse_rows[:, 0], lse_ref) <= ref.TOL_LSE


# ---- FlashMLA's FP8 cache quantizer ---------------------------------------------------------------

def test_quantize_and_dequantize_match_flashmla_byte_for_byte():
    g, _ = ref.peer("fp8_656_pow2.safetensors")
    tokens = g["input"].reshape(8, 64, 1, 576)  # FlashMLA's quantize_k_cache input
    packed = dsakit.ops.quantize_kv_fp8(tokens, "v32_656", scales="pow2")
    assert packed.dtype == np.uint8 and packed.shape == (8, 64, 1, 656)
    assert np.array_equal(packed.reshape(512, 656), g["packed"])
    back = dsakit.ops.dequantize_kv_fp8(g["packed"])
    assert back.dtype == BF16 and back.shape == (512, 576)
    assert np.array_equal(back.view(np.uint16), g["dequantized"].view(np.uint16))


def test_quantize_from_a_row_strided_input():
    """kv may be a row-strided view (rows of a wider array): the bytes are FlashMLA's."""
    g, _ = ref.peer("fp8_656_pow2.safetensors")
    wide = np.full((512, 600), np.nan, BF16)
    wide[:, 8:584] = g["input"].reshape(512, 576)
    packed = dsakit.ops.quantize_kv_fp8(wide[:, 8:584], "v32_656", scales="pow2")
    assert np.array_equal(packed, g["packed"])


def test_dequantize_into_a_row_strided_out():
    """out may be a row-strided view (rows of a wider array): the values land in its 576 columns,
    bit for bit as FlashMLA dequantizes, and the columns beside them stay untouched."""
    g, _ = ref.peer("fp8_656_pow2.safetensors")
    wide = np.full((512, 600), np.nan, BF16)
    back = dsakit.ops.dequantize_kv_fp8(g["packed"], out=wide[:, 16:592])
    assert back.shape == (512, 576)
    assert np.array_equal(wide[:, 16:592].view(np.uint16), g["dequantized"].view(np.uint16))
    assert np.isnan(wide[:, :16].astype(F32)).all() and np.isnan(wide[:, 592:].astype(F32)).all()


@pytest.mark.parametrize("layout,scales", [("v32_656", "amax"), ("v32_656", "pow2"),
                                           ("raw_576", "amax")])
def test_quantize_random_against_reference(rng, layout, scales):
    n = 37
    # per-token magnitudes 2^-12 … 2^6 for the tile scales; one k_scale (raw) covers unit values
    mag = 1.0 if layout == "raw_576" else np.exp2(rng.uniform(-12, 6, (n, 1)))
    tokens = bf16(rng.standard_normal((n, 576)) * mag)
    tokens[3] = 0  # an all-zero token
    k_scale = 0.25 if layout == "raw_576" else 1.0
    packed = dsakit.ops.quantize_kv_fp8(tokens, layout, scales, k_scale)
    want = ref.quantize_576(tokens, k_scale) if layout == "raw_576" else ref.quantize_656(tokens, scales)
    assert np.array_equal(packed, want)
    back = dsakit.ops.dequantize_kv_fp8(packed, layout, k_scale, dtype="f32")
    if layout == "raw_576":
        expect = ref.e4m3_values(packed) * k_scale
    else:
        expect = ref.dequantize_656(packed).astype(np.float64)
        # f32 output: the latent part is fp32(code) * scale unrounded
        codes = ref.e4m3_values(packed[:, :512]).reshape(n, 4, 128)
        sc = np.ascontiguousarray(packed[:, 512:528]).view("<f4").reshape(n, 4, 1)
        expect[:, :512] = (codes * sc).reshape(n, 512)
    assert back.dtype == F32
    assert np.array_equal(back, expect.astype(F32))
    assert ref.rel_l2(back, tokens) <= ref.TOL_FP8_POOL


# ---- DeepGEMM fp8_mqa_logits ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def indexer():
    return ref.peer("indexer_logits.safetensors")[0]


def _check_logits(got, want, mask):
    valid_got, valid_want = got[mask], want[mask]
    assert ref.rel_l2(valid_got, valid_want) <= ref.TOL_INDEXER_REL
    assert np.abs(valid_got.astype(np.float64) - valid_want).max() <= \
        ref.TOL_INDEXER_ABS_OF_MAX * np.abs(valid_want).max()
    assert np.all(got[~mask] == -np.inf)


def test_fp8_mqa_logits_matches_deepgemm_and_reference(indexer):
    g = indexer
    want, mask = ref.indexer_logits(g["q_fp8"], g["k_fp8"], g["k_scale"], g["weights"], g["ks"],
                                    g["ke"])
    # DeepGEMM's form: kv as (k_fp8, k_scale)
    got = dsakit.ops.fp8_mqa_logits(g["q_fp8"], (g["k_fp8"], g["k_scale"]), g["weights"], g["ks"],
                                    g["ke"])
    assert got.dtype == F32 and got.shape == (256, 256)
    _check_logits(got, g["logits"], mask)
    _check_logits(got, want, mask)
    # the flat form, and kv_scales right after kv in one buffer (read in place, no copy)
    page = np.empty(256 * 128 + 256 * 4, dtype=np.uint8)
    page[:256 * 128] = g["k_fp8"].ravel()
    page[256 * 128:] = g["k_scale"].view(np.uint8)
    kv, scales = page[:256 * 128].reshape(256, 128), page[256 * 128:].view(F32)
    got2 = dsakit.ops.fp8_mqa_logits(g["q_fp8"], kv, scales, g["weights"], g["ks"], g["ke"])
    assert np.array_equal(got2, got)


def test_fp8_mqa_logits_key_ranges_against_reference(rng):
    s_q, s_kv, h, d = 20, 70, 8, 64
    q8 = ref.e4m3_bytes(rng.standard_normal((s_q, h, d)))
    k8 = ref.e4m3_bytes(rng.standard_normal((s_kv, d)))
    scales = rng.uniform(0.01, 1.0, s_kv).astype(F32)
    w = rng.standard_normal((s_q, h)).astype(F32)
    ks = rng.integers(0, 40, s_q).astype(np.int32)
    ke = np.minimum(ks + rng.integers(0, 40, s_q), s_kv).astype(np.int32)
    ks[0], ke[0] = 5, 5  # an empty range
    got = dsakit.ops.fp8_mqa_logits(q8, k8, scales, w, ks, ke)
    want, mask = ref.indexer_logits(q8, k8, scales, w, ks, ke)
    assert np.all(got[0] == -np.inf)
    assert ref.rel_l2(got[mask], want[mask]) <= ref.TOL_F32 * 10
    assert np.all(got[~mask] == -np.inf)


def test_fp8_mqa_topk_against_logits_and_reference(rng, monkeypatch):
    """The fused indexer's top-k: the same positions as topk over fp8_mqa_logits' columns
    [ks, ke) (its kernels, one block of rows or one row per block), and against the float64
    logits no unselected key scoring above a selected one; identity and empty rows; bad ranges
    refused before anything is written."""
    s_q, s_kv, h, d, k = 24, 90, 8, 64, 6
    q8 = ref.e4m3_bytes(rng.standard_normal((s_q, h, d)))
    k8 = ref.e4m3_bytes(rng.standard_normal((s_kv, d)))
    scales = rng.uniform(0.01, 1.0, s_kv).astype(F32)
    w = rng.standard_normal((s_q, h)).astype(F32)
    ks = rng.integers(0, 50, s_q).astype(np.int32)
    ke = np.minimum(ks + rng.integers(k + 1, 40, s_q), s_kv).astype(np.int32)
    ks[0], ke[0] = 5, 5      # an empty range
    ks[1], ke[1] = 10, 13    # fewer keys than k: the identity
    ks[2], ke[2] = 0, s_kv   # every key
    logits = dsakit.ops.fp8_mqa_logits(q8, k8, scales, w, ks, ke)
    lengths = (ke - ks).astype(np.int32)
    local = np.full((s_q, s_kv), -np.inf, F32)
    for i in range(s_q):
        local[i, :lengths[i]] = logits[i, ks[i]:ke[i]]
    want = dsakit.ops.topk(local, k, lengths)
    for limit in (None, "1"):
        if limit:
            monkeypatch.setenv("DSAKIT_INDEXER_WORKSPACE_BYTES", limit)
        got = dsakit.ops.fp8_mqa_topk(q8, (k8, scales), w, ks, ke, k)
        assert got.dtype == np.int32 and got.shape == (s_q, k)
        assert np.array_equal(got, want), limit
    assert got[0].tolist() == [-1] * k and got[1].tolist() == [0, 1, 2, -1, -1, -1]
    ref_logits, _ = ref.indexer_logits(q8, k8, scales, w, ks, ke)
    for i in range(3, s_q):
        row = ref_logits[i, ks[i]:ke[i]]
        chosen = np.zeros(lengths[i], bool)
        chosen[got[i]] = True
        assert np.all(np.diff(got[i]) > 0)
        assert row[chosen].min() >= row[~chosen].max() - 1e-4 * np.abs(row).max(), i

    out = np.full((s_q, k), 7, np.int32)
    bad = [((q8, k8, scales, w, ke, ks, k), "ks[1], ke[1]"),
           ((q8, k8, scales, w, ks, np.full(s_q, s_kv + 1, np.int32), k), "ke <= 90"),
           ((q8, k8, scales, w, ks, ke, 0), "k: expected >= 1"),
           ((q8, k8, scales, w[:, :4], ks, ke, k), "weights")]
    for args, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            dsakit.ops.fp8_mqa_topk(*args, out=out)
        assert np.all(out == 7)
    with pytest.raises(ValueError, match="ks: expected shape"):
        dsakit.ops.fp8_mqa_topk(q8, k8, scales, w, ks[:5], ke, k, out=out)
    assert np.all(out == 7)


def test_ops_take_a_bare_dlpack_producer(indexer):
    g = indexer
    got = dsakit.ops.fp8_mqa_logits(*(Producer(x) for x in (g["q_fp8"], g["k_fp8"], g["k_scale"],
                                                             g["weights"], g["ks"], g["ke"])))
    assert isinstance(got, np.ndarray)  # CPU outputs of other producers come back as NumPy
    _, mask = ref.indexer_logits(g["q_fp8"], g["k_fp8"], g["k_scale"], g["weights"], g["ks"],
                                 g["ke"])
    _check_logits(got, g["logits"], mask)
    logits = np.arange(24, dtype=F32).reshape(2, 12)
    top = dsakit.ops.topk(Producer(logits), 3, Producer(np.array([12, 2], np.int32)))
    assert top.tolist() == [[9, 10, 11], [0, 1, -1]]
    # dsakit's own arrays are DLPack producers too (zero-copy into NumPy / torch)
    arr = dsakit._dsakit.empty("f32", [2, 3], "cpu")
    assert arr.shape == (2, 3) and arr.dtype == "f32" and arr.__dlpack_device__() == (1, 0)
    assert np.from_dlpack(arr).shape == (2, 3) and np.from_dlpack(arr).shape == (2, 3)


# ---- top-k ----------------------------------------------------------------------------------------

def test_topk_against_reference(rng):
    rows, width, k = 12, 300, 16
    x = rng.standard_normal((rows, width)).astype(F32)
    x[1, :] = 0.5                                  # all tied: the lowest columns win
    x[2, ::7] = np.nan                             # NaN below everything
    x[3, :] = -np.inf
    x[3, 100:104] = np.nan
    x[4, 10] = -0.0
    x[4, 11] = 0.0
    lengths = rng.integers(k + 1, width + 1, rows).astype(np.int32)
    lengths[5], lengths[6], lengths[7] = k, 3, 0   # identity rows
    got = dsakit.ops.topk(x, k, lengths)
    assert got.dtype == np.int32 and got.shape == (rows, k)
    assert np.array_equal(got, ref.topk(x, k, lengths))
    assert np.array_equal(dsakit.ops.topk(x, k), ref.topk(x, k, np.full(rows, width)))


# ---- FlashAttention varlen ------------------------------------------------------------------------

def _mla_kv(rng, n, h, d_nope, d_rope, d_v, dtype):
    k_nope = rng.standard_normal((n, h, d_nope))
    k_pe = rng.standard_normal((n, 1, d_rope))
    k = np.concatenate([k_nope, np.broadcast_to(k_pe, (n, h, d_rope))], axis=2).astype(dtype)
    v = rng.standard_normal((n, h, d_v)).astype(dtype)
    return k, v


@pytest.mark.parametrize("dtype,tol", [(F32, ref.TOL_F32), (BF16, ref.TOL_BF16)])
def test_dense_mha_prefill_against_reference(rng, dtype, tol):
    h, d_nope, d_rope, d_v = 4, 128, 64, 128
    q_lens, k_lens = [5, 17, 1], [5, 40, 9]      # a fresh prompt, two extends over prefixes
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], h, d_nope + d_rope)).astype(dtype)
    k, v = _mla_kv(rng, int(cu_k[-1]), h, d_nope, d_rope, d_v, dtype)
    scale = (d_nope + d_rope) ** -0.5
    for causal in (True, False):
        out, lse = dsakit.ops.dense_mha_prefill(q, k, v, cu_q, cu_k, scale, causal=causal)
        assert out.shape == (cu_q[-1], h, d_v) and lse.shape == (h, cu_q[-1])  # FA's softmax_lse
        o_ref, lse_ref = ref.dense_mha(q, k, v, cu_q, cu_k, scale, causal)
        assert ref.rel_l2(out, o_ref) <= tol
        assert ref.max_abs_diff(lse.T, lse_ref) <= ref.TOL_LSE


def test_dense_mha_prefill_under_a_topk_mask(rng):
    """kv_mask: the top-k of random scores per query (fewer keys than it sees) built by
    topk_to_kv_mask is dense attention over those keys alone (float64 reference with the mask),
    a query keeping nothing gets out 0 / lse +inf, and a position past the mask's width is
    refused by name before anything is written."""
    h, d_nope, d_rope, d_v, k = 4, 128, 64, 128, 6
    q_lens, k_lens = [9, 20], [9, 70]            # a fresh prompt and an extend over a prefix
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    t = int(cu_q[-1])
    q = rng.standard_normal((t, h, d_nope + d_rope)).astype(F32)
    kk, v = _mla_kv(rng, int(cu_k[-1]), h, d_nope, d_rope, d_v, F32)
    lengths = np.concatenate([np.arange(1, 10), np.arange(51, 71)]).astype(np.int32)
    positions = dsakit.ops.topk(rng.standard_normal((t, 70)).astype(F32), k, lengths)
    positions[3] = -1                            # query 3 keeps nothing
    mask = dsakit.ops.topk_to_kv_mask(positions, 70)
    assert mask.dtype == np.int32 and mask.shape == (t, 3)
    bits = mask.view(np.uint32)
    for i in range(t):
        kept = {p for p in range(96) if (bits[i, p // 32] >> (p % 32)) & 1}
        assert kept == {int(p) for p in positions[i] if p >= 0}, i
    scale = (d_nope + d_rope) ** -0.5
    out, lse = dsakit.ops.dense_mha_prefill(q, kk, v, cu_q, cu_k, scale, kv_mask=mask)
    o_ref, lse_ref = ref.dense_mha(q, kk, v, cu_q, cu_k, scale, kv_mask=mask)
    assert ref.rel_l2(out, o_ref) <= ref.TOL_F32
    assert ref.max_abs_diff(lse.T, lse_ref) <= ref.TOL_LSE
    assert (out[3] == 0).all() and np.isinf(lse.T[3]).all()
    full, _ = dsakit.ops.dense_mha_prefill(q, kk, v, cu_q, cu_k, scale)
    assert ref.rel_l2(out, full) > 1e-2          # the mask changed the attention
    far = positions.copy()
    far[5, 2] = 96
    kept = np.full((t, 3), 7, np.int32)
    with pytest.raises(ValueError, match=re.escape("positions[5, 2]")):
        dsakit.ops.topk_to_kv_mask(far, 70, out=kept)
    assert (kept == 7).all()
    with pytest.raises(ValueError, match="kv_mask"):
        dsakit.ops.dense_mha_prefill(q, kk, v, cu_q, cu_k, scale, kv_mask=mask[:, :2])


def test_dense_mha_prefill_refuses_per_head_rope(rng):
    h = 2
    q = rng.standard_normal((3, h, 192)).astype(F32)
    k = rng.standard_normal((3, h, 192)).astype(F32)  # rope columns differ between heads
    v = rng.standard_normal((3, h, 128)).astype(F32)
    cu = np.array([0, 3], np.int32)
    with pytest.raises(ValueError, match="rope columns"):
        dsakit.ops.dense_mha_prefill(q, k, v, cu, cu, 0.1)
    out, _ = dsakit.ops.dense_mha_prefill(q, k, v, cu, cu, 0.1, check_rope=False)  # head 0's
    assert np.isfinite(out).all()
