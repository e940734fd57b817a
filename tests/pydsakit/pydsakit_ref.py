"""Independent float64 references (NumPy) for the Python ops, the golden files' reader, and the
comparisons with the tolerances the C++ tests use (tests/common/test_util.h, test_peers.cc)."""
import json
import pathlib

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32
REPO = pathlib.Path(__file__).resolve().parents[2]
PEERS = REPO / "tests" / "data" / "peers"

# docs/numerics.md#tolerances (tests/common/test_util.h)
TOL_BF16 = 1e-2
TOL_F32 = 1e-5
TOL_FP8_POOL = 3e-2
TOL_LSE = 1e-3
# tests/reference/test_peers.cc: the indexer against DeepGEMM
TOL_INDEXER_REL = 1e-3
TOL_INDEXER_ABS_OF_MAX = 1e-3
PEER_SM_SCALE = 0.1352


# ---- safetensors --------------------------------------------------------------------------------

_ST_DTYPES = {"BF16": BF16, "F32": np.float32, "F64": np.float64, "I32": np.int32,
              "U8": np.uint8, "I64": np.int64}


def read_safetensors(path):
    """(tensors by name as NumPy arrays, metadata) of a safetensors file."""
    raw = pathlib.Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(raw[base + b:base + e], dtype=_ST_DTYPES[t["dtype"]]).reshape(
            t["shape"]).copy()
    return out, meta


def peer(name):
    return read_safetensors(PEERS / name)


# ---- comparisons --------------------------------------------------------------------------------

def rel_l2(got, want):
    """||got - want|| / ||want|| in float64 (||got|| when want is all zero); NaN in got: inf."""
    g = np.asarray(got, dtype=np.float64).ravel()
    w = np.asarray(want, dtype=np.float64).ravel()
    if np.isnan(g).any():
        return np.inf
    den = np.linalg.norm(w)
    return float(np.linalg.norm(g - w) / den) if den > 0 else float(np.linalg.norm(g))


def max_abs_diff(got, want):
    """max |got - want| with equal infinities counting as 0 (a mismatched one as inf)."""
    g = np.asarray(got, dtype=np.float64).ravel()
    w = np.asarray(want, dtype=np.float64).ravel()
    same = (g == w) | (np.isnan(g) & np.isnan(w))
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(g - w))
    d[np.isnan(d)] = np.inf
    return float(d.max()) if d.size else 0.0


def f64(x):
    return np.asarray(x).astype(np.float64)


# ---- references ---------------------------------------------------------------------------------

def sparse_attention(q, kv, indices, sm_scale, topk_length=None, d_v=512):
    """FlashMLA's sparse attention in float64: q [T, H, D], kv [N, D], indices [T, k] (valid:
    0 <= i < N and slot < topk_length[t]; duplicates count per slot) -> o [T, H, d_v],
    lse [T, H] (natural log, +inf when no slot is valid), max_logits [T, H] (-inf then)."""
    q, kv = f64(q), f64(kv)
    t_, h, _ = q.shape
    n = kv.shape[0]
    o = np.zeros((t_, h, d_v))
    lse = np.full((t_, h), np.inf)
    mx = np.full((t_, h), -np.inf)
    for t in range(t_):
        idx = np.asarray(indices[t])
        k = len(idx) if topk_length is None else min(int(topk_length[t]), len(idx))
        sel = idx[:k]
        sel = sel[(sel >= 0) & (sel < n)]
        if sel.size == 0:
            continue
        keys = kv[sel]                      # [m, D]
        s = sm_scale * q[t] @ keys.T        # [H, m]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        z = p.sum(axis=1, keepdims=True)
        o[t] = (p / z) @ keys[:, :d_v]
        lse[t] = (m + np.log(z))[:, 0]
        mx[t] = m[:, 0]
    return o, lse, mx


def e4m3_values(codes):
    return np.asarray(codes, dtype=np.uint8).view(E4M3).astype(np.float64)


