"""Peer for the dense MHA step: PyTorch SDPA (cuDNN backend where it takes the shape) on the same
shapes as dsakit_bench_cuda's dense_mha rows (one causal fresh prompt), timed the same way
(CUDA events, warm-up, median of 20, 3 input sets rotated). Runs on the device machine."""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # (name, H, T, d_qk, d_v): the shapes of dsakit_bench_cuda's rows
    *[("deepseek-v3.2", 128, t, 192, 128) for t in (1024, 2048, 4096, 8192, 16384)],
    *[("deepseek-v3.2", h, t, 192, 128) for h in (32, 16) for t in (1024, 2048, 4096)],
    ("deepseek-v3.2", 16, 16384, 192, 128),
    *[("glm-5", 64, t, 256, 256) for t in (1024, 2048, 4096, 8192, 16384)],
    *[("glm-5", 16, t, 256, 256) for t in (1024, 2048, 4096)],
]


def median_ms(fn, runs=20):
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    ts = []
    for i in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[runs // 2]


def main():
    rows = []
    for name, h, t, dqk, dv in SHAPES:
        sets = [(torch.randn(1, h, t, dqk, device="cuda", dtype=torch.bfloat16),
                 torch.randn(1, h, t, dqk, device="cuda", dtype=torch.bfloat16),
                 torch.randn(1, h, t, dv, device="cuda", dtype=torch.bfloat16)) for _ in range(3)]
        flops = 2.0 * h * (t * (t + 1) / 2) * (dqk + dv)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    ms = median_ms(lambda i: F.scaled_dot_product_attention(
                        *sets[i % 3], is_causal=True, scale=0.1352))
                rows.append({"shape": f"{name} H={h} [{t}]", "peer": backend.name, "ms": ms,
                             "tflops": flops / ms / 1e9})
                break
            except RuntimeError as e:  # this backend does not take the shape
                print(f"[peer] {name} H={h} T={t}: {backend.name} refused: {str(e)[:80]}",
                      file=sys.stderr)
    print(f"{'shape':<30} {'peer':<18} {'ms':>9} {'TFLOP/s':>9}")
    for r in rows:
        print(f"{r['shape']:<30} {r['peer']:<18} {r['ms']:>9.3f} {r['tflops']:>9.1f}")
    if len(sys.argv) > 1:
        json.dump(rows, open(sys.argv[1], "w"), indent=2)


if __name__ == "__main__":
    main()
