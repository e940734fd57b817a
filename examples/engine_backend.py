"""An inference engine's attention backend on dsakit (docs/python.md#engines).

A paged engine (SGLang, vLLM and their kin) keeps, per running request, a row of `req_to_token`
(the KV slot of every position: slot = page * page_size + offset), the sequence length after
this step and the cached-prefix length. `DsaBackend.make_batch` maps exactly that onto a
dsakit.Batch (page table = the page of every page_size-th slot), and `DsaBackend.forward_extend`
runs one DSA layer over it. `main` simulates such an engine: it allocates pages per request,
runs a chunked prefill (every step sends up to --chunk new tokens per request, over the prefix
the earlier steps cached), and checks the result against the same prompts run in one step.

    python examples/engine_backend.py --device cpu --prompts 300,120 --chunk 128
    python examples/engine_backend.py --device cuda --prompts 5000,3000 --chunk 2048

With PyTorch importable the tensors are torch tensors (CUDA tensors with --device cuda, run on
the current stream); otherwise NumPy arrays (CPU).
"""
import argparse
import sys

import numpy as np

import dsakit

try:
    import torch
except ImportError:  # the example also runs on NumPy alone (CPU)
    torch = None

NAMES = ("q_nope", "q_pe", "c_kv", "k_pe", "idx_q", "idx_k", "idx_w")


