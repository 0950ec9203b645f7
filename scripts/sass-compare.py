#!/usr/bin/env python3
"""Compares the sm_90a machine code of CUDA sources at a revision and in the working tree.

    scripts/sass-compare.py REV FILE.cu [FILE.cu ...]

A change meant to leave the kernels as they were (a refactor, a comment, a rename of a host-side
name) needs no GPU to show it: each FILE (a path from the repository's root) is compiled to a cubin
as the CUDA build compiles it (its command from BUILD/compile_commands.json; KDA_CUDA_BUILD, default
build-cuda, a configured CUDA build such as the `cuda` preset's), without line information, once
from REV's tree (exported into a temporary folder) and once from the working tree, and each
kernel's code section (.text.<kernel>) is compared byte for byte. Prints a line a kernel; exits 0
when every kernel of every file is the same, 1 when any differs or is only on one side, 2 on a
usage or build error. Needs nvcc, no GPU.
"""
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_compile  # noqa: E402


def text_sections(path):
    """The .text.<kernel> sections of an ELF64 little-endian cubin, by kernel name."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not an ELF64 file")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    sections = {}
    for name_off, _type, _flags, _addr, offset, size, *_ in headers:
        end = data.index(b"\0", names_at + name_off)
        name = data[names_at + name_off : end].decode()
        if name.startswith(".text."):
            # An anonymous namespace's mangled name carries a hash of the source's path.
            kernel = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__", name[len(".text.") :])
            sections[kernel] = data[offset : offset + size]
    return sections


def main():
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    rev, files = sys.argv[1], sys.argv[2:]
    root = cuda_compile.repository_root()
    by_file = cuda_compile.compile_commands(root)
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        old_root = os.path.join(tmp, "rev")
        os.mkdir(old_root)
        archive = subprocess.run(["git", "-C", root, "archive", rev], capture_output=True)
        if archive.returncode != 0:
            print(archive.stderr.decode().strip(), file=sys.stderr)
            return 2
        subprocess.run(["tar", "-x", "-C", old_root], input=archive.stdout, check=True)
        for rel in files:
            entry = by_file.get(os.path.realpath(os.path.join(root, rel)))
            if entry is None:
                print(f"{rel}: not a CUDA source of the build", file=sys.stderr)
                return 2
            sides = {}
            for side, source_root in (("rev", old_root), ("tree", root)):
                out = os.path.join(tmp, f"{side}.cubin")
                cmd = cuda_compile.sm90a_command(entry, root, source_root, out, ["-cubin"])
                built = subprocess.run(cmd, capture_output=True, text=True,
                                       cwd=entry.get("directory", root))
                if built.returncode != 0:
                    print(f"{rel} ({side}): nvcc failed\n{built.stderr[-2000:]}", file=sys.stderr)
                    return 2
                sides[side] = text_sections(out)
            before, after = sides["rev"], sides["tree"]
            for kernel in sorted(set(before) | set(after)):
                a, b = before.get(kernel), after.get(kernel)
                if a is None or b is None:
                    verdict = "only in the tree" if a is None else f"only at {rev}"
                    status = 1
                elif a == b:
                    verdict = f"same ({len(a)} bytes)"
                else:
                    verdict = f"differs ({len(a)} -> {len(b)} bytes)"
                    status = 1
                print(f"{rel}: {kernel}: {verdict}")
    print("every kernel the same" if status == 0 else "some kernels differ")
    return status


if __name__ == "__main__":
    sys.exit(main())
