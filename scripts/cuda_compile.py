"""The CUDA build's compile commands, rewritten for the scripts that look at its kernels without a GPU
(sass-compare.py, kernel-resources.py)."""
import json
import os
import shlex
import subprocess
import sys


def repository_root():
    return subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()


def compile_commands(root):
    """{absolute source path: compile_commands.json entry} of the configured CUDA build
    (KDA_CUDA_BUILD, default build-cuda); exits 2 with a message when there is none."""
    build = os.path.join(root, os.environ.get("KDA_CUDA_BUILD", "build-cuda"))
    try:
        with open(os.path.join(build, "compile_commands.json")) as f:
            commands = json.load(f)
    except OSError as err:
        print(f"no compile commands in {build} ({err}): configure a CUDA build first "
              "(cmake --preset cuda)", file=sys.stderr)
        sys.exit(2)
    return {os.path.realpath(e["file"]): e for e in commands if e["file"].endswith(".cu")}


def sm90a_command(entry, root, source_root, out, extra):
    """The build's command for one source, compiled from source_root's tree for sm_90a alone, without
    line information or dependency files, with `extra` (e.g. ["-cubin"]) and writing `out`."""
    args = shlex.split(entry["command"])
    result, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg in ("-o", "-MT", "-MF"):
            skip = True
            continue
        if arg in ("-c", "-lineinfo", "-MD", "-G"):
            continue
        if arg.startswith("--generate-code=") or arg.startswith("-gencode"):
            continue
        result.append(arg.replace(root, source_root))
    return result + ["-arch=sm_90a"] + extra + ["-o", out]
