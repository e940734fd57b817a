#!/usr/bin/env python3
"""Figures for the docs from the JSON that `dsakit bench --json FILE` writes.

Usage: python3 tools/plot_bench.py BENCH.json OUT_PREFIX [--format png|svg]

Rows are grouped by (config, heads, layout, weights); every figure has one subplot per group (at
most three columns) and the device name in its title. Three figures:

  OUT_PREFIX-curves.<fmt>    rows of kind "fresh": whole-layer time (ms, log scale) against the
                             number of tokens (log2 scale), one line per mode present among
                             dense, sparse, rule and cost (dense only where it is exact), and a
                             dashed vertical line at the model's index_topk.
  OUT_PREFIX-decision.<fmt>  rows of kind "prefix" (one request: prefix[0] cached tokens,
                             extend[0] new ones): extend (log2) against prefix (symlog). Colour:
                             the faster measured path (oracle_path; dense blue, sparse orange).
                             Marker: 'o' where the cost mode chose that path, 'x' where it chose
                             the other one (or "mixed"). A black ring marks points where the
                             rule mode's path differs from the oracle's.
  OUT_PREFIX-speedup.<fmt>   rows of kind "fresh" with tokens <= index_topk: bars of
                             speedup_rule_vs_sparse and speedup_cost_vs_sparse per token count.

Anything missing or malformed in a row (a field, a mode, a non-positive time) drops that point
only; a figure with nothing to draw is not written, and the script says so. A decision point
needs oracle_path and the cost mode's path; without the rule mode's path it gets no ring. A file
with "complete": false (an interrupted run) is plotted with a note. A file that cannot be read or
is not dsakit-bench JSON exits with code 2 and one line on stderr.

Needs only numpy and matplotlib (Agg backend, no display).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

FORMAT_TAG = "dsakit-bench"
KNOWN_VERSION = 1

Row = dict[str, Any]
GroupKey = tuple[str, str, str, str]

MODES = ("dense", "sparse", "rule", "cost")
MODE_STYLE: dict[str, dict[str, Any]] = {
    "dense": {"color": "tab:blue", "marker": "o", "linestyle": "-"},
    "sparse": {"color": "tab:orange", "marker": "s", "linestyle": "-"},
    "rule": {"color": "tab:green", "marker": "^", "linestyle": "--"},
    "cost": {"color": "tab:red", "marker": "v", "linestyle": ":"},
}
PATH_COLOR = {"dense": "tab:blue", "sparse": "tab:orange"}
# A mode's kernel path, as written by dsakit, mapped to the oracle's vocabulary. Anything else
# ("mixed", unknown strings) maps to None and never equals an oracle path.
KERNEL_TO_PATH = {"dense_mha": "dense", "sparse_mla": "sparse"}


class BenchFormatError(Exception):
    """The input is missing, unreadable, or not dsakit-bench JSON."""


# ---- reading ------------------------------------------------------------------------------

def load_bench(path: pathlib.Path) -> dict[str, Any]:
    """The parsed bench document; raises BenchFormatError unless it is dsakit-bench JSON."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BenchFormatError(f"{path}: no such file") from None
    except OSError as e:
        raise BenchFormatError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise BenchFormatError(f"{path}: not UTF-8 text, so not dsakit-bench JSON") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise BenchFormatError(f"{path}: not JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_TAG:
        raise BenchFormatError(f'{path}: not dsakit bench output (no "format": "{FORMAT_TAG}")')
    if not isinstance(doc.get("rows", []), list):
        raise BenchFormatError(f'{path}: "rows" is not a list')
    return doc


def num(value: Any) -> float | None:
    """value as a finite float, or None (bools, strings, NaN and infinities are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def positive(value: Any) -> float | None:
    """value as a finite float > 0, or None."""
    v = num(value)
    return v if v is not None and v > 0 else None


def first_of(value: Any) -> float | None:
    """The first element of a list as a number (prefix[0], extend[0]), or None."""
    if isinstance(value, list) and value:
        return num(value[0])
    return None


def mode(row: Row, name: str) -> dict[str, Any] | None:
    """The row's entry for one mode, or None when absent or malformed."""
    modes = row.get("modes")
    if not isinstance(modes, dict):
        return None
    entry = modes.get(name)
    return entry if isinstance(entry, dict) else None


def mode_path(row: Row, name: str) -> str | None:
    """The oracle-vocabulary path ("dense"/"sparse") a mode took, or None (absent, "mixed", ...)."""
    entry = mode(row, name)
    if entry is None:
        return None
    path = entry.get("path")
    return KERNEL_TO_PATH.get(path) if isinstance(path, str) else None


def has_path(row: Row, name: str) -> bool:
    """Whether a mode is present with some path string (possibly "mixed")."""
    entry = mode(row, name)
    return entry is not None and isinstance(entry.get("path"), str)


def group_key(row: Row) -> GroupKey:
    return (str(row.get("config", "?")), str(row.get("heads", "?")), str(row.get("layout", "?")),
            str(row.get("weights", "bf16")))


def group_title(key: GroupKey) -> str:
    config, heads, layout, weights = key
    return f"{config} H={heads} {layout}" + (" w8" if weights == "fp8" else "")


def group_rows(rows: Sequence[Any], kind: str) -> dict[GroupKey, list[Row]]:
    """Rows of one kind by group, groups in order of first appearance."""
    groups: dict[GroupKey, list[Row]] = {}
    for row in rows:
        if isinstance(row, dict) and row.get("kind") == kind:
            groups.setdefault(group_key(row), []).append(row)
    return groups


# ---- drawing helpers ----------------------------------------------------------------------

def tokens_label(v: float, _pos: Any = None) -> str:
    """Tick label for token counts: 512, 4K, 1M, ..."""
    if v <= 0:
        return "0"
    for unit, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if v >= unit:
            q = v / unit
            return f"{q:g}{suffix}"
    return f"{v:g}"


def subplot_grid(n: int, width: float = 5.0, height: float = 3.8) -> tuple[Figure, list[Axes]]:
    """A figure with n subplots in at most three columns (unused cells hidden)."""
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + 0.8),
                             squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def save(fig: Figure, path: pathlib.Path, fmt: str) -> None:
    metadata = {"Date": None} if fmt == "svg" else None  # reproducible SVGs for the docs
    fig.savefig(path, format=fmt, dpi=120, bbox_inches="tight", metadata=metadata)
    plt.close(fig)


