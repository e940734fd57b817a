"""Kernel-level ops in the calling conventions of the kernels dsakit is compared with, so that a
comparison is a one-line import change (docs/python.md#ops):

* sparse_mla_prefill  FlashMLA flash_mla_sparse_fwd
* sparse_mla_decode   FlashMLA flash_mla_with_kvcache, sparse indices over a paged FP8 cache
* quantize_kv_fp8 / dequantize_kv_fp8   FlashMLA's V3.2 656-byte FP8 token (and the raw 576 B)
* fp8_mqa_logits      DeepGEMM fp8_mqa_logits (clean_logits: -inf outside [ks, ke))
* fp8_mqa_topk        its top-k per row without the [s_q, s_kv] logits (the fused indexer)
* topk                the indexer's top-k (ties to the lower position, NaN last, -1 padded)
* topk_to_kv_mask     top-k positions as dense_mha_prefill's kv_mask bits
* dense_mha_prefill   FlashAttention varlen (bottom-right causal; optionally under a kv_mask)

Arrays are PyTorch tensors (CPU or CUDA), NumPy arrays (CPU; bf16 as ml_dtypes.bfloat16) or any
DLPack array; outputs come back in the framework of the first array argument. Every op runs on
the caller's current CUDA stream (PyTorch's, or `stream=`) and checks its arguments before
writing anything; a bad argument raises dsakit.InvalidArgumentError (a ValueError) naming it.
With torch tensors and no out=/stream= arguments, a call made while torch.compile traces goes
through torch.ops.dsakit.* (registered by dsakit._torch_ops), which eager code may call directly.
"""
from __future__ import annotations

import sys

from . import _arrays as A
from . import _dsakit as _C

__all__ = ["sparse_mla_prefill", "sparse_mla_decode", "quantize_kv_fp8", "dequantize_kv_fp8",
           "fp8_mqa_logits", "fp8_mqa_topk", "topk", "topk_to_kv_mask", "dense_mha_prefill",
           "KV_LAYOUTS"]

# Layout names: FlashMLA's (v32_656, raw_576) and dsakit's (fp8, fp8-raw, bf16), with row bytes.
KV_LAYOUTS = {"v32_656": ("fp8", 656), "fp8": ("fp8", 656),
              "raw_576": ("fp8-raw", 576), "fp8-raw": ("fp8-raw", 576),
              "bf16": ("bf16", 1152)}


def _layout(name: str):
    try:
        return KV_LAYOUTS[name]
    except KeyError:
        raise ValueError(f"layout: expected one of {', '.join(KV_LAYOUTS)}, got {name!r}") from None


def _compiling() -> bool:
    t = sys.modules.get("torch")
    return t is not None and t.compiler.is_compiling()


def _torch_op(name):
    from . import _torch_ops
    _torch_ops.register()
    return getattr(sys.modules["torch"].ops.dsakit, name)


# ---- FlashMLA sparse prefill ---------------------------------------------------------------------

def sparse_mla_prefill(q, kv, indices, sm_scale, d_v=512, topk_length=None, *, out=None,
                       max_logits=None, lse=None, stream=None):
    """FlashMLA's flash_mla_sparse_fwd: q [s_q, h_q, 576] bf16, kv [s_kv, 1, 576] bf16, indices
    [s_q, 1, topk] int32 (-1 or >= s_kv: invalid, skipped) -> (out [s_q, h_q, 512] bf16,
    max_logits [s_q, h_q] f32, lse [s_q, h_q] f32, natural log). A query with no valid slot gets
    out 0, lse +inf and max_logits -inf. topk_length [s_q] int32: query i reads slots
    [0, topk_length[i]) only. Zero-copy: kv is read in place as a bf16 pool of page size 1, and
    q's [:512] and [512:] columns are views."""
    if A.is_torch(q) and out is None and max_logits is None and lse is None and stream is None \
            and _compiling():
        return _torch_op("sparse_mla_prefill")(q, kv, indices, float(sm_scale), int(d_v),
                                               topk_length)
    return _sparse_mla_prefill(q, kv, indices, sm_scale, d_v, topk_length, out, max_logits, lse,
                               stream)


