#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from the JSON of `dsakit bench --json`.

For each (config, heads, layout, weights) group: fresh prompts (dense, sparse, rule, cost ms and the
speed-ups over always-sparse), the shapes where the rule mode is measurably slower than the best
path, and the cost mode against the per-shape oracle (best of dense and sparse measured); then a
one-line summary per group. Standard library only.

    tools/bench_report.py BENCH.json [BENCH2.json ...] > tables.md
    tools/bench_report.py OLD.json NEW.json --merge ALL.json   # rows of later files win

Several files are read as one run: a row of a later file replaces the row of an earlier one with
the same group and shape (a re-measured subset over a full grid).
"""
import argparse
import json
import sys


def group_key(row):
    w8 = " w8" if row.get("weights") == "fp8" else ""
    return f"{row['config']} H={row['heads']} {row['layout']}{w8}"


def ms(row, mode):
    m = row["modes"].get(mode)
    return None if m is None else m["ms"]


def fmt(v, digits=3):
    return "–" if v is None else f"{v:.{digits}f}"


def letter(row, mode):
    m = row["modes"].get(mode)
    if m is None:
        return ""
    return {"dense_mha": " D", "sparse_mla": " S"}.get(m["path"], " M")


def decision_ms(row, mode="cost"):
    """Forced-mode time of the whole-batch path `mode` chose (its own time for a split): the
    decision judged on the same measurements as the oracle."""
    chosen = row["modes"].get(mode)
    if chosen is None:
        return None
    same = {"dense_mha": "dense", "sparse_mla": "sparse"}.get(chosen["path"])
    return ms(row, same) if same and same in row["modes"] else chosen["ms"]


def rule_regret(row):
    d = decision_ms(row, "rule")
    return None if d is None or "oracle_ms" not in row else d / row["oracle_ms"]


def merged_rows(docs):
    rows = {}
    for d in docs:
        for r in d["rows"]:
            rows[(group_key(r), r["label"])] = r
    return list(rows.values())


def report(docs, sections=("summary", "fresh", "rule", "cost")):
    rows = merged_rows(docs)
    groups = {}
    for r in rows:
        groups.setdefault(group_key(r), []).append(r)
    out = []
    summary = ["| group | fresh ≤ top-k: rule / sparse | cost / sparse | cost ≤ 1.03 × oracle "
               "(measured) | by decision | worst cost / oracle | rule > 1.03 × oracle | cost "
               "faster there |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rs in groups.items():
        fresh = [r for r in rs if r["kind"] == "fresh"]
        out.append(f"### {name}\n")
        if "fresh" in sections:
            out.append("| prompt | dense ms | sparse ms | rule ms | cost ms | rule × | cost × |")
            out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for r in (fresh if "fresh" in sections else []):
            out.append(f"| {r['tokens']} | {fmt(ms(r, 'dense'))} | {fmt(ms(r, 'sparse'))} | "
                       f"{fmt(ms(r, 'rule'))}{letter(r, 'rule')} | "
                       f"{fmt(ms(r, 'cost'))}{letter(r, 'cost')} | "
                       f"{fmt(r.get('speedup_rule_vs_sparse'), 2)} | "
                       f"{fmt(r.get('speedup_cost_vs_sparse'), 2)} |")
        wrong = [r for r in rs if (rule_regret(r) or 0) > 1.03]
        if wrong and "rule" in sections:
            out.append("\nShapes where the rule's path is > 3% slower than the other path "
                       "(forced-mode times):\n")
            out.append("| shape | dense ms | sparse ms | rule ms | cost ms | rule / oracle | "
                       "cost / oracle |")
            out.append("| --- | --- | --- | --- | --- | --- | --- |")
            for r in wrong:
                out.append(f"| {r['label']} | {fmt(ms(r, 'dense'))} | {fmt(ms(r, 'sparse'))} | "
                           f"{fmt(ms(r, 'rule'))}{letter(r, 'rule')} | "
                           f"{fmt(ms(r, 'cost'))}{letter(r, 'cost')} | "
                           f"{fmt(rule_regret(r), 2)} | "
                           f"{fmt(r.get('cost_vs_oracle'), 2)} |")
        off = [r for r in rs if r.get("cost_vs_oracle", 0) > 1.03]
        if off and "cost" in sections:
            out.append("\nShapes where cost mode measured > 3% above the oracle:\n")
            out.append("| shape | dense ms | sparse ms | cost ms | cost / oracle | chosen path "
                       "/ oracle |")
            out.append("| --- | --- | --- | --- | --- | --- |")
            for r in off:
                out.append(f"| {r['label']} | {fmt(ms(r, 'dense'))} | {fmt(ms(r, 'sparse'))} | "
                           f"{fmt(ms(r, 'cost'))}{letter(r, 'cost')} | "
                           f"{fmt(r.get('cost_vs_oracle'), 2)} | "
                           f"{fmt(decision_ms(r) / r['oracle_ms'], 2)} |")
        out.append("")
        sp_rule = [r["speedup_rule_vs_sparse"] for r in fresh
                   if r["max_len"] <= r["index_topk"] and "speedup_rule_vs_sparse" in r]
        sp_cost = [r["speedup_cost_vs_sparse"] for r in fresh
                   if r["max_len"] <= r["index_topk"] and "speedup_cost_vs_sparse" in r]
        with_cost = [r for r in rs if "cost_vs_oracle" in r]
        within = sum(r["cost_vs_oracle"] <= 1.03 for r in with_cost)
        by_decision = sum(decision_ms(r) / r["oracle_ms"] <= 1.03 for r in with_cost)
        worst = max(with_cost, key=lambda r: r["cost_vs_oracle"], default=None)
        cost_better = sum(1 for r in wrong if ms(r, "cost") is not None
                          and ms(r, "cost") < ms(r, "rule"))
        rng = lambda v: f"{min(v):.2f}–{max(v):.2f}×" if v else "–"
        summary.append(
            f"| {name} | {rng(sp_rule)} | {rng(sp_cost)} | {within}/{len(with_cost)} | "
            f"{by_decision}/{len(with_cost)} | "
            + (f"{worst['cost_vs_oracle']:.2f} ({worst['label']})" if worst else "–")
            + f" | {len(wrong)} | {cost_better} |")
    head = "\n".join(summary) + "\n\n" if "summary" in sections else ""
    return head + "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="files written by dsakit bench --json")
    ap.add_argument("--merge", metavar="OUT", help="also write the merged rows as one bench JSON")
    ap.add_argument("--sections", default="summary,fresh,rule,cost",
                    help="which tables: summary, fresh, rule, cost (comma list)")
    args = ap.parse_args()
    docs = []
    for path in args.json:
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            print(f"bench_report: {path}: {e}", file=sys.stderr)
            return 2
        if d.get("format") != "dsakit-bench":
            print(f"bench_report: {path}: not a dsakit bench file", file=sys.stderr)
            return 2
        docs.append(d)
    if args.merge:
        merged = dict(docs[-1])
        merged["rows"] = merged_rows(docs)
        merged["sources"] = args.json
        merged.pop("summary", None)
        with open(args.merge, "w") as f:
            json.dump(merged, f, separators=(",", ":"))
    print(report(docs, tuple(args.sections.split(","))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
