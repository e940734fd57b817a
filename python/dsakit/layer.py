"""The layer, mirroring the C++ API (include/dsakit/layer.h, docs/layer.md): DsaAttention over
a KvPool and an IndexPool, with plan(), prepare() and forward(). forward() allocates o and lse in
the inputs' framework unless given, and runs on the caller's current CUDA stream."""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

from . import _arrays as A
from . import _dsakit as _C

_INPUTS = ("q_nope", "q_pe", "c_kv", "k_pe", "idx_q", "idx_k", "idx_w")


class LayerInputs(NamedTuple):
    """The per-call inputs, T new tokens in batch (request) order (docs/design.md, inputs)."""
    q_nope: Any  # bf16 [T, H, d_nope]
    q_pe: Any    # bf16 [T, H, d_rope], RoPE applied
    c_kv: Any    # bf16 [T, d_c], normalized latent KV
    k_pe: Any    # bf16 [T, d_rope], RoPE applied
    idx_q: Any   # bf16 [T, H_i, d_i]
    idx_k: Any   # bf16 [T, d_i]
    idx_w: Any   # f32 [T, H_i]


class LayerResult(NamedTuple):
    o: Any             # [T, H, d_v] (LayerOptions.output_dtype)
    lse: Any           # f32 [T, H], natural log
    topk: Any          # i32 [T, index_topk] positions (sparse path or mixed plan), else None
    plan: Any          # dsakit.Plan
    stages: List[Tuple[str, float]]  # (stage, ms) with LayerOptions(time_stages=True)


def _inputs(inputs) -> tuple:
    if isinstance(inputs, dict):
        missing = [k for k in _INPUTS if k not in inputs]
        if missing:
            raise TypeError(f"inputs: missing {', '.join(missing)}")
        return A.plain_all(inputs[k] for k in _INPUTS)
    if isinstance(inputs, tuple) and len(inputs) == 7:
        return A.plain_all(inputs)
    raise TypeError("inputs: expected a dsakit.LayerInputs, a dict or a 7-tuple of tensors "
                    f"({', '.join(_INPUTS)}), got {type(inputs).__name__}")


class DsaAttention:
    """One DSA attention layer: stores the new tokens into the pools, plans, runs the chosen path.

    kv_b_proj is bf16 [H * (d_nope + d_v), d_c] on the pools' device, kept alive (not copied) by
    the layer, as are the pools. options: dsakit.LayerOptions.

    kv_b_proj_fp8 (optional): the same weights as an FP8 checkpoint stores them, a pair (codes,
    scales) — codes e4m3 [H * (d_nope + d_v), d_c] (torch.float8_e4m3fn or uint8 bytes), scales
    float32 [ceil(rows / 128), d_c / 128], one per 128 x 128 block. With an fp8 / fp8-raw pool on
    a backend that has it (the CPU; CUDA sm_90) the dense path's K/V up-projection then multiplies
    the pool's codes by them as stored, an FP8 GEMM (docs/layer.md, "FP8 weights")."""

    def __init__(self, config, kv_pool, index_pool, kv_b_proj, options=None, kv_b_proj_fp8=None):
        codes, scales = None, None
        if kv_b_proj_fp8 is not None:
            if not isinstance(kv_b_proj_fp8, (tuple, list)) or len(kv_b_proj_fp8) != 2:
                raise TypeError("kv_b_proj_fp8: expected a pair (codes, scales), got "
                                f"{type(kv_b_proj_fp8).__name__}")
            codes, scales = (A.plain(x) for x in kv_b_proj_fp8)
        self._impl = _C._DsaAttention(config, kv_pool, index_pool, A.plain(kv_b_proj),
                                      options if options is not None else _C.LayerOptions(),
                                      codes, scales)
        self._cfg = self._impl.config
        self._out_dtype = self._impl.options.output_dtype

    config = property(lambda self: self._cfg)
    sm_scale = property(lambda self: self._impl.sm_scale)
    options = property(lambda self: self._impl.options)
    device = property(lambda self: self._impl.device)
    kv_pool = property(lambda self: self._impl.kv_pool)
    index_pool = property(lambda self: self._impl.index_pool)

    def plan(self, batch):
        """The dispatcher's decision for batch (validates it against the pools); no work done."""
        return self._impl.plan(batch)

    def prepare(self, batch, stream=None):
        """batch validated, planned and its index arrays uploaded (dsakit.PreparedBatch):
        forward() over it neither plans nor copies from the host, so it can be captured into a
        CUDA graph (after one call of the same shapes) and replayed while it lives."""
        return self._impl.prepare(batch, A.device_stream(stream, self.device))

    def workspace_bytes(self, batch, path="plan"):
        """Device bytes one forward over batch allocates ('plan', 'dense_mha' or 'sparse_mla')."""
        return self._impl.workspace_bytes(batch, path)

    def set_dispatch(self, mode: str):
        """Replaces the dispatch mode: rule, cost, dense or sparse."""
        self._impl.set_dispatch(mode)

    def forward(self, batch, inputs, *, o=None, lse=None, topk=None, stream=None) -> LayerResult:
        """Validates everything before the first write, stores the new tokens, runs the plan.

        batch: dsakit.Batch or dsakit.PreparedBatch; inputs: dsakit.LayerInputs (or a dict).
        o, lse, topk: optional output arrays to write into (e.g. the static outputs of a CUDA
        graph); o and lse are otherwise allocated in the inputs' framework, topk by dsakit
        (returned zero-copy in that framework)."""
        x = _inputs(inputs)
        with A.on_stream(stream, x[0]):
            return self._forward(batch, x, o, lse, topk, stream)

    def _forward(self, batch, x, o, lse, topk, stream) -> LayerResult:
        if isinstance(batch, _C.PreparedBatch):
            t = batch.batch.num_new_tokens
        elif isinstance(batch, _C.Batch):
            t = batch.num_new_tokens
        else:
            raise TypeError("batch: expected a dsakit.Batch or a dsakit.PreparedBatch, got "
                            f"{type(batch).__name__}")
        cfg = self._cfg
        if A.is_array(x[0]):  # else the binding names the bad argument
            if o is None:
                o = A.empty(x[0], (t, cfg.num_heads, cfg.v_head_dim), self._out_dtype)
            if lse is None:
                lse = A.empty(x[0], (t, cfg.num_heads), "f32")
        o_, lse_, topk_ = A.plain_all((o, lse, topk))
        _, _, topk_out, plan, stages = self._impl.forward(
            batch, *A.dl(*x, o_, lse_, topk_), A.stream_of(stream, x[0]))
        if topk is not None:
            topk_out = topk if topk_out is not None else None
        elif topk_out is not None:
            topk_out = A.adopt(x[0], topk_out)
        return LayerResult(o, lse, topk_out, plan, stages)

    __call__ = forward

    def _time_forward(self, batch, inputs, *, o, lse, topk=None, repeats: int = 100) -> float:
        """Microseconds per call of the C++ forward alone (a C++ loop): the overhead benchmark."""
        x = _inputs(inputs)
        return self._impl._time_forward(batch, *A.dl(*x, *A.plain_all((o, lse, topk))),
                                        int(repeats))