def _sparse_mla_prefill(q, kv, indices, sm_scale, d_v, topk_length, out, max_logits, lse, stream):
    with A.on_stream(stream, q):
        return _sparse_mla_prefill_on_stream(q, kv, indices, sm_scale, d_v, topk_length, out,
                                             max_logits, lse, stream)


def _sparse_mla_prefill_on_stream(q, kv, indices, sm_scale, d_v, topk_length, out, max_logits, lse,
                                  stream):
    q, kv, indices, topk_length = map(A.plain, (q, kv, indices, topk_length))
    s = A.shape(q, "q")
    s_q, h_q = A.dim(s, 0), A.dim(s, 1)
    if out is None:
        out = A.empty(q, (s_q, h_q, d_v), "bf16")
    if max_logits is None:
        max_logits = A.empty(q, (s_q, h_q), "f32")
    if lse is None:
        lse = A.empty(q, (s_q, h_q), "f32")
    stream = A.stream_of(stream, q)
    q_, kv_, idx_, tl_, out_, mx_, lse_ = A.dl(q, kv, indices, topk_length,
                                              *A.plain_all((out, max_logits, lse)))
    _C.ops.sparse_mla_prefill(q_, kv_, idx_, float(sm_scale), int(d_v), tl_, out_, mx_, lse_,
                              stream)
    return out, max_logits, lse


# ---- FlashMLA sparse decode ----------------------------------------------------------------------

def sparse_mla_decode(q, k_cache, indices, sm_scale=None, d_v=512, topk_length=None, *, out=None,
                      lse=None, stream=None):
    """FlashMLA's flash_mla_with_kvcache with sparse `indices` over a paged cache: q [b, s_q, h_q,
    576] bf16; k_cache [num_blocks, page_size, 1, 656] FP8 tokens (uint8 or float8_e4m3fn; bf16
    [.., 576] rows also work) read in place; indices [b, s_q, topk] int32 pool slots
    (block_table[r][p // page_size] * page_size + p % page_size; -1 invalid) -> (out [b, s_q, h_q,
    512] bf16, lse [b, h_q, s_q] f32 — FlashMLA's layout, a transposed view of [b, s_q, h_q]; for
    arrays other than torch and NumPy the [b, s_q, h_q] array itself). sm_scale defaults to
    576 ** -0.5 as in FlashMLA."""
    if sm_scale is None:
        sm_scale = A.dim(A.shape(q, "q"), -1) ** -0.5 if A.dim(A.shape(q, "q"), -1) else 1.0
    if A.is_torch(q) and out is None and lse is None and stream is None and _compiling():
        return _torch_op("sparse_mla_decode")(q, k_cache, indices, float(sm_scale), int(d_v),
                                              topk_length)
    return _sparse_mla_decode(q, k_cache, indices, sm_scale, d_v, topk_length, out, lse, stream)


def _sparse_mla_decode(q, k_cache, indices, sm_scale, d_v, topk_length, out, lse, stream):
    with A.on_stream(stream, q):
        return _sparse_mla_decode_on_stream(q, k_cache, indices, sm_scale, d_v, topk_length, out,
                                            lse, stream)


def _sparse_mla_decode_on_stream(q, k_cache, indices, sm_scale, d_v, topk_length, out, lse, stream):
    q, k_cache, indices, topk_length = map(A.plain, (q, k_cache, indices, topk_length))
    s = A.shape(q, "q")
    b, s_q, h_q = A.dim(s, 0), A.dim(s, 1), A.dim(s, 2)
    if out is None:
        out = A.empty(q, (b, s_q, h_q, d_v), "bf16")
    lse_rows = A.empty(q, (b, s_q, h_q), "f32") if lse is None else lse
    stream = A.stream_of(stream, q)
    _C.ops.sparse_mla_decode(*A.dl(q, k_cache, indices), float(sm_scale), int(d_v),
                             *A.dl(topk_length, *A.plain_all((out, lse_rows))), stream)
    if lse is not None:
        return out, lse
    if A.is_torch(lse_rows):
        return out, lse_rows.transpose(1, 2)
    if A.is_numpy(lse_rows):
        return out, lse_rows.transpose(0, 2, 1)
    return out, lse_rows


# ---- FlashMLA's FP8 KV cache ---------------------------------------------------------------------

