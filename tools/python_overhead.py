#!/usr/bin/env python3
"""Host time the Python binding adds to a layer call (docs/python.md#overhead).

Times DsaAttention.forward from Python against the same C++ DsaAttention::forward run in a C++
loop (the binding's _time_forward) on the same layer, batch and arrays, in alternating rounds;
prints microseconds per call (median over rounds) and the difference. The shape is small (a few
new tokens over a short cached prefix, DeepSeek-V3.2 at TP8: 16 heads), so that the fixed cost
per call is what shows.

    python tools/python_overhead.py                      # CPU backend, NumPy arrays
    python tools/python_overhead.py --framework torch    # CPU backend, torch tensors
    python tools/python_overhead.py --device cuda        # CUDA backend, torch CUDA tensors
"""
import argparse
import statistics
import sys
import time

import numpy as np

import dsakit


def arrays(cfg, t, framework, device, rng):
    c = cfg
    shapes = [(t, c.num_heads, c.qk_nope_head_dim), (t, c.num_heads, c.qk_rope_head_dim),
              (t, c.kv_lora_rank), (t, c.qk_rope_head_dim), (t, c.index_n_heads, c.index_head_dim),
              (t, c.index_head_dim), (t, c.index_n_heads)]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    w = (rng.standard_normal((c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
         / np.sqrt(c.kv_lora_rank)).astype(np.float32)
    if framework == "numpy":
        import ml_dtypes
        conv = [x.astype(ml_dtypes.bfloat16) for x in xs[:6]] + [xs[6]]
        return dsakit.LayerInputs(*conv), w.astype(ml_dtypes.bfloat16)
    import torch
    conv = [torch.from_numpy(x).to(device).bfloat16() for x in xs[:6]]
    conv.append(torch.from_numpy(xs[6]).to(device))
    return dsakit.LayerInputs(*conv), torch.from_numpy(w).to(device).bfloat16()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--framework", choices=("numpy", "torch"), default=None)
    ap.add_argument("--tokens", type=int, default=2, help="new tokens per call (1 request)")
    ap.add_argument("--prefix", type=int, default=62, help="cached positions before them")
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    framework = args.framework or ("numpy" if args.device == "cpu" else "torch")
    cfg = dsakit.ModelConfig.load("deepseek-v3.2").with_tp(8)
    rng = np.random.default_rng(0)
    x, w = arrays(cfg, args.tokens, framework, args.device, rng)
    length = args.prefix + args.tokens
    pages = (length + 63) // 64
    kv = dsakit.KvPool("fp8", 64, pages, args.device)
    ix = dsakit.IndexPool(64, pages, args.device, d_i=cfg.index_head_dim)
    layer = dsakit.DsaAttention(cfg, kv, ix, w)
    batch = dsakit.Batch([args.prefix], [args.tokens], [list(range(pages))])
    first = layer.forward(batch, x)
    o, lse = first.o, first.lse
    sync = (lambda: None)
    if framework == "torch" and args.device != "cpu":
        import torch
        sync = torch.cuda.synchronize

    def loop(fn):
        sync()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / args.calls * 1e6

    def python_round():
        return loop(lambda: layer.forward(batch, x, o=o, lse=lse))

    def one_cpp_round():  # the C++ loop of one call, from a Python loop
        return loop(lambda: layer._time_forward(batch, x, o=o, lse=lse, repeats=1))

    def cpp_round():
        return layer._time_forward(batch, x, o=o, lse=lse, repeats=args.calls)

    # The binding's own cost: the same call over an empty batch (validation, plan, no kernel).
    empty = dsakit.Batch([args.prefix], [0], [list(range(pages))])
    x0, _ = arrays(cfg, 0, framework, args.device, rng)
    e = layer.forward(empty, x0)

    def empty_python_round():
        return loop(lambda: layer.forward(empty, x0, o=e.o, lse=e.lse))

    def empty_cpp_round():
        return layer._time_forward(empty, x0, o=e.o, lse=e.lse, repeats=args.calls)

    rounds = {"py": python_round, "one": one_cpp_round, "cpp": cpp_round,
              "epy": empty_python_round, "ecpp": empty_cpp_round}
    for f in rounds.values():
        f()  # warm-up
    us = {k: [] for k in rounds}
    for _ in range(args.rounds):
        for k, f in rounds.items():
            us[k].append(f())
    m = {k: statistics.median(v) for k, v in us.items()}
    print(f"{dsakit.device_name(args.device)}, {framework} arrays, "
          f"{cfg.summary().split(' rope')[0]}")
    print(f"batch: 1 request, {args.tokens} new tokens over {args.prefix} cached "
          f"({first.plan.path}); median of {args.rounds} rounds x {args.calls} calls")
    print(f"C++ forward, C++ loop                 {m['cpp']:9.2f} us/call")
    print(f"C++ forward, one per Python iteration {m['one']:9.2f} us/call "
          f"(re-enters the C++ from Python each call, array imports included)")
    print(f"Python forward (the binding)          {m['py']:9.2f} us/call "
          f"({m['py'] - m['cpp']:+.2f} over the C++ loop)")
    print(f"binding overhead (empty batch)        {m['epy'] - m['ecpp']:9.2f} us/call "
          f"(Python {m['epy']:.2f} vs C++ {m['ecpp']:.2f}: DLPack import of 10 arrays, checks, "
          f"result)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
