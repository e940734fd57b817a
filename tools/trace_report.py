#!/usr/bin/env python3
"""Summarizes a kernel trace file (a DSAKIT_KERNEL_TRACE build, src/cuda/common/kernel_trace.h).

Each record: int64 header[8] = {tag, ctas, ...}, then ctas x 256 uint64 %globaltimer stamps (ns,
0 = no such event). Tag 1, the wgmma indexer logits kernel (logits_kernel.cuh): header
{1, ctas, operands (0 e4m3, 1 f16), h_i, row_begin, row_end, width, key splits}; slots 0-3 the
CTA's entry and its producer / consumer / finisher ends, then 8 per work item k from 8 + 8 k:
staging begin, staging end, first tile issued, last tile issued (producer thread 0), queries
ready, first tile ready, last tile done (consumer thread 0), item finished (finisher thread 0).

  tools/trace_report.py FILE              one line per traced call
  tools/trace_report.py FILE --calls 3,9  those calls in detail: microseconds from the first
                                          CTA's entry, medians over CTAs and items
"""
import argparse
import struct
import sys

import numpy as np

SLOTS = 256
OPS = {0: "e4m3", 1: "f16"}


def records(path):
    data = open(path, "rb").read()
    off, index = 0, 0
    while off + 64 <= len(data):
        header = struct.unpack_from("<8q", data, off)
        ctas = header[1]
        size = ctas * SLOTS * 8
        if header[0] != 1 or ctas < 1 or off + 64 + size > len(data):
            sys.exit(f"{path}: record {index} is not a logits trace record")
        stamps = np.frombuffer(data, dtype="<u8", count=ctas * SLOTS, offset=off + 64)
        yield index, header, stamps.reshape(ctas, SLOTS).astype(np.int64)
        off += 64 + size
        index += 1


def stats(values):
    if not values:
        return "none"
    v = np.array(values)
    return f"median {np.median(v):7.2f}  min {v.min():7.2f}  max {v.max():7.2f}  (n {len(v)})"


def detail(t):
    t0 = t[:, 0][t[:, 0] > 0].min()
    us = lambda x: (x - t0) / 1e3
    first_ready, first_issued, gaps, busy, staging, items = [], [], [], [], [], 0
    fill, lead = [], []
    for cta in range(t.shape[0]):
        k = 0
        while 8 + 8 * k + 7 < SLOTS and t[cta, 8 + 8 * k] > 0:
            s = 8 + 8 * k
            items += 1
            staging.append((t[cta, s + 1] - t[cta, s]) / 1e3)
            if t[cta, s + 5] > 0:
                if k == 0:
                    first_ready.append(us(t[cta, s + 5]))
                    first_issued.append(us(t[cta, s + 2]))
                fill.append((t[cta, s + 5] - t[cta, s + 2]) / 1e3)
                lead.append((t[cta, s + 6] - t[cta, s + 3]) / 1e3)
                busy.append((t[cta, s + 6] - t[cta, s + 5]) / 1e3)
                if k > 0 and t[cta, s - 8 + 6] > 0:
                    gaps.append((t[cta, s + 5] - t[cta, s - 8 + 6]) / 1e3)
            k += 1
    ends = [us(t[c, 1:4].max()) for c in range(t.shape[0])]
    print(f"  CTA ends (us):                       {stats(ends)}")
    print(f"  first tile issued after entry (us):  {stats(first_issued)}")
    print(f"  first tile ready after entry (us):   {stats(first_ready)}")
    print(f"  an item's first tile, issued to ready (us): {stats(fill)}")
    print(f"  producer's lead, last tile issued to done (us): {stats(lead)}")
    print(f"  producer staging of an item (us):    {stats(staging)}")
    print(f"  consumers' gap between items (us):   {stats(gaps)}")
    print(f"  consumers' time in an item (us):     {stats(busy)}")
    print(f"  work items: {items}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--calls", default="", help="comma-separated call indices to detail")
    args = ap.parse_args()
    want = {int(c) for c in args.calls.split(",") if c}
    for index, h, t in records(args.file):
        span = (t[:, 1:4].max() - t[:, 0][t[:, 0] > 0].min()) / 1e3
        print(f"call {index}: {OPS.get(h[2], h[2])} H_i {h[3]} rows [{h[4]}, {h[5]}) width {h[6]}"
              f" splits {h[7]} CTAs {h[1]}: {span:.1f} us entry to last end")
        if index in want:
            detail(t)


if __name__ == "__main__":
    main()
