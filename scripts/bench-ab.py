#!/usr/bin/env python3
"""Compares two builds' kda-bench outputs measured in the same GPU session, as ratios.

Usage: bench-ab.py A_LABEL B_LABEL A_1.md B_1.md [A_2.md B_2.md ...]
Each file is one kda-bench run (markdown tables). Runs are interleaved A, B, A, B, ... by the
caller, so that clock and thermal drift hit both builds alike. For every prefill case (ms) and
decode batch (us per step) it prints the median over the runs of each build and B / A.
"""
import statistics
import sys


def parse(path):
    """{(table, key): time} from one kda-bench output."""
    times = {}
    table = None
    ms_column = None  # the prefill table's "ms" column, from its header row
    us_column, state_column = 1, None  # the decode table's; older outputs have no state column
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("### "):
                table = "prefill" if "prefill" in line else "decode" if "decode" in line else "host"
                continue
            if not line.startswith("|") or line.startswith("|---") or table is None:
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if table == "prefill" and "ms" in cells:
                ms_column = cells.index("ms")
                continue
            if table == "decode" and "us per step" in cells:
                us_column = cells.index("us per step")
                state_column = cells.index("state") if "state" in cells else None
                continue
            try:
                if table == "prefill" and ms_column is not None and len(cells) > ms_column:
                    times[(table, cells[0])] = float(cells[ms_column])
                elif table == "decode" and len(cells) > us_column:
                    state = cells[state_column] if state_column is not None else "f32"
                    times[(table, f"B={int(cells[0])} {state}")] = float(cells[us_column])
                elif table == "host" and len(cells) >= 4:
                    times[(table, cells[0] + " (checks on)")] = float(cells[2])
                    times[(table, cells[0] + " (checks off)")] = float(cells[3])
            except ValueError:
                continue  # a header row
    return times


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