def quantize_kv_fp8(kv, layout="v32_656", scales="pow2", k_scale=1.0, *, out=None, stream=None):
    """FlashMLA's quantize_k_cache: kv [..., 576] bf16 (512 latent + 64 rope values per token) ->
    [..., 656] uint8 FP8 tokens (layout v32_656: 512 e4m3 codes, four fp32 tile scales, the rope
    as bf16) or [..., 576] (raw_576: every value e4m3 of x / k_scale). scales: 'pow2' (FlashMLA's
    rule, byte for byte) or 'amax' (full e4m3 range). Runs the pool's store_kv over a page-size-1
    pool laid on the output, reading the input's latent and rope columns in place."""
    if A.is_torch(kv) and out is None and stream is None and _compiling():
        return _torch_op("quantize_kv_fp8")(kv, layout, scales, float(k_scale))
    return _quantize_kv_fp8(kv, layout, scales, k_scale, out, stream)


def _quantize_kv_fp8(kv, layout, scales, k_scale, out, stream):
    with A.on_stream(stream, kv):
        return _quantize_kv_fp8_on_stream(kv, layout, scales, k_scale, out, stream)


def _quantize_kv_fp8_on_stream(kv, layout, scales, k_scale, out, stream):
    kv = A.plain(kv)
    name, row = _layout(layout)
    s = A.shape(kv, "kv")
    n = 1
    for d in s[:-1]:
        n *= d
    if out is None:
        out = A.empty(kv, s[:-1] + (row,), "u8")
    kv_, out_, locs = A.dl(kv, A.plain(out), A.arange(kv, n))
    _C.ops.quantize_kv(kv_, out_, name, scales, float(k_scale), locs, A.stream_of(stream, kv))
    return out


def dequantize_kv_fp8(packed, layout="v32_656", k_scale=1.0, dtype="bf16", *, out=None,
                      stream=None):
    """FlashMLA's dequantize_k_cache: [..., 656] (or raw [..., 576]) FP8 tokens -> [..., 576] bf16
    (or f32 with dtype='f32'): code x scale for the latent part, the rope as stored. Runs gather_kv
    over a page-size-1 pool laid on `packed`, straight into the output's two column ranges."""
    if A.is_torch(packed) and out is None and stream is None and _compiling():
        return _torch_op("dequantize_kv_fp8")(packed, layout, float(k_scale), dtype)
    return _dequantize_kv_fp8(packed, layout, k_scale, dtype, out, stream)


def _dequantize_kv_fp8(packed, layout, k_scale, dtype, out, stream):
    with A.on_stream(stream, packed):
        return _dequantize_kv_fp8_on_stream(packed, layout, k_scale, dtype, out, stream)


def _dequantize_kv_fp8_on_stream(packed, layout, k_scale, dtype, out, stream):
    packed = A.plain(packed)
    name, row = _layout(layout)
    s = A.shape(packed, "packed")
    n = 1
    for d in s[:-1]:
        n *= d
    if out is None:
        out = A.empty(packed, s[:-1] + (576,), dtype)
    packed_, out_, locs = A.dl(packed, A.plain(out), A.arange(packed, n))
    _C.ops.dequantize_kv(packed_, out_, name, float(k_scale), locs, A.stream_of(stream, packed))
    return out


# ---- DeepGEMM fp8_mqa_logits ---------------------------------------------------------------------

def fp8_mqa_logits(q, kv, *args, clean_logits=True, out=None, stream=None):
    """DeepGEMM's fp8_mqa_logits, as fp8_mqa_logits(q, (kv, kv_scales), weights, ks, ke) or
    fp8_mqa_logits(q, kv, kv_scales, weights, ks, ke): q [s_q, H, d] e4m3 (uint8 or
    float8_e4m3fn), kv [s_kv, d] e4m3, kv_scales [s_kv] f32, weights [s_q, H] f32, ks / ke [s_q]
    int32 -> logits [s_q, s_kv] f32 with

        logits[i, j] = kv_scales[j] * sum_h weights[i, h] * relu(q[i, h] . kv[j])

    for ks[i] <= j < ke[i], and -inf elsewhere (DeepGEMM's clean_logits=True; with False the entries j < ks[i] hold their
    scores instead). The lightning indexer's logits op over an index-key pool of one page: zero-copy
    when kv_scales directly follows kv in memory (the layout of dsakit's and DeepGEMM's paged
    caches), else kv and kv_scales are copied into one scratch page (s_kv * (d + 4) bytes).
    Columns [0, ke[i]) are computed and [0, ks[i]) then set to -inf."""
    if isinstance(kv, tuple):
        kv, kv_scales = kv
        weights, ks, ke = args
    else:
        kv_scales, weights, ks, ke = args
    if A.is_torch(q) and out is None and stream is None and _compiling():
        return _torch_op("fp8_mqa_logits")(q, kv, kv_scales, weights, ks, ke, bool(clean_logits))
    return _fp8_mqa_logits(q, kv, kv_scales, weights, ks, ke, clean_logits, out, stream)


