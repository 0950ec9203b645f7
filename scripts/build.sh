#!/usr/bin/env bash
# Configures (once) and builds kda-engine in build/ (Release, Ninja). Used by run-example.sh and
# test.sh; arguments are passed to `cmake --build` (e.g. --target kda-run).
#   KDA_CUDA=AUTO|ON|OFF   CUDA backend (default AUTO: built when nvcc is found)
#   KDA_BUILD_DIR=DIR      build directory (default: build/ in the repository)
#   KDA_JOBS=N             parallel build jobs (default: number of cores)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${KDA_BUILD_DIR:-$root/build}"
jobs="${KDA_JOBS:-$(nproc 2>/dev/null || echo 2)}"

# CMake looks for nvcc on PATH only; the toolkit's default location is often not on it.
if ! command -v nvcc >/dev/null 2>&1 && [[ -z "${CUDACXX:-}" ]]; then
  for cuda_bin in "${CUDA_HOME:-}/bin" "${CUDA_PATH:-}/bin" /usr/local/cuda/bin; do
    if [[ "$cuda_bin" != /bin && -x "$cuda_bin/nvcc" ]]; then
      export PATH="$PATH:$cuda_bin"
      break
    fi
  done
fi

configure_args=(-S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DKDA_CUDA="${KDA_CUDA:-AUTO}")
# The generator can only be chosen when the build directory is first configured.
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  configure_args+=(-G Ninja)
fi
cmake "${configure_args[@]}"
cmake --build "$build_dir" -j "$jobs" "$@"