def suptitle(fig: Figure, doc: dict[str, Any], what: str) -> None:
    device = doc.get("device")
    device = device if isinstance(device, str) and device else "unknown device"
    backend = doc.get("backend")
    title = f"{device}" + (f" ({backend})" if isinstance(backend, str) and backend else "")
    title += f": {what}"
    if doc.get("complete") is False:
        title += " [partial run]"
    fig.suptitle(title)


# ---- figure 1: time against tokens ---------------------------------------------------------

def curves_group(ax: Axes, rows: list[Row]) -> bool:
    """Draw one group's curves; False when there was nothing to draw."""
    drew = False
    for name in MODES:
        points = []
        for row in rows:
            tokens = positive(row.get("tokens"))
            entry = mode(row, name)
            ms = positive(entry.get("ms")) if entry else None
            if tokens is not None and ms is not None:
                points.append((tokens, ms))
        if not points:
            continue
        points.sort()
        xs, ys = zip(*points)
        ax.plot(xs, ys, label=name, markersize=4, **MODE_STYLE[name])
        drew = True
    if not drew:
        return False
    topks = sorted({v for r in rows if (v := positive(r.get("index_topk"))) is not None})
    for i, topk in enumerate(topks):
        ax.axvline(topk, color="gray", linestyle="--", linewidth=1,
                   label="index_topk" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))
    ax.set_xlabel("tokens")
    ax.set_ylabel("whole layer (ms)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize="small")
    return True


# ---- figure 2: dense/sparse decision map ---------------------------------------------------

def decision_group(ax: Axes, rows: list[Row]) -> bool:
    """Draw one group's decision map; False when there was nothing to draw."""
    xs: list[float] = []
    ys: list[float] = []
    colors: list[str] = []
    cost_right: list[bool] = []
    rule_wrong: list[bool] = []
    for row in rows:
        extend = first_of(row.get("extend"))
        prefix = first_of(row.get("prefix"))
        oracle = row.get("oracle_path")
        if (extend is None or extend <= 0 or prefix is None or prefix < 0
                or oracle not in PATH_COLOR or not has_path(row, "cost")):
            continue
        xs.append(extend)
        ys.append(prefix)
        colors.append(PATH_COLOR[oracle])
        cost_right.append(mode_path(row, "cost") == oracle)
        rule_wrong.append(has_path(row, "rule") and mode_path(row, "rule") != oracle)
    if not xs:
        return False
    x, y = np.asarray(xs), np.asarray(ys)
    right, ring = np.asarray(cost_right), np.asarray(rule_wrong)
    col = np.asarray(colors)
    if right.any():
        ax.scatter(x[right], y[right], c=col[right], marker="o", s=36, zorder=3)
    if (~right).any():
        ax.scatter(x[~right], y[~right], c=col[~right], marker="x", s=40, linewidths=1.5, zorder=3)
    if ring.any():
        ax.scatter(x[ring], y[ring], facecolors="none", edgecolors="black", marker="o", s=130,
                   linewidths=1.2, zorder=4)
    ax.set_xscale("log", base=2)
    positive_prefix = y[y > 0]
    if positive_prefix.size:
        linthresh = float(positive_prefix.min())
        ax.set_yscale("symlog", base=2, linthresh=linthresh, linscale=0.5)
        ax.set_ylim(-0.3 * linthresh, float(positive_prefix.max()) * math.sqrt(2))
    ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))
    ax.yaxis.set_major_formatter(FuncFormatter(tokens_label))
    # Pad by half an octave so points on the edges are not cut by the frame.
    ax.set_xlim(x.min() / math.sqrt(2), x.max() * math.sqrt(2))
    ax.set_xlabel("extend (new tokens)")
    ax.set_ylabel("prefix (cached tokens)")
    ax.grid(True, which="major", alpha=0.3)
    return True


