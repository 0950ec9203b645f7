#!/usr/bin/env python3
"""One build's kda-bench runs as the tables docs/PERFORMANCE.md keeps: each prefill case's median
over the runs against KDA.md §6's anchors (FlashKDA) and the targets of docs/PERFORMANCE.md, the
geometric mean, the softplus twins against their bounded cases, and decode.

Usage: bench-table.py RUN.md [RUN.md ...]
Each file holds one kda-bench run or several appended (scripts/bench_tables.py). Targets: §6
cases at <= 1/2 FlashKDA's time and the H96 ones at <= 2.5x their floor; low-head cases (H <= 16)
>= 2.5x FlashKDA, >= 4x where T >= 32768 (a varlen batch's T: its total tokens); the geometric
mean >= 3x.
"""
import math
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tables import number, parse_runs  # noqa: E402


def sequence_tokens(row):
    """T of a prefill row in KDA.md's layout: a fixed batch's row length ("8 x 4096": 4096), a
    varlen list's total tokens ("varlen 24576,8192": 32768; varlen runs as one row, B = 1)."""
    cell = row.get("sequences", "")
    values = [int(v) for v in re.findall(r"\d+", cell)]
    if not values:
        return 0
    return sum(values) if cell.startswith("varlen") else values[-1]


def target(name, row, ms, floor):
    """The target for a case as text, and whether `ms` meets it (None: no target)."""
    flashkda = number(row.get("FlashKDA ms"))
    if flashkda is None:
        return "-", None
    heads = int(row.get("H", "0") or 0)
    if heads > 16:
        text, ok = f"<= {flashkda / 2:.3f}", ms <= flashkda / 2
        if heads >= 96:
            text += f", <= {2.5 * floor:.3f} (2.5x floor)"
            ok = ok and ms <= 2.5 * floor
        return text, ok
    need = 4.0 if sequence_tokens(row) >= 32768 else 2.5
    return f">= {need:g}x", flashkda / ms >= need


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    runs = [run for path in argv[1:] for run in parse_runs(path)]
    runs = [run for run in runs if run.get("prefill")]
    if not runs:
        print("bench-table.py: no prefill table in the files", file=sys.stderr)
        return 1
    cases = [c for c in runs[0]["prefill"] if all(c in r["prefill"] for r in runs)]
    medians = {}
    print(f"### Prefill ({len(runs)} runs; ms: the median of the runs' medians)\n")
    print("| case | H | ms per run | ms | x floor | FlashKDA ms | vs FlashKDA | target | met |")
    print("|---|---:|---|---:|---:|---:|---:|---|---|")
    speedups = []
    for case in cases:
        row = runs[0]["prefill"][case]
        per_run = [number(r["prefill"][case].get("ms")) for r in runs]
        if any(v is None for v in per_run):
            continue
        ms = statistics.median(per_run)
        medians[case] = (ms, per_run)
        floor = number(row.get("floor ms")) or float("nan")
        flashkda = number(row.get("FlashKDA ms"))
        vs = f"{flashkda / ms:.2f}x" if flashkda else "-"
        if flashkda:
            speedups.append(flashkda / ms)
        text, ok = target(case, row, ms, floor)
        met = "-" if ok is None else ("yes" if ok else "no")
        print(f"| {case} | {row.get('H', '')} | {' / '.join(f'{v:.3f}' for v in per_run)} | "
              f"{ms:.3f} | {ms / floor:.1f} | {row.get('FlashKDA ms', '-')} | {vs} | {text} | {met} |")
    if speedups:
        geomean = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
        print(f"\nGeometric mean over the {len(speedups)} cases with a FlashKDA figure: "
              f"{geomean:.2f}x (target >= 3x: {'met' if geomean >= 3 else 'not met'}).")

    twins = [c for c in medians if c.startswith("softplus-")]
    if twins:
        print("\n### Softplus twins against their bounded cases\n")
        print("| twin | softplus ms | bounded ms | ratio of medians | ratio per run |")
        print("|---|---:|---:|---:|---|")
        for twin in twins:
            bounded = re.sub(r"^softplus-(mild-)?", "", twin)
            if bounded not in medians:
                continue
            (s_ms, s_runs), (b_ms, b_runs) = medians[twin], medians[bounded]
            per_run = " / ".join(f"{s / b:.2f}" for s, b in zip(s_runs, b_runs))
            print(f"| {twin} | {s_ms:.3f} | {b_ms:.3f} | {s_ms / b_ms:.2f} | {per_run} |")

    decode = [k for k in runs[0].get("decode", {}) if all(k in r.get("decode", {}) for r in runs)]
    if decode:
        print("\n### Decode\n")
        print("| batch | us per step (median) | % of copy bandwidth per run |")
        print("|---|---:|---|")
        for key in decode:
            us = statistics.median(number(r["decode"][key].get("us per step")) for r in runs)
            pct = " / ".join(r["decode"][key].get("% of copy bw", "-") for r in runs)
            print(f"| {key} | {us:.2f} | {pct} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
