"""dsakit's number formats and pool quantizers against an independent numpy + ml_dtypes
implementation of docs/formats.md, byte for byte.

ml_dtypes' float8_e4m3fn cast rounds to nearest even but turns out-of-range values into NaN;
dsakit saturates, so the expected bytes clip to ±448 before the cast (NaN stays NaN, and dsakit
encodes it as 0x7F | sign).
"""
import subprocess

import ml_dtypes
import numpy as np
import pytest

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
F32 = np.float32
E4M3_MAX = F32(448.0)
D_C, D_ROPE, D_I, TILE = 512, 64, 128, 128


# ---- independent implementation ---------------------------------------------------------

def e4m3_bytes(x: np.ndarray) -> np.ndarray:
    """e4m3fn codes of fp32 values: RNE, saturating to ±448, NaN -> 0x7F | sign."""
    x = np.asarray(x, dtype=F32)
    with np.errstate(invalid="ignore"):
        codes = np.clip(x, -E4M3_MAX, E4M3_MAX).astype(E4M3).view(np.uint8)
    nan = np.isnan(x)
    codes[nan] = 0x7F | (np.signbit(x[nan]).astype(np.uint8) << 7)
    return codes


def pow2_ceil(v: np.ndarray) -> np.ndarray:
    """Exact smallest power of two >= v (fp32, v > 0 normal)."""
    m, e = np.frexp(np.asarray(v, dtype=F32))
    return np.where(m == 0.5, v, np.ldexp(F32(1.0), e)).astype(F32)


def tile_scales(amax: np.ndarray, policy: str) -> np.ndarray:
    v = (amax / E4M3_MAX).astype(F32)
    if policy == "amax":
        return np.maximum(v, np.finfo(F32).tiny).astype(F32)
    return pow2_ceil(np.maximum(v, F32(1e-4)))


def kv_rows(tokens: np.ndarray, layout: str, policy: str, k_scale: float) -> np.ndarray:
    """Pool rows [n, bytes_per_token] of bf16 tokens [n, 576] (c_kv then k_pe)."""
    n = tokens.shape[0]
    c_kv, k_pe = tokens[:, :D_C], tokens[:, D_C:]
    if layout == "bf16":
        return tokens.view(np.uint8).reshape(n, -1)
    if layout == "fp8-raw":
        return e4m3_bytes(tokens.astype(F32) / F32(k_scale))
    tiles = c_kv.astype(F32).reshape(n, D_C // TILE, TILE)
    scales = tile_scales(np.abs(tiles).max(axis=2), policy)
    codes = e4m3_bytes(tiles / scales[:, :, None]).reshape(n, D_C)
    scale_bytes = scales.astype("<f4").view(np.uint8).reshape(n, -1)
    return np.concatenate([codes, scale_bytes, k_pe.view(np.uint8).reshape(n, -1)], axis=1)


def index_rows(keys: np.ndarray) -> np.ndarray:
    """Page-size-1 index-key pool rows [n, d_i + 4]: e4m3 codes, then the fp32 pow2 scale."""
    x = keys.astype(F32)
    amax = np.maximum(np.abs(x).max(axis=1), F32(1e-4))
    scales = pow2_ceil((amax / E4M3_MAX).astype(F32))
    codes = e4m3_bytes(x / scales[:, None])
    return np.concatenate([codes, scales.astype("<f4").view(np.uint8).reshape(-1, 4)], axis=1)


# ---- inputs -----------------------------------------------------------------------------

def signed(rng, x):
    return np.where(rng.integers(0, 2, x.shape) == 1, -x, x).astype(F32)


def log_uniform(rng, n, lo, hi):
    return signed(rng, np.exp2(rng.uniform(lo, hi, n)).astype(F32))


def nudged(rng, mid):
    """mid, or one fp32 ulp below / above it."""
    step = rng.integers(-1, 2, mid.shape)
    down = np.nextafter(mid, F32(0))
    up = np.nextafter(mid, F32(np.inf))
    return np.where(step < 0, down, np.where(step > 0, up, mid)).astype(F32)


def hard_fp32_values(rng, n):
    """n values per kind: random bit patterns (NaN, inf, subnormals), exact e4m3 and bf16 ties,
    e4m3 subnormals, the saturation boundary, huge and tiny values, the e4m3 range."""
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(F32)
    e4m3_vals = np.arange(0, 0x7F, dtype=np.uint8).view(E4M3).astype(F32)
    c = rng.integers(0, e4m3_vals.size - 1, n)
    e4m3_ties = signed(rng, nudged(rng, (e4m3_vals[c] + e4m3_vals[c + 1]) * F32(0.5)))
    b = rng.integers(0, 0x7F7F, n, dtype=np.uint32)
    bf16_ties = signed(rng, nudged(rng, ((b << 16) + 0x8000).astype(np.uint32).view(F32)))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, 464, 480, -464,
                         np.finfo(F32).max, np.finfo(F32).tiny, 2.0**-149, 2.0**-10], dtype=F32)
    return np.concatenate([
        bits, e4m3_ties, bf16_ties,
        signed(rng, rng.uniform(0, 2.0**-6, n).astype(F32)),
        signed(rng, rng.uniform(416, 500, n).astype(F32)),
        log_uniform(rng, n, 60, 128), log_uniform(rng, n, -149, -10), log_uniform(rng, n, -10, 9),
        specials,
    ])


