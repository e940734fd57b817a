"""tools/trace_report.py on synthetic trace files (the record format of
src/cuda/common/kernel_trace.h): its per-call line and the medians it prints for a call, against
the same quantities computed here from random stamps; a truncated file is refused."""
import pathlib
import re
import struct
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "trace_report.py"
SLOTS = 256


def logits_record(rng: np.random.Generator, ctas: int, items: int):
    """A tag-1 record whose CTAs run `items` work items each, with random event spacings (ns).
    Returns the bytes and the expected medians (us)."""
    t = np.zeros((ctas, SLOTS), dtype=np.uint64)
    staging, gaps, busy, first, first_issued, fill, lead = [], [], [], [], [], [], []
    for c in range(ctas):
        clock = int(rng.integers(1_000, 2_000))
        t[c, 0] = clock
        last_done = None
        for k in range(items):
            s = 8 + 8 * k
            d = rng.integers(100, 20_000, size=7)
            events = clock + np.cumsum(d)
            t[c, s] = clock
            t[c, s + 1:s + 8] = events
            staging.append(d[0] / 1e3)
            ready, done = int(events[4]), int(events[5])  # slots s + 5, s + 6
            issued, last_issued = int(events[1]), int(events[2])  # slots s + 2, s + 3
            busy.append((done - ready) / 1e3)
            fill.append((ready - issued) / 1e3)
            lead.append((done - last_issued) / 1e3)
            if k == 0:
                first.append(ready)
                first_issued.append(issued)
            else:
                gaps.append((ready - last_done) / 1e3)
            last_done = done
            clock = int(events[-1])
        t[c, 1:4] = clock + rng.integers(1, 500, size=3)
    t0 = int(t[:, 0].min())
    header = struct.pack("<8q", 1, ctas, 0, 64, 0, 4096, 4096, 1)
    expected = {
        "first": np.median([(f - t0) / 1e3 for f in first]),
        "first_issued": np.median([(f - t0) / 1e3 for f in first_issued]),
        "fill": np.median(fill),
        "lead": np.median(lead),
        "staging": np.median(staging),
        "gap": np.median(gaps) if gaps else float("nan"),
        "busy": np.median(busy),
        "span": (int(t[:, 1:4].max()) - t0) / 1e3,
    }
    return header + t.tobytes(), expected


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True)


def median_of(out: str, label: str) -> float:
    m = re.search(re.escape(label) + r".*?median\s+([-\d.]+)", out)
    assert m, f"no '{label}' line in:\n{out}"
    return float(m.group(1))


def test_medians_of_a_call_match_the_stamps(rng, tmp_path):
    first, expected0 = logits_record(rng, ctas=5, items=3)
    second, expected1 = logits_record(rng, ctas=3, items=4)
    path = tmp_path / "trace.bin"
    path.write_bytes(first + second)
    r = run(path, "--calls", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("call 0: e4m3 H_i 64 rows [0, 4096) width 4096 splits 1 CTAs 5")
    assert f"{expected0['span']:.1f} us" in lines[0]
    call1 = r.stdout[r.stdout.index("call 1:"):]
    assert f"{expected1['span']:.1f} us" in call1.splitlines()[0]
    for label, key in (("first tile ready", "first"), ("producer staging", "staging"),
                       ("gap between items", "gap"), ("time in an item", "busy"),
                       ("first tile issued", "first_issued"), ("issued to ready", "fill"),
                       ("last tile issued to done", "lead")):
        assert abs(median_of(call1, label) - expected1[key]) < 0.006, label
    assert "work items: 12" in call1


def test_a_truncated_file_is_refused(rng, tmp_path):
    record, _ = logits_record(rng, ctas=2, items=1)
    path = tmp_path / "trace.bin"
    path.write_bytes(record[:-8])
    r = run(path)
    assert r.returncode != 0
    assert "not a logits trace record" in r.stderr