def decision_legend() -> list[Line2D]:
    gray = "dimgray"
    return [
        Line2D([], [], linestyle="", marker="o", color=PATH_COLOR["dense"],
               label="dense faster (measured)"),
        Line2D([], [], linestyle="", marker="o", color=PATH_COLOR["sparse"],
               label="sparse faster (measured)"),
        Line2D([], [], linestyle="", marker="o", color=gray, label="cost mode chose the faster path"),
        Line2D([], [], linestyle="", marker="x", color=gray, markeredgewidth=1.5,
               label="cost mode chose another path"),
        Line2D([], [], linestyle="", marker="o", markerfacecolor="none", markeredgecolor="black",
               markersize=10, label="rule mode chose another path"),
    ]


# ---- figure 3: speed-ups over sparse -------------------------------------------------------

SPEEDUPS = (("speedup_rule_vs_sparse", "rule", "tab:green"),
            ("speedup_cost_vs_sparse", "cost", "tab:red"))


def speedup_group(ax: Axes, rows: list[Row]) -> bool:
    """Draw one group's speed-up bars; False when there was nothing to draw."""
    by_tokens: dict[float, Row] = {}
    for row in rows:
        tokens = positive(row.get("tokens"))
        topk = positive(row.get("index_topk"))
        if tokens is None or topk is None or tokens > topk:
            continue
        if any(positive(row.get(field)) is not None for field, _, _ in SPEEDUPS):
            by_tokens.setdefault(tokens, row)  # first row per token count
    if not by_tokens:
        return False
    tokens = sorted(by_tokens)
    centers = np.arange(len(tokens), dtype=float)
    width = 0.38
    for i, (field, name, color) in enumerate(SPEEDUPS):
        offset = (i - 0.5) * width
        bx = [c + offset for c, t in zip(centers, tokens) if positive(by_tokens[t].get(field))]
        by = [v for t in tokens if (v := positive(by_tokens[t].get(field))) is not None]
        if bx:
            ax.bar(bx, by, width=width, color=color, label=f"{name} vs sparse")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(centers, [tokens_label(t) for t in tokens])
    ax.set_xlabel("tokens (fresh prefill, <= index_topk)")
    ax.set_ylabel("speed-up over sparse (x)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return True


# ---- driver --------------------------------------------------------------------------------

DrawGroup = Callable[[Axes, list[Row]], bool]


def draw_figure(doc: dict[str, Any], kind: str, draw: DrawGroup, what: str,
                legend: list[Line2D] | None = None) -> Figure | None:
    """One subplot per group that has something to draw; None when no group does."""
    groups = group_rows(doc.get("rows", []), kind)
    if not groups:
        return None
    fig, axes = subplot_grid(len(groups))
    drawn = 0
    for ax, (key, rows) in zip(axes, groups.items()):
        if draw(ax, rows):
            ax.set_title(group_title(key))
            drawn += 1
        else:
            ax.set_visible(False)
    if drawn == 0:
        plt.close(fig)
        return None
    suptitle(fig, doc, what)
    if legend:
        fig.legend(handles=legend, loc="lower center", ncols=min(len(legend), 3),
                   fontsize="small", bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.08 if legend else 0, 1, 1))
    return fig


