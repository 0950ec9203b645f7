#!/usr/bin/env python3
"""Registers, spills, stack and shared memory of every kernel, as ptxas reports them for sm_90a.

    scripts/kernel-resources.py [--spills] [FILE.cu ...]

Compiles each CUDA source (a path from the repository's root; default: every CUDA source of the
library, kda/src and layer/src) as the configured CUDA build compiles it (KDA_CUDA_BUILD, default
build-cuda; its compile_commands.json) with `-Xptxas -v`, and prints a line a kernel, demangled:
registers, spill stores / loads and stack bytes, static shared memory. --spills prints only the
kernels that spill. A kernel that spills under its launch bounds is worth a look where it runs on
the critical path (it was so for the fused decode step: design/layer.md). Needs nvcc, no GPU.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_compile  # noqa: E402

ENTRY = re.compile(r"Compiling entry function '([^']+)' for 'sm_90a'")
USED = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$")
SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else names


def main():
    args = sys.argv[1:]
    spills_only = "--spills" in args
    files = [a for a in args if a != "--spills"]
    if any(a.startswith("-") for a in files):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    root = cuda_compile.repository_root()
    by_file = cuda_compile.compile_commands(root)
    if not files:
        files = sorted(os.path.relpath(f, root) for f in by_file
                       if os.path.relpath(f, root).startswith(("kda/src/", "layer/src/")))
    with tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            entry = by_file.get(os.path.realpath(os.path.join(root, rel)))
            if entry is None:
                print(f"{rel}: not a CUDA source of the build", file=sys.stderr)
                return 2
            cmd = cuda_compile.sm90a_command(entry, root, root, os.path.join(tmp, "k.cubin"),
                                             ["-cubin", "-Xptxas", "-v"])
            built = subprocess.run(cmd, capture_output=True, text=True,
                                   cwd=entry.get("directory", root))
            if built.returncode != 0:
                print(f"{rel}: nvcc failed\n{built.stderr[-2000:]}", file=sys.stderr)
                return 2
            rows, name, spill = [], None, None
            for line in built.stderr.splitlines():
                m = ENTRY.search(line)
                if m:
                    name, spill = m.group(1), None
                    continue
                m = SPILL.search(line)
                if m and name:
                    spill = tuple(int(x) for x in m.groups())
                    continue
                m = USED.search(line)
                if m and name:
                    stack, stores, loads = spill or (0, 0, 0)
                    rows.append((name, int(m.group(1)), stores, loads, stack, int(m.group(2) or 0)))
                    name = None
            names = demangle([r[0] for r in rows])
            print(f"## {rel}")
            for (_, regs, stores, loads, stack, smem), pretty in zip(rows, names):
                if spills_only and stores == 0 and loads == 0:
                    continue
                print(f"{regs:4d} regs  spills {stores:4d} / {loads:4d} B  stack {stack:4d} B  "
                      f"smem {smem:6d} B  {pretty}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