class DsaBackend:
    """One layer's attention backend: the pools, the layer, and the engine-metadata mapping."""

    def __init__(self, cfg, kv_b_proj, num_pages, page_size, device, layout="fp8", options=None):
        self.page_size = page_size
        self.kv = dsakit.KvPool(layout, page_size, num_pages, device)
        self.ix = dsakit.IndexPool(page_size, num_pages, device, d_i=cfg.index_head_dim)
        self.layer = dsakit.DsaAttention(cfg, self.kv, self.ix, kv_b_proj, options)

    def make_batch(self, req_to_token, req_pool_indices, seq_lens, prefix_lens, mode="extend"):
        """The engine's metadata as a dsakit.Batch. req_to_token: int32 [max_requests,
        max_context] slots (host memory: the batch is built on the host, so an engine passes the
        CPU copy it keeps for scheduling); req_pool_indices: each running request's row;
        seq_lens / prefix_lens: total and cached lengths per request."""
        ps = self.page_size
        rows = np.asarray(req_to_token)[np.asarray(req_pool_indices)]
        seq = np.asarray(seq_lens, dtype=np.int64)
        width = int((seq.max() + ps - 1) // ps) if len(seq) else 0
        tables = np.full((len(seq), width), -1, dtype=np.int32)
        for r, n in enumerate(seq):
            pages = rows[r, 0:int(n):ps] // ps  # the page of every page_size-th position
            tables[r, :len(pages)] = pages
        prefix = np.asarray(prefix_lens, dtype=np.int32)
        return dsakit.Batch(prefix, (seq - prefix).astype(np.int32), tables, page_size=ps,
                            mode=mode)

    def forward_extend(self, batch, inputs):
        """One layer call (stores the new tokens' KV and index keys, plans, attends)."""
        return self.layer.forward(batch, inputs)


class Engine:
    """A toy paged engine: page-aligned slots per request and a req_to_token table."""

    def __init__(self, max_requests, max_context, num_pages, page_size, seed=0):
        self.page_size = page_size
        self.req_to_token = np.zeros((max_requests, max_context), dtype=np.int32)
        self.free_pages = list(np.random.default_rng(seed).permutation(num_pages))

    def admit(self, r, length):
        ps = self.page_size
        for p in range(0, length, ps):
            page = int(self.free_pages.pop())
            n = min(ps, length - p)
            self.req_to_token[r, p:p + n] = page * ps + np.arange(n)


def make_tensors(cfg, rows, device, seed):
    """Random per-position layer inputs (bf16, idx_w f32) in the framework the example uses."""
    g = np.random.default_rng(seed)
    c = cfg
    shapes = {"q_nope": (rows, c.num_heads, c.qk_nope_head_dim),
              "q_pe": (rows, c.num_heads, c.qk_rope_head_dim), "c_kv": (rows, c.kv_lora_rank),
              "k_pe": (rows, c.qk_rope_head_dim),
              "idx_q": (rows, c.index_n_heads, c.index_head_dim),
              "idx_k": (rows, c.index_head_dim), "idx_w": (rows, c.index_n_heads)}
    out = {}
    for name, shape in shapes.items():
        x = g.standard_normal(shape).astype(np.float32) * (0.3 if name == "c_kv" else 1.0)
        out[name] = convert(x, device, bf16=name != "idx_w")
    w = (g.standard_normal((c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
         / np.sqrt(c.kv_lora_rank)).astype(np.float32)
    return out, convert(w, device, bf16=True)


def convert(x, device, bf16):
    if torch is not None:
        t = torch.from_numpy(x).to(device)
        return t.to(torch.bfloat16) if bf16 else t
    if device != "cpu":
        sys.exit("--device cuda needs PyTorch")
    import ml_dtypes
    return x.astype(ml_dtypes.bfloat16) if bf16 else x


def to_numpy(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return x.float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def take(tensors, rows):
    idx = torch.as_tensor(rows, device=tensors["c_kv"].device) if torch is not None else rows
    return dsakit.LayerInputs(*(tensors[n][idx] for n in NAMES))


def run(cfg, w, tensors, prompts, chunk, device, page_size, options):
    """A chunked prefill of `prompts` (chunk 0: one step); the outputs in position order."""
    num_pages = sum((n + page_size - 1) // page_size for n in prompts) + 4
    engine = Engine(len(prompts), max(prompts), num_pages, page_size)
    backend = DsaBackend(cfg, w, num_pages, page_size, device, options=options)
    for r, n in enumerate(prompts):
        engine.admit(r, n)
    offsets = np.concatenate([[0], np.cumsum(prompts)[:-1]])
    done = [0] * len(prompts)
    o = np.zeros((sum(prompts), cfg.num_heads, cfg.v_head_dim), np.float32)
    topk = np.full((sum(prompts), cfg.index_topk), -1, np.int32)
    steps = []
    while any(d < n for d, n in zip(done, prompts)):
        running = [r for r in range(len(prompts)) if done[r] < prompts[r]]
        new = [min(chunk or prompts[r], prompts[r] - done[r]) for r in running]
        batch = backend.make_batch(engine.req_to_token, running,
                                   [done[r] + e for r, e in zip(running, new)],
                                   [done[r] for r in running])
        rows = [int(offsets[r]) + done[r] + i for r, e in zip(running, new) for i in range(e)]
        res = backend.forward_extend(batch, take(tensors, rows))
        o[rows] = to_numpy(res.o)
        if res.topk is not None:
            topk[rows] = to_numpy(res.topk).astype(np.int32)
        steps.append(f"{res.plan.path} ({batch.num_new_tokens} tokens)")
        for r, e in zip(running, new):
            done[r] += e
    return o, topk, steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if dsakit.cuda_device_count() else "cpu")
    ap.add_argument("--model", default="deepseek-v3.2")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--prompts", default="300,120")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--topk", type=int, default=0, help="override index_topk (0: the model's)")
    args = ap.parse_args(argv)
    cfg = dsakit.ModelConfig.load(args.model).with_tp(args.tp)
    if args.topk:
        cfg.index_topk = args.topk
    prompts = [int(x) for x in args.prompts.split(",")]
    tensors, w = make_tensors(cfg, sum(prompts), args.device, seed=1)
    # f32 outputs where the backend computes in f32 (the CPU): chunking invariance to 1e-5.
    f32 = args.device == "cpu"
    opts = dsakit.LayerOptions(output_dtype="f32" if f32 else "bf16")
    chunked, topk_c, steps = run(cfg, w, tensors, prompts, args.chunk, args.device,
                                 args.page_size, opts)
    whole, topk_w, _ = run(cfg, w, tensors, prompts, 0, args.device, args.page_size, opts)
    rel = float(np.linalg.norm(chunked - whole) / np.linalg.norm(whole))
    tol = 1e-5 if f32 else 1e-2
    # top-k of the rows both runs computed on the sparse path (dense rows select nothing)
    sparse = (topk_c[:, 0] >= 0) & (topk_w[:, 0] >= 0)
    same_topk = int(np.all(topk_c[sparse] == topk_w[sparse], axis=1).sum())
    print(f"{cfg.summary()}\nsteps: {', '.join(steps)}")
    print(f"chunked prefill matches one-shot: o rel-L2 {rel:.2e} (tol {tol:g}), "
          f"top-k equal on {same_topk} of {int(sparse.sum())} rows both ran sparse"
          if rel <= tol else f"MISMATCH: o rel-L2 {rel:.2e} > {tol:g}")
    return 0 if rel <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
