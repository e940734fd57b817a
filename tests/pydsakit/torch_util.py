"""NumPy <-> torch for the torch tests (imported only where torch is installed)."""
import numpy as np
import torch

from pydsakit_ref import BF16


def tt(a, device="cpu"):
    """A NumPy array (ml_dtypes bf16 included) as a torch tensor on `device`."""
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def tn(t):
    """A torch tensor as NumPy (bf16 as ml_dtypes bf16)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()
