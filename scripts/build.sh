#!/usr/bin/env bash
# Configures (once) and builds kda-engine in build/ (Release, Ninja). Used by run-example.sh and
# test.sh; arguments are passed to `cmake --build` (e.g. --target kda-run).
#   KDA_CUDA=AUTO|ON|OFF   CUDA backend (default AUTO: built when nvcc is found)
#   KDA_BUILD_DIR=DIR      build directory (default: build/ in the repository)
#   KDA_JOBS=N             parallel build jobs (default: number of cores)
#   KDA_CPU_ARCH=ARCH      -march of the CPU backend (CMake's KDA_CPU_ARCH). Unset: x86-64-v3
#                          (AVX2, FMA, BMI2, ...; the CPU backend runs 1.88x faster) when this
#                          machine's CPU has it, else the compiler's generic target; a value
#                          configured in the build directory by hand (cmake -DKDA_CPU_ARCH=native)
#                          is kept. Set but empty (KDA_CPU_ARCH=): generic x86-64, for a binary
#                          that runs on other machines. A CPU that has all of x86-64-v3 but LZCNT
#                          (/proc/cpuinfo without abm, as some virtual machines report) gets
#                          x86-64-v3 with -mno-lzcnt (CMake's KDA_CPU_FLAGS).
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

# The x86-64-v3 feature set as /proc/cpuinfo names it (abm: LZCNT, pni: SSE3), the v2 set included.
x86_64_v3_flags=(avx avx2 bmi1 bmi2 f16c fma abm movbe xsave cx16 lahf_lm popcnt pni ssse3 sse4_1
                 sse4_2)
# Whether this machine can build the CPU backend for x86-64-v3: returns 0 and sets
# v3_extra_flags (what goes after -march: nothing, or -mno-lzcnt for a CPU that has all of
# x86-64-v3 but abm, as some virtual machines report), or returns 1 and sets why_not.
x86_64_v3_usable() {
  v3_extra_flags=
  why_not=
  if [[ "$(uname -m)" != x86_64 ]]; then
    why_not="not an x86-64 machine"
    return 1
  fi
  local flags missing=()
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  for flag in "${x86_64_v3_flags[@]}"; do
    [[ "$flags" == *" $flag "* ]] || missing+=("$flag")
  done
  if [[ ${#missing[@]} -gt 0 && "${missing[*]}" != abm ]]; then
    why_not="the CPU lacks ${missing[*]}"
    return 1
  fi
  local compiler
  compiler="$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build_dir/CMakeCache.txt" 2>/dev/null)"
  compiler="${compiler:-${CXX:-c++}}"
  if ! echo | "$compiler" -march=x86-64-v3 -mno-lzcnt -x c++ -E - >/dev/null 2>&1; then
    why_not="$compiler does not know -march=x86-64-v3"
    return 1
  fi
  # Without abm the compiler must not emit LZCNT (on such a CPU lzcnt runs as bsr and returns
  # another value); the rest (AVX2, FMA) is what the CPU backend gains by.
  [[ ${#missing[@]} -eq 0 ]] || v3_extra_flags=-mno-lzcnt
  return 0
}
cached_arch="$(sed -n 's/^KDA_CPU_ARCH:[A-Z]*=//p' "$build_dir/CMakeCache.txt" 2>/dev/null || true)"
if [[ -n "${KDA_CPU_ARCH+set}" ]]; then
  configure_args+=(-DKDA_CPU_ARCH="$KDA_CPU_ARCH" -DKDA_CPU_FLAGS=)
  cpu_arch_note="${KDA_CPU_ARCH:-generic} (KDA_CPU_ARCH from the environment)"
elif [[ -n "$cached_arch" && "$cached_arch" != x86-64-v3 ]]; then
  cpu_arch_note="$cached_arch (KDA_CPU_ARCH configured in $build_dir)"
elif x86_64_v3_usable; then
  configure_args+=(-DKDA_CPU_ARCH=x86-64-v3 -DKDA_CPU_FLAGS="$v3_extra_flags")
  if [[ -z "$v3_extra_flags" ]]; then
    cpu_arch_note="x86-64-v3 (this CPU has AVX2 and FMA; KDA_CPU_ARCH= builds generic x86-64)"
  else
    cpu_arch_note="x86-64-v3 without LZCNT (this CPU has AVX2 and FMA, not abm; KDA_CPU_ARCH= builds generic x86-64)"
  fi
else
  configure_args+=(-DKDA_CPU_ARCH= -DKDA_CPU_FLAGS=)
  cpu_arch_note="the compiler's generic target ($why_not)"
fi
echo "build.sh: CPU backend built for $cpu_arch_note"
# The generator can only be chosen when the build directory is first configured.
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  configure_args+=(-G Ninja)
fi
cmake "${configure_args[@]}"
cmake --build "$build_dir" -j "$jobs" "$@"