def _fp8_mqa_logits(q, kv, kv_scales, weights, ks, ke, clean_logits, out, stream):
    with A.on_stream(stream, q):
        return _fp8_mqa_logits_on_stream(q, kv, kv_scales, weights, ks, ke, clean_logits, out,
                                         stream)


def _fp8_mqa_logits_on_stream(q, kv, kv_scales, weights, ks, ke, clean_logits, out, stream):
    q, kv, kv_scales, weights, ks, ke = map(A.plain, (q, kv, kv_scales, weights, ks, ke))
    sq, sk = A.shape(q, "q"), A.shape(kv, "kv")
    s_q, s_kv, d = A.dim(sq, 0), A.dim(sk, 0), A.dim(sk, 1)
    if out is None:
        out = A.empty(q, (s_q, s_kv), "f32")
    scratch = A.empty(q, (s_kv * (d + 4),), "u8")
    _C.ops.mqa_logits(*A.dl(q, kv, kv_scales, weights, ke, A.plain(out), A.arange(q, s_kv),
                            A.full(q, s_q, 0), scratch), A.stream_of(stream, q))
    if clean_logits and s_q and s_kv:
        _mask_before(out, ks)
    return out


def _mask_before(logits, ks):
    """logits[i, j] = -inf for j < ks[i], in the logits' framework (ks read in place)."""
    t = sys.modules.get("torch")
    if A.is_torch(logits):
        starts = ks if A.is_torch(ks) else t.from_dlpack(ks)
        cols = t.arange(logits.shape[1], device=logits.device)
        logits.masked_fill_(cols[None, :] < starts.to(logits.device)[:, None], float("-inf"))
        return
    np = sys.modules["numpy"]
    if not A.is_numpy(logits):
        raise NotImplementedError("fp8_mqa_logits: masking needs NumPy or torch outputs")
    starts = ks if A.is_numpy(ks) else np.from_dlpack(ks)
    logits[np.arange(logits.shape[1])[None, :] < starts[:, None]] = -np.inf


def fp8_mqa_topk(q, kv, *args, out=None, stream=None):
    """The lightning indexer's top-k straight from DeepGEMM's fp8_mqa_logits inputs, as
    fp8_mqa_topk(q, (kv, kv_scales), weights, ks, ke, k) or
    fp8_mqa_topk(q, kv, kv_scales, weights, ks, ke, k) -> int32 [s_q, k]: for row i the k
    highest of fp8_mqa_logits' scores over keys ks[i] <= j < ke[i], as positions p = j - ks[i]
    (request-local when ks[i] is the request's first key), ascending, -1 padded; larger scores
    win, ties go to the lower position, NaN ranks below -inf, and a row with ke[i] - ks[i] <= k
    selects 0 ... ke[i] - ks[i] - 1 without scoring. The same selection as
    topk(fp8_mqa_logits(...)[i, ks[i]:ke[i]], k) row by row, without the [s_q, s_kv] logits:
    they are computed a block of rows at a time within the indexer's workspace bound
    (docs/cuda.md). ks / ke are read on the host: CPU arrays are read in place (also for a CUDA
    call), CUDA ones copied back (a synchronization); either way not inside a CUDA graph
    capture."""
    if isinstance(kv, tuple):
        kv, kv_scales = kv
        weights, ks, ke, k = args
    else:
        kv_scales, weights, ks, ke, k = args
    if A.is_torch(q) and out is None and stream is None and _compiling():
        return _torch_op("fp8_mqa_topk")(q, kv, kv_scales, weights, ks, ke, int(k))
    return _fp8_mqa_topk(q, kv, kv_scales, weights, ks, ke, k, out, stream)


