"""Array plumbing of the Python side: which framework an argument comes from, outputs allocated
in that framework (so they live in its allocator: PyTorch's caching allocator and its CUDA-graph
pools, NumPy's heap), the caller's CUDA stream, and dsakit-allocated arrays handed back zero-copy.

Nothing here copies or converts an argument: a torch tensor that requires grad is detached and a
torch float8_e4m3fn tensor is viewed as uint8 (the library keeps FP8 data as bytes); both are
views of the same memory.
"""
from __future__ import annotations

import contextlib
import sys

from . import _dsakit as _C

_NP_DTYPES = {"f32": "float32", "f64": "float64", "i32": "int32", "u8": "uint8"}


def _torch():
    return sys.modules.get("torch")


def is_torch(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def is_numpy(x) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def is_array(x) -> bool:
    return is_torch(x) or is_numpy(x) or hasattr(x, "__dlpack__")


def plain(x):
    """The argument as the binding takes it (torch: detached; float8_e4m3fn, torch's or NumPy's
    ml_dtypes one, as uint8)."""
    t = _torch()
    if t is not None and isinstance(x, t.Tensor):
        if x.requires_grad:
            x = x.detach()
        if x.dtype == getattr(t, "float8_e4m3fn", None):
            x = x.view(t.uint8)
    elif getattr(getattr(x, "dtype", None), "name", None) == "float8_e4m3fn" and hasattr(x, "view"):
        x = x.view("uint8")
    return x


_to_dlpack = None


def dl(*xs):
    """The arguments as the binding imports them fastest: a torch tensor as its DLPack capsule
    (torch.utils.dlpack.to_dlpack, ~0.2 us; Tensor.__dlpack__ costs ~1.7 us of Python), others
    as they are. Zero-copy either way; the capsule keeps the tensor alive."""
    global _to_dlpack
    t = _torch()
    if t is None:
        return xs
    if _to_dlpack is None:
        from torch.utils.dlpack import to_dlpack as _f
        _to_dlpack = _f
    return tuple(_capsule(x) if isinstance(x, t.Tensor) else x for x in xs)


def _capsule(x):
    try:
        return _to_dlpack(x)
    except Exception:  # a dtype DLPack cannot carry: the binding then names the argument
        return x


def plain_all(xs) -> tuple:
    """plain() of each of xs (as a tuple); nothing to do while torch is not imported."""
    t = _torch()
    if t is None:
        return tuple(xs)
    return tuple(plain(x) for x in xs)


def shape(x, name: str) -> tuple:
    """x's shape, or TypeError naming the argument when x is no array."""
    s = getattr(x, "shape", None)
    if s is None:
        raise TypeError(f"{name}: expected a tensor, got {type(x).__name__}")
    return tuple(int(d) for d in s)


def dim(s: tuple, i: int) -> int:
    """s[i], or 0 when s has no dim i (the binding then names the bad shape)."""
    return s[i] if -len(s) <= i < len(s) else 0


def device_of(x) -> str:
    """'cpu' or 'cuda:N' of a DLPack array."""
    if is_torch(x):
        d = x.device
        return "cpu" if d.type == "cpu" else f"cuda:{d.index or 0}"
    if is_numpy(x):
        return "cpu"
    kind, index = x.__dlpack_device__()
    return "cpu" if int(kind) == 1 else f"cuda:{int(index)}"


def empty(like, shape_, dtype: str):
    """An uninitialized array of `dtype` (bf16, f32, f64, i32, u8) in like's framework and device
    (for a DLPack producer that is neither: NumPy on the CPU, torch on CUDA if importable, else a
    dsakit-allocated _dsakit.Array)."""
    shape_ = tuple(int(d) for d in shape_)
    t = _torch()
    if t is not None and isinstance(like, t.Tensor):
        return t.empty(shape_, dtype=_torch_dtype(dtype), device=like.device)
    if is_numpy(like):
        np = sys.modules["numpy"]
        if dtype == "bf16":
            return np.empty(shape_, dtype=_ml_bfloat16())
        return np.empty(shape_, dtype=_NP_DTYPES[dtype])
    # Another DLPack producer: NumPy on the CPU, torch on CUDA when importable, else dsakit's own.
    device = device_of(like)
    np = sys.modules.get("numpy")
    if device == "cpu" and np is not None:
        return empty(np.empty(0), shape_, dtype)
    if device != "cpu" and t is not None:
        return t.empty(shape_, dtype=_torch_dtype(dtype), device=device)
    return _C.empty(dtype, list(shape_), device)


def arange(like, n: int):
    """int32 0 … n-1 in like's framework and device."""
    t = _torch()
    if t is not None and isinstance(like, t.Tensor):
        return t.arange(n, dtype=t.int32, device=like.device)
    np = sys.modules.get("numpy")
    if is_numpy(like) or (np is not None and device_of(like) == "cpu"):
        return np.arange(n, dtype=np.int32)
    raise NotImplementedError("dsakit.ops on CUDA arrays other than torch tensors: import torch")


def full(like, n: int, value: int):
    """int32 [n] filled with value, in like's framework and device."""
    t = _torch()
    if t is not None and isinstance(like, t.Tensor):
        return t.full((n,), value, dtype=t.int32, device=like.device)
    np = sys.modules.get("numpy")
    if is_numpy(like) or (np is not None and device_of(like) == "cpu"):
        return np.full((n,), value, dtype=np.int32)
    raise NotImplementedError("dsakit.ops on CUDA arrays other than torch tensors: import torch")


def adopt(like, arr):
    """A dsakit-allocated array (dsakit's DLPack producer, _dsakit.Array) in like's framework
    (torch, NumPy, or the Array itself for others): zero-copy, keeping dsakit's memory alive."""
    t = _torch()
    if t is not None and (like is t or isinstance(like, t.Tensor)):
        return t.from_dlpack(arr)
    np = sys.modules.get("numpy")
    if np is not None and (like is np or isinstance(like, np.ndarray)):
        return np.from_dlpack(arr)
    return arr


def stream_of(stream, x):
    """The CUDA stream a call runs on, as an int: `stream` when given (an int or an object with
    .cuda_stream, e.g. torch.cuda.Stream), else PyTorch's current stream when x is a CUDA
    torch tensor, else None (the legacy default stream)."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    t = _torch()
    if t is not None and isinstance(x, t.Tensor) and x.is_cuda:
        return t.cuda.current_stream(x.device).cuda_stream
    return None


def on_stream(stream, like):
    """A context that makes `stream` PyTorch's current stream when like is a CUDA torch tensor
    and a stream is given, so that the outputs and scratch torch allocates (and fills) for a call
    are ordered with the call's kernels on that stream; otherwise it does nothing."""
    t = _torch()
    if stream is None or t is None or not isinstance(like, t.Tensor) or not like.is_cuda:
        return contextlib.nullcontext()
    handle = int(getattr(stream, "cuda_stream", stream))
    return t.cuda.stream(t.cuda.ExternalStream(handle, device=like.device))


def device_stream(stream, device: str):
    """The stream of a call with no tensor argument on `device`: `stream` when given, else
    PyTorch's current stream there when torch is imported, else None."""
    if stream is not None or device == "cpu":
        return stream_of(stream, None)
    t = _torch()
    if t is not None and t.cuda.is_available():
        return t.cuda.current_stream(device).cuda_stream
    return None


def _torch_dtype(dtype: str):
    t = _torch()
    return {"bf16": t.bfloat16, "f32": t.float32, "f64": t.float64, "i32": t.int32,
            "u8": t.uint8}[dtype]


def _ml_bfloat16():
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("bf16 NumPy arrays need the ml_dtypes package "
                          "(pip install ml_dtypes)") from e
    return ml_dtypes.bfloat16