def random_tokens(rng, n, width):
    """bf16 [n, width] with per-128-value tiles of very different magnitudes: zero, tiny (mostly
    under the scale clamps), near the pow2 1e-4 clamp, randn, randn·50, and randn with one outlier."""
    x = rng.standard_normal((n, width)).astype(F32)
    tiles = x.reshape(n, -1, 64)  # 64 divides every width used here and the 128-value tiles
    kind = rng.integers(0, 6, tiles.shape[:2])
    factor = np.array([0.0, 1e-6, 0.015, 1.0, 50.0, 1.0], dtype=F32)[kind]
    tiles *= factor[:, :, None]
    outlier = np.argwhere(kind == 5)
    tiles[outlier[:, 0], outlier[:, 1], rng.integers(0, 64, len(outlier))] = signed(
        rng, rng.uniform(3.0e3, 3.15e3, len(outlier)).astype(F32))
    return tiles.reshape(n, width).astype(BF16)


def run_probe(probe, *args):
    subprocess.run([str(probe), *map(str, args)], check=True, capture_output=True)


def assert_bytes_equal(got, want, what):
    bad = np.argwhere(got != want)
    assert bad.size == 0, f"{what}: {len(bad)} mismatching bytes, first at {bad[:5].tolist()}"


# ---- tests ------------------------------------------------------------------------------

def test_e4m3_and_bf16_conversions(probe, rng, tmp_path):
    x = hard_fp32_values(rng, 500_000)
    inp = tmp_path / "x.f32"
    x.astype("<f4").tofile(inp)
    run_probe(probe, "convert", inp, tmp_path / "x.e4m3", tmp_path / "x.bf16")
    ours_e4m3 = np.fromfile(tmp_path / "x.e4m3", dtype=np.uint8)
    ours_bf16 = np.fromfile(tmp_path / "x.bf16", dtype="<u2")
    assert ours_e4m3.size == x.size and ours_bf16.size == x.size

    want = e4m3_bytes(x)
    bad = np.flatnonzero(ours_e4m3 != want)
    assert bad.size == 0, (f"e4m3: {bad.size} of {x.size} differ, e.g. x={x[bad[:5]]} "
                           f"ours={ours_e4m3[bad[:5]]} ml_dtypes={want[bad[:5]]}")

    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):
        want_bf16 = x.astype(BF16).view(np.uint16)
    bad = np.flatnonzero((ours_bf16 != want_bf16) & ~nan)
    assert bad.size == 0, (f"bf16: {bad.size} of {x.size} differ, e.g. x={x[bad[:5]]} "
                           f"ours={ours_bf16[bad[:5]]} ml_dtypes={want_bf16[bad[:5]]}")
    ours_nan = ours_bf16[nan]
    assert np.all((ours_nan & 0x7F80) == 0x7F80) and np.all(ours_nan & 0x7F), "bf16 NaN lost"
    assert np.array_equal(ours_nan >> 15, np.signbit(x[nan]).astype(np.uint16)), "NaN sign lost"


@pytest.mark.parametrize("layout,policy,k_scale", [
    ("fp8", "pow2", 1.0), ("fp8", "amax", 1.0), ("fp8-raw", "amax", 1.0),
    ("fp8-raw", "amax", 0.0371), ("bf16", "amax", 1.0)])
def test_kv_pool_rows(probe, rng, tmp_path, layout, policy, k_scale):
    tokens = random_tokens(rng, 2048, D_C + D_ROPE)
    inp = tmp_path / "tokens.bf16"
    tokens.tofile(inp)
    run_probe(probe, "store-kv", layout, policy, k_scale, inp, tmp_path / "pool.bin")
    want = kv_rows(tokens, layout, policy, k_scale)
    ours = np.fromfile(tmp_path / "pool.bin", dtype=np.uint8).reshape(want.shape)
    assert_bytes_equal(ours, want, f"{layout}/{policy} rows")


def test_index_key_pool_rows(probe, rng, tmp_path):
    keys = random_tokens(rng, 4096, D_I)
    inp = tmp_path / "keys.bf16"
    keys.tofile(inp)
    run_probe(probe, "store-index", inp, tmp_path / "index.bin")
    want = index_rows(keys)
    ours = np.fromfile(tmp_path / "index.bin", dtype=np.uint8).reshape(want.shape)
    assert_bytes_equal(ours, want, "index-key rows")
