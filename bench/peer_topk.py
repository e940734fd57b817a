"""Peer for the indexer's top-k: torch.topk (k = 2048 along the last dim) over one fresh causal
prompt's logits [T, T] (fp32, -inf past each row's context), the shapes of dsakit_bench_cuda
--indexer, timed the same way (CUDA events, warm-up, median). Only rows past k are selected, as
dsakit's top-k computes them (the rows within k are the identity). Runs on the device machine."""
import json
import sys

import torch

SHAPES = [4096, 8192, 16384, 32768, 65536]
K = 2048


def median_ms(fn, runs):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    rows = []
    for t in SHAPES:
        logits = torch.randn(t - K, t, device="cuda", dtype=torch.float32)
        pos = torch.arange(t, device="cuda")
        ctx = torch.arange(K, t, device="cuda") + 1
        logits.masked_fill_(pos[None, :] >= ctx[:, None], float("-inf"))
        ms = median_ms(lambda: torch.topk(logits, K, dim=-1, sorted=False), 5 if t > 16384 else 10)
        rows.append({"T": t, "stage": "torch.topk", "ms": ms})
        print(f"peer T={t:6d}  torch.topk k={K} over {t - K} rows  {ms:9.3f} ms", flush=True)
        del logits
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        json.dump(rows, open(sys.argv[1], "w"), indent=2)


if __name__ == "__main__":
    main()