def plot(doc: dict[str, Any], prefix: str, fmt: str) -> list[str]:
    """Write the figures; returns the messages to print (paths written, figures skipped)."""
    figures: list[tuple[str, str, DrawGroup, str, list[Line2D] | None, str]] = [
        ("curves", "fresh", curves_group, "whole-layer time, fresh prefill", None,
         'no "fresh" rows with tokens and a positive ms for any mode'),
        ("decision", "prefix", decision_group, "dense/sparse decision, one request with a prefix",
         decision_legend(), 'no "prefix" rows with prefix, extend, oracle_path and a cost path'),
        ("speedup", "fresh", speedup_group, "speed-up over sparse, tokens <= index_topk", None,
         'no "fresh" rows with tokens <= index_topk and a speed-up'),
    ]
    out = pathlib.Path(prefix)
    if out.parent != pathlib.Path("."):
        out.parent.mkdir(parents=True, exist_ok=True)
    messages = []
    for name, kind, draw, what, legend, why_empty in figures:
        path = pathlib.Path(f"{prefix}-{name}.{fmt}")
        fig = draw_figure(doc, kind, draw, what, legend)
        if fig is None:
            messages.append(f"skipped {path}: {why_empty}")
            continue
        save(fig, path, fmt)
        messages.append(f"wrote {path}")
    return messages


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="plot_bench.py",
        description="Turn the JSON of 'dsakit bench --json FILE' into figures: "
                    "PREFIX-curves (time vs tokens, fresh rows), PREFIX-decision (dense/sparse "
                    "choice vs measured optimum, prefix rows) and PREFIX-speedup (rule/cost "
                    "speed-up over sparse for tokens <= index_topk).",
        epilog="Exit status: 0 on success (figures with nothing to draw are skipped with a "
               "message), 2 when the input is missing or not dsakit-bench JSON.")
    parser.add_argument("bench", type=pathlib.Path, metavar="BENCH.json",
                        help="file written by 'dsakit bench --json'")
    parser.add_argument("prefix", metavar="OUT_PREFIX",
                        help="output path prefix; writes OUT_PREFIX-{curves,decision,speedup}.FMT")
    parser.add_argument("--format", choices=("png", "svg"), default="png",
                        help="image format (default: png)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        doc = load_bench(args.bench)
    except BenchFormatError as e:
        print(f"plot_bench: {e}", file=sys.stderr)
        return 2
    version = doc.get("version")
    if version != KNOWN_VERSION:
        print(f"note: {args.bench}: version {version!r}, expected {KNOWN_VERSION}; "
              "plotting the fields it has")
    if doc.get("complete") is False:
        print(f"note: {args.bench} is partial (\"complete\": false); plotting the rows it has")
    for message in plot(doc, args.prefix, args.format):
        print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
