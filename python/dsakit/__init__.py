"""dsakit: DeepSeek Sparse Attention prefill for MLA models, from Python (docs/python.md).

    import dsakit
    cfg = dsakit.ModelConfig.load("deepseek-v3.2").with_tp(8)
    kv = dsakit.KvPool("fp8", page_size=64, num_pages=4096, device="cuda")
    ix = dsakit.IndexPool(page_size=64, num_pages=4096, device="cuda", d_i=cfg.index_head_dim)
    layer = dsakit.DsaAttention(cfg, kv, ix, kv_b_proj)
    batch = dsakit.Batch(prefix_lens, extend_lens, page_table, page_size=64)
    res = layer.forward(batch, dsakit.LayerInputs(q_nope, q_pe, c_kv, k_pe, idx_q, idx_k, idx_w))

Arrays cross as DLPack (PyTorch, NumPy, any __dlpack__ producer), zero-copy; dsakit.ops has the
kernel-level ops in FlashMLA's, DeepGEMM's and FlashAttention's conventions, also registered as
torch.ops.dsakit.* when PyTorch is importable (set DSAKIT_NO_TORCH=1 to skip importing it).
"""
from __future__ import annotations

import importlib.util as _importlib_util
import os as _os

# PyTorch first when it is there: its CUDA libraries (cuBLAS, ...) then load before the
# extension's, which shares them by soname instead of putting another copy of the same soname
# under PyTorch.
if not _os.environ.get("DSAKIT_NO_TORCH") and _importlib_util.find_spec("torch") is not None:
    import torch as _torch  # noqa: F401

from . import _arrays
from ._dsakit import (Array, BackendError, Batch, ConfigError, Error, FormatError, IndexPool,
                      InternalError, InvalidArgumentError, KvPool, LayerOptions,
                      LayoutMismatchError, ModelConfig, Plan, PreparedBatch, ResourceError,
                      UnsupportedError, cuda_compiled, cuda_device_count, device_name,
                      kernel_instances)
from .layer import DsaAttention, LayerInputs, LayerResult
from . import ops

__version__ = "0.1.0"

__all__ = ["ModelConfig", "KvPool", "IndexPool", "Batch", "Plan", "PreparedBatch", "LayerOptions",
           "Array",
           "DsaAttention", "LayerInputs", "LayerResult", "ops", "Error", "InvalidArgumentError",
           "LayoutMismatchError", "UnsupportedError", "ConfigError", "FormatError",
           "ResourceError", "BackendError", "InternalError", "cuda_compiled",
           "cuda_device_count", "device_name", "kernel_instances", "__version__"]


def _pool_storage(self):
    """The pool's bytes, zero-copy: the wrapped array itself (KvPool.wrap), else u8
    [num_locations, bytes_per_token] (IndexPool: [num_pages, page_bytes]) as a NumPy array (CPU)
    or a torch tensor (CUDA, when torch is imported), else a DLPack-capable array."""
    own = self._storage()
    if own is None:
        return self._owner
    if self.device == "cpu":
        import numpy
        return _arrays.adopt(numpy, own)
    return _arrays.adopt(_arrays._torch(), own)


for _pool in (KvPool, IndexPool):
    _pool.storage = property(_pool_storage)
del _pool

if not _os.environ.get("DSAKIT_NO_TORCH") and _importlib_util.find_spec("torch") is not None:
    from . import _torch_ops
    _torch_ops.register()