def e4m3_bytes(x):
    """e4m3fn codes of fp32 values: RNE, saturating to +-448 (dsakit's rule), NaN -> 0x7F|sign."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(invalid="ignore"):
        codes = np.clip(x, -448, 448).astype(E4M3).view(np.uint8)
    nan = np.isnan(x)
    codes[nan] = 0x7F | (np.signbit(x[nan]).astype(np.uint8) << 7)
    return codes


def pow2_ceil(v):
    m, e = np.frexp(np.asarray(v, dtype=F32))
    return np.where(m == 0.5, v, np.ldexp(F32(1.0), e)).astype(F32)


def quantize_656(tokens, policy):
    """FlashMLA's V3.2 656-byte tokens of bf16 tokens [n, 576] (docs/formats.md)."""
    n = tokens.shape[0]
    tiles = tokens[:, :512].astype(F32).reshape(n, 4, 128)
    v = (np.abs(tiles).max(axis=2) / F32(448)).astype(F32)
    scales = (np.maximum(v, np.finfo(F32).tiny) if policy == "amax"
              else pow2_ceil(np.maximum(v, F32(1e-4)))).astype(F32)
    codes = e4m3_bytes(tiles / scales[:, :, None]).reshape(n, 512)
    return np.concatenate([codes, scales.astype("<f4").view(np.uint8).reshape(n, 16),
                           np.ascontiguousarray(tokens[:, 512:]).view(np.uint8).reshape(n, 128)],
                          axis=1)


def quantize_576(tokens, k_scale):
    return e4m3_bytes(tokens.astype(F32) / F32(k_scale))


def dequantize_656(packed):
    """bf16 [n, 576] of 656-byte tokens: bf16(fp32(code) * scale), the rope as stored."""
    n = packed.shape[0]
    codes = packed[:, :512].view(E4M3).astype(F32).reshape(n, 4, 128)
    scales = np.ascontiguousarray(packed[:, 512:528]).view("<f4").reshape(n, 4, 1)
    c = (codes * scales).reshape(n, 512).astype(BF16)
    pe = np.ascontiguousarray(packed[:, 528:656]).view(BF16).reshape(n, 64)
    return np.concatenate([c, pe], axis=1)


def indexer_logits(q8, k8, k_scale, weights, ks, ke):
    """DeepGEMM's fp8_mqa_logits (cleaned) in float64 from the e4m3 codes."""
    q, k = e4m3_values(q8), e4m3_values(k8)            # [T, H, d], [N, d]
    s = np.maximum(np.einsum("thd,nd->thn", q, k), 0)   # relu per head
    logits = np.einsum("th,thn->tn", f64(weights), s) * f64(k_scale)[None, :]
    cols = np.arange(k.shape[0])[None, :]
    mask = (cols >= np.asarray(ks)[:, None]) & (cols < np.asarray(ke)[:, None])
    return np.where(mask, logits, -np.inf), mask


def topk(logits, k, lengths):
    """Top-k columns of each row over its first lengths[i]: larger first, ties to the lower
    column, NaN below -inf; ascending output, -1 padded; rows with lengths <= k: 0 … len-1."""
    rows = logits.shape[0]
    out = np.full((rows, k), -1, dtype=np.int32)
    for r in range(rows):
        n = int(lengths[r])
        if n <= k:
            out[r, :n] = np.arange(n)
            continue
        x = np.asarray(logits[r, :n], dtype=np.float64)
        key = np.where(np.isnan(x), -np.inf, x)
        nan = np.isnan(x)
        order = sorted(range(n), key=lambda j: (nan[j], -key[j], j))
        out[r] = np.sort(np.array(order[:k], dtype=np.int32))
    return out


def dense_mha(q, k, v, cu_q, cu_k, sm_scale, causal=True, kv_mask=None):
    """FlashAttention varlen in float64, bottom-right causal: o [T, H, d_v], lse [T, H]. kv_mask
    (int32 [T, W] bits): query t sees key p only where bit p % 32 of word p / 32 is set (a query
    that keeps none: o 0, lse +inf)."""
    q, k, v = f64(q), f64(k), f64(v)
    t_, h, _ = q.shape
    o = np.zeros((t_, h, v.shape[2]))
    lse = np.full((t_, h), np.inf)
    for r in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        e, l = q1 - q0, k1 - k0
        for i in range(e):
            vis = l - e + i + 1 if causal else l
            if vis <= 0:
                continue
            s = sm_scale * np.einsum("hd,nhd->hn", q[q0 + i], k[k0:k0 + vis])
            if kv_mask is not None:
                words = kv_mask[q0 + i].view(np.uint32)
                kept = (words[np.arange(vis) // 32] >> (np.arange(vis) % 32).astype(np.uint32)) & 1
                if not kept.any():
                    continue
                s[:, kept == 0] = -np.inf
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            z = p.sum(axis=1, keepdims=True)
            o[q0 + i] = np.einsum("hn,nhd->hd", p / z, v[k0:k0 + vis])
            lse[q0 + i] = (m + np.log(z))[:, 0]
    return o, lse