def _fp8_mqa_topk(q, kv, kv_scales, weights, ks, ke, k, out, stream):
    with A.on_stream(stream, q):
        q, kv, kv_scales, weights, ks, ke = map(A.plain, (q, kv, kv_scales, weights, ks, ke))
        sq, sk = A.shape(q, "q"), A.shape(kv, "kv")
        s_q, s_kv, d = A.dim(sq, 0), A.dim(sk, 0), A.dim(sk, 1)
        if out is None:
            out = A.empty(q, (s_q, max(int(k), 0)), "i32")
        scratch = A.empty(q, (s_kv * (d + 4),), "u8")
        _C.ops.mqa_topk(*A.dl(q, kv, kv_scales, weights, ks, ke), int(k),
                        *A.dl(A.plain(out), A.arange(q, s_kv), scratch), A.stream_of(stream, q))
        return out


# ---- top-k ---------------------------------------------------------------------------------------

def topk(logits, k, lengths=None, *, out=None, stream=None):
    """Top-k of each row of logits [rows, width] f32 over its first lengths[i] entries (int32
    [rows]; None: all of them) -> int32 [rows, k]: the selected columns in ascending order, -1
    padded. Larger scores win, ties go to the lower column, NaN ranks below -inf; a row with
    lengths[i] <= k selects 0 … lengths[i]-1 without reading its logits."""
    if A.is_torch(logits) and out is None and stream is None and _compiling():
        return _torch_op("topk")(logits, int(k), lengths)
    return _topk(logits, k, lengths, out, stream)


def _topk(logits, k, lengths, out, stream):
    with A.on_stream(stream, logits):
        return _topk_on_stream(logits, k, lengths, out, stream)


def _topk_on_stream(logits, k, lengths, out, stream):
    logits, lengths = A.plain(logits), A.plain(lengths)
    s = A.shape(logits, "logits")
    rows = A.dim(s, 0)
    if lengths is None:
        lengths = A.full(logits, rows, A.dim(s, 1))
    if out is None:
        out = A.empty(logits, (rows, max(int(k), 0)), "i32")
    stream = A.stream_of(stream, logits)
    logits_, lengths_, out_ = A.dl(logits, lengths, A.plain(out))
    _C.ops.topk(logits_, lengths_, int(k), out_, stream)
    return out


def topk_to_kv_mask(positions, max_kv_len, *, out=None, stream=None):
    """Top-k positions int32 [T, k] (request positions, -1 padded: topk's or fp8_mqa_topk's) ->
    int32 [T, ceil(max_kv_len / 32)] bits for dense_mha_prefill's kv_mask: bit p % 32 of word
    p / 32 of row t set exactly for the positions p in row t. A position >= the mask's width is
    refused (ValueError naming it), nothing written; a CUDA call checks on a host copy."""
    if A.is_torch(positions) and out is None and stream is None and _compiling():
        return _torch_op("topk_to_kv_mask")(positions, int(max_kv_len))
    return _topk_to_kv_mask(positions, max_kv_len, out, stream)


