"""dsakit's ops as PyTorch custom ops (torch.ops.dsakit.*), each with a fake (meta)
implementation, so that they trace under torch.compile(fullgraph=True) without a graph break and
run inside CUDA-graph capture: the real implementation allocates its outputs and scratch with
torch (the caching allocator, and the graph's pool while capturing) and enqueues on the current
stream. Registered once, by `import dsakit` when torch is importable (register() is idempotent).
No `from __future__ import annotations` here: torch.library reads the schema from the annotations.
"""
from typing import Optional

import torch
from torch import Tensor

from . import ops as _ops

_registered = False


def _row_bytes(layout: str) -> int:
    return _ops._layout(layout)[1]


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True

    @torch.library.custom_op("dsakit::sparse_mla_prefill", mutates_args=())
    def sparse_mla_prefill(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float,
                           d_v: int = 512,
                           topk_length: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        return _ops._sparse_mla_prefill(q, kv, indices, sm_scale, d_v, topk_length, None, None,
                                        None, None)

    @sparse_mla_prefill.register_fake
    def _(q, kv, indices, sm_scale, d_v=512, topk_length=None):
        s_q, h_q = q.shape[0], q.shape[1]
        return (q.new_empty((s_q, h_q, d_v), dtype=torch.bfloat16),
                q.new_empty((s_q, h_q), dtype=torch.float32),
                q.new_empty((s_q, h_q), dtype=torch.float32))

    @torch.library.custom_op("dsakit::sparse_mla_decode", mutates_args=())
    def sparse_mla_decode(q: Tensor, k_cache: Tensor, indices: Tensor, sm_scale: float,
                          d_v: int = 512,
                          topk_length: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        return _ops._sparse_mla_decode(q, k_cache, indices, sm_scale, d_v, topk_length, None,
                                       None, None)

    @sparse_mla_decode.register_fake
    def _(q, k_cache, indices, sm_scale, d_v=512, topk_length=None):
        b, s_q, h_q = q.shape[0], q.shape[1], q.shape[2]
        return (q.new_empty((b, s_q, h_q, d_v), dtype=torch.bfloat16),
                q.new_empty((b, s_q, h_q), dtype=torch.float32).transpose(1, 2))

    @torch.library.custom_op("dsakit::quantize_kv_fp8", mutates_args=())
    def quantize_kv_fp8(kv: Tensor, layout: str = "v32_656", scales: str = "pow2",
                        k_scale: float = 1.0) -> Tensor:
        return _ops._quantize_kv_fp8(kv, layout, scales, k_scale, None, None)

    @quantize_kv_fp8.register_fake
    def _(kv, layout="v32_656", scales="pow2", k_scale=1.0):
        return kv.new_empty(tuple(kv.shape[:-1]) + (_row_bytes(layout),), dtype=torch.uint8)

    @torch.library.custom_op("dsakit::dequantize_kv_fp8", mutates_args=())
    def dequantize_kv_fp8(packed: Tensor, layout: str = "v32_656", k_scale: float = 1.0,
                          dtype: str = "bf16") -> Tensor:
        return _ops._dequantize_kv_fp8(packed, layout, k_scale, dtype, None, None)

    @dequantize_kv_fp8.register_fake
    def _(packed, layout="v32_656", k_scale=1.0, dtype="bf16"):
        return packed.new_empty(tuple(packed.shape[:-1]) + (576,),
                                dtype=torch.float32 if dtype == "f32" else torch.bfloat16)

    @torch.library.custom_op("dsakit::fp8_mqa_logits", mutates_args=())
    def fp8_mqa_logits(q: Tensor, kv: Tensor, kv_scales: Tensor, weights: Tensor, ks: Tensor,
                       ke: Tensor, clean_logits: bool = True) -> Tensor:
        return _ops._fp8_mqa_logits(q, kv, kv_scales, weights, ks, ke, clean_logits, None, None)

    @fp8_mqa_logits.register_fake
    def _(q, kv, kv_scales, weights, ks, ke, clean_logits=True):
        return q.new_empty((q.shape[0], kv.shape[0]), dtype=torch.float32)

    @torch.library.custom_op("dsakit::fp8_mqa_topk", mutates_args=())
    def fp8_mqa_topk(q: Tensor, kv: Tensor, kv_scales: Tensor, weights: Tensor, ks: Tensor,
                     ke: Tensor, k: int) -> Tensor:
        return _ops._fp8_mqa_topk(q, kv, kv_scales, weights, ks, ke, k, None, None)

    @fp8_mqa_topk.register_fake
    def _(q, kv, kv_scales, weights, ks, ke, k):
        return q.new_empty((q.shape[0], k), dtype=torch.int32)

    @torch.library.custom_op("dsakit::topk", mutates_args=())
    def topk(logits: Tensor, k: int, lengths: Optional[Tensor] = None) -> Tensor:
        return _ops._topk(logits, k, lengths, None, None)

    @topk.register_fake
    def _(logits, k, lengths=None):
        return logits.new_empty((logits.shape[0], k), dtype=torch.int32)

    @torch.library.custom_op("dsakit::topk_to_kv_mask", mutates_args=())
    def topk_to_kv_mask(positions: Tensor, max_kv_len: int) -> Tensor:
        return _ops._topk_to_kv_mask(positions, max_kv_len, None, None)

    @topk_to_kv_mask.register_fake
    def _(positions, max_kv_len):
        return positions.new_empty((positions.shape[0], max((max_kv_len + 31) // 32, 1)),
                                   dtype=torch.int32)

    @torch.library.custom_op("dsakit::dense_mha_prefill", mutates_args=())
    def dense_mha_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, sm_scale: float, causal: bool = True,
                          d_rope: int = 64, cu_seqlens_q_host: Optional[Tensor] = None,
                          cu_seqlens_k_host: Optional[Tensor] = None,
                          check_rope: bool = True,
                          kv_mask: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        return _ops._dense_mha_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, causal,
                                       d_rope, cu_seqlens_q_host, cu_seqlens_k_host, check_rope,
                                       kv_mask, None, None)

    @dense_mha_prefill.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, sm_scale, causal=True, d_rope=64,
          cu_seqlens_q_host=None, cu_seqlens_k_host=None, check_rope=True, kv_mask=None):
        t, h = q.shape[0], q.shape[1]
        return (q.new_empty((t, h, v.shape[2])),
                q.new_empty((t, h), dtype=torch.float32).t())
