#!/usr/bin/env python3
"""scripts/bench-table.py and scripts/bench-ab.py on a fixture of two appended kda-bench runs
(bench-two-runs.md): the medians, the targets (met and not met, the H96 floor target failing
where the 1/2 FlashKDA one holds, a varlen batch's T as its total tokens), the geometric mean,
the softplus twin's ratios, and the A/B ratios of run 2 against run 1."""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
scripts = os.path.join(here, "..", "..", "scripts")
fixture = os.path.join(here, "bench-two-runs.md")
failures = []


def run(*args):
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        failures.append(f"{args[0]} exited {out.returncode}: {out.stderr}")
    return out.stdout


def expect(text, line):
    if line not in text:
        failures.append(f"missing: {line}")


table = run(os.path.join(scripts, "bench-table.py"), fixture)
expect(table, "| h96-1seq | 96 | 0.600 / 0.640 | 0.620 | 2.6 | 1.400 | 2.26x | "
              "<= 0.700, <= 0.605 (2.5x floor) | no |")
expect(table, "| h32-1seq | 32 | 0.450 / 0.470 | 0.460 | 5.7 | 0.980 | 2.13x | <= 0.490 | yes |")
expect(table, "| h12-24k+8k | 12 | 0.700 / 0.600 | 0.650 | 5.4 | 2.752 | 4.23x | >= 4x | yes |")
expect(table, "Geometric mean over the 3 cases with a FlashKDA figure: 2.73x (target >= 3x: not met).")
expect(table, "| softplus-h32-1seq | 0.530 | 0.460 | 1.15 | 1.20 / 1.11 |")
expect(table, "| B=64 f32 | 75.00 | 86% / 86% |")

# bench-ab.py reads each file's first run: the fixture against itself is 1.000 everywhere.
ab = run(os.path.join(scripts, "bench-ab.py"), "A", "B", fixture, fixture)
expect(ab, "| prefill (ms) | h32-1seq | 0.450 | 0.450 | 1.000 | 1 |")
expect(ab, "| decode (us) | B=64 f32 | 74.000 | 74.000 | 1.000 | 1 |")

# No run in the file: a clear error, not a traceback.
empty = subprocess.run([sys.executable, os.path.join(scripts, "bench-table.py"), os.devnull],
                       capture_output=True, text=True, check=False)
if empty.returncode != 1 or "no prefill table" not in empty.stderr:
    failures.append(f"empty input: exit {empty.returncode}, stderr {empty.stderr!r}")

for f in failures:
    print("FAIL:", f)
print(f"{'FAILED' if failures else 'passed'}: bench scripts")
sys.exit(1 if failures else 0)