def _topk_to_kv_mask(positions, max_kv_len, out, stream):
    with A.on_stream(stream, positions):
        positions = A.plain(positions)
        if out is None:
            words = max((int(max_kv_len) + 31) // 32, 1)
            out = A.empty(positions, (A.dim(A.shape(positions, "positions"), 0), words), "i32")
        stream = A.stream_of(stream, positions)
        positions_, out_ = A.dl(positions, A.plain(out))
        _C.ops.topk_to_kv_mask(positions_, out_, stream)
        return out


# ---- FlashAttention varlen -----------------------------------------------------------------------

def dense_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale=None, causal=True, *,
                      d_rope=64, cu_seqlens_q_host=None, cu_seqlens_k_host=None, check_rope=True,
                      kv_mask=None, out=None, stream=None):
    """FlashAttention's varlen prefill with MLA heads: q [T, H, d_qk], k [N, H, d_qk], v [N, H,
    d_v] (bf16, or f32 on the CPU), cu_seqlens_q / cu_seqlens_k int32 [B+1] -> (out [T, H, d_v],
    lse [H, T] f32 natural log, FlashAttention's softmax_lse layout: a transposed view). causal is
    bottom-right aligned: query i of a request with L_q queries and L_k keys sees keys
    0 … L_k - L_q + i. sm_scale defaults to d_qk ** -0.5.

    dsakit's dense kernel is MLA's: the last d_rope columns of k (the RoPE key) are one vector per
    token shared by all heads, k = [k_nope, k_pe.expand(H)]; check_rope (default) verifies that on a
    host copy of those columns (skipped while a CUDA graph is captured). q and k are split into
    their no-position and RoPE parts by row copies (the kernel takes them as separate tensors); v
    is read in place. The kernel schedules from host copies of cu_seqlens: pass
    cu_seqlens_*_host (CPU int32) to avoid a device-to-host copy, as under CUDA-graph capture.
    causal=False needs a backend with per-query visible counts (the CPU). kv_mask (optional,
    int32 [T, W], W * 32 >= every request's key count; topk_to_kv_mask builds it from top-k
    positions): query t also needs bit p % 32 of word p / 32 of its row set to see key p of its
    request — the sparse path's top-k as dense attention; a query that keeps no key gets out 0
    and lse +inf. CUDA multiplies a masked key's v row by 0, so it must be finite."""
    if A.is_torch(q) and out is None and stream is None and _compiling():
        s = A.shape(q, "q")
        scale = float(sm_scale) if sm_scale is not None else A.dim(s, 2) ** -0.5
        return _torch_op("dense_mha_prefill")(q, k, v, cu_seqlens_q, cu_seqlens_k, scale,
                                              bool(causal), int(d_rope), cu_seqlens_q_host,
                                              cu_seqlens_k_host, bool(check_rope), kv_mask)
    return _dense_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, causal, d_rope,
                              cu_seqlens_q_host, cu_seqlens_k_host, check_rope, kv_mask, out,
                              stream)


def _dense_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, causal, d_rope,
                       cu_seqlens_q_host, cu_seqlens_k_host, check_rope, kv_mask, out, stream):
    with A.on_stream(stream, q):
        return _dense_mha_prefill_on_stream(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, causal,
                                            d_rope, cu_seqlens_q_host, cu_seqlens_k_host,
                                            check_rope, kv_mask, out, stream)


def _dense_mha_prefill_on_stream(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, causal, d_rope,
                                 cu_seqlens_q_host, cu_seqlens_k_host, check_rope, kv_mask, out,
                                 stream):
    q, k, v, cu_q, cu_k, cu_qh, cu_kh, mask = map(A.plain, (q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                            cu_seqlens_q_host, cu_seqlens_k_host,
                                                            kv_mask))
    sq, sk, sv = A.shape(q, "q"), A.shape(k, "k"), A.shape(v, "v")
    t, h, d_qk = A.dim(sq, 0), A.dim(sq, 1), A.dim(sq, 2)
    n, d_v = A.dim(sk, 0), A.dim(sv, 2)
    d_rope = int(d_rope)
    d_nope = max(d_qk - d_rope, 0)
    dtype = "f32" if str(getattr(q, "dtype", "")).endswith("float32") else "bf16"
    if sm_scale is None:
        sm_scale = d_qk ** -0.5 if d_qk else 1.0
    if out is None:
        out = A.empty(q, (t, h, d_v), dtype)
    lse = A.empty(q, (t, h), "f32")
    scratch = (A.empty(q, (t, h, d_nope), dtype), A.empty(q, (t, h, d_rope), dtype),
               A.empty(q, (n, h, d_nope), dtype), A.empty(q, (n, d_rope), dtype))
    visible = None if causal else A.empty(q, (t,), "i32")
    stream = A.stream_of(stream, q)
    q_, k_, v_, cu_q_, cu_k_, cu_qh_, cu_kh_ = A.dl(q, k, v, cu_q, cu_k, cu_qh, cu_kh)
    _C.ops.dense_mha(q_, k_, v_, cu_q_, cu_k_, cu_qh_, cu_kh_, float(sm_scale), bool(causal),
                     d_rope, bool(check_rope), *A.dl(A.plain(out), lse, *scratch, visible, mask),
                     stream)
    if A.is_torch(lse):
        return out, lse.t()
    if A.is_numpy(lse):
        return out, lse.T
    return out, lse
