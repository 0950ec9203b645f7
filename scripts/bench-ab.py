#!/usr/bin/env python3
"""Compares two builds' kda-bench outputs measured in the same run, as ratios.

Usage: bench-ab.py A_LABEL B_LABEL A_1.md B_1.md [A_2.md B_2.md ...]
Each file is one kda-bench run (markdown tables). Runs are interleaved A, B, A, B, ... by the
caller, so that clock and thermal drift hit both builds alike. For every prefill case (ms) and
decode batch (us per step) it prints the median over the runs of each build and B / A.
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tables import parse_runs, times  # noqa: E402


def parse(path):
    """{(table, key): time} from one kda-bench output (its first run)."""
    runs = parse_runs(path)
    return times(runs[0]) if runs else {}


def main(argv):
    if len(argv) < 5 or (len(argv) - 3) % 2:
        print(__doc__)
        return 2
    a_label, b_label = argv[1], argv[2]
    files = argv[3:]
    a_runs = [parse(p) for p in files[0::2]]
    b_runs = [parse(p) for p in files[1::2]]
    keys = [k for k in a_runs[0] if all(k in r for r in a_runs + b_runs)]
    unit = {"prefill": "ms", "decode": "us", "host": "us"}
    print(f"| table | case | {a_label} | {b_label} | {b_label} / {a_label} | runs |")
    print("|---|---|---:|---:|---:|---:|")
    for key in keys:
        a = statistics.median(r[key] for r in a_runs)
        b = statistics.median(r[key] for r in b_runs)
        print(f"| {key[0]} ({unit[key[0]]}) | {key[1]} | {a:.3f} | {b:.3f} | {b / a:.3f} | {len(a_runs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
