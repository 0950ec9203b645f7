#!/usr/bin/env bash
# Builds the libFuzzer harnesses (preset `fuzz`: clang, ASan + UBSan + LSan, CPU only) and runs each
# for SECONDS (default 30) over a copy of its seed corpus (tests/fuzz/corpus/<name>). Exits non-zero
# when a harness finds anything (crash, sanitizer report, leak, timeout, exception other than
# kda::Error); the input that triggered it is saved in the artifacts directory, named at the end.
#   scripts/fuzz.sh [SECONDS]
#   KDA_FUZZ_BUILD_DIR=DIR   build directory (default: build-fuzz/ in the repository)
#   KDA_FUZZ_ARTIFACTS=DIR   where findings and logs go (default: DIR/fuzz-artifacts)
#   KDA_JOBS=N               parallel build jobs (default: number of cores)
#   KDA_SKIP_DEPS=1          do not install missing Debian packages
#   KDA_FUZZ_SEED=N          libFuzzer seed (default 1; 0 = random)
# Reproduce a finding: build-fuzz/tests/fuzz/fuzz_<name> <artifact file>
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-30}"
# A fixed seed by default, so that CI replays a prefix of the same input sequence that longer local
# runs with this seed have already explored (KDA_FUZZ_SEED=0 lets libFuzzer pick one).
seed="${KDA_FUZZ_SEED:-1}"
build_dir="${KDA_FUZZ_BUILD_DIR:-$root/build-fuzz}"
artifacts="${KDA_FUZZ_ARTIFACTS:-$build_dir/fuzz-artifacts}"
jobs="${KDA_JOBS:-$(nproc 2>/dev/null || echo 2)}"
harnesses=(model_spec safetensors operator engine)

if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [[ "$seconds" -lt 1 ]]; then
  echo "fuzz.sh: SECONDS must be a positive integer, got '$seconds'" >&2
  exit 2
fi

bash "$root/scripts/deps.sh"

# libFuzzer ships with clang's runtime libraries (Debian: clang + libclang-rt-dev). Check that a
# fuzzer actually links, not only that clang exists.
fuzzer_links() {
  command -v clang++ >/dev/null 2>&1 || return 1
  local probe
  probe="$(mktemp -d)"
  printf '%s\n' '#include <cstddef>' '#include <cstdint>' \
    'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' >"$probe/p.cpp"
  local ok=0
  clang++ -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" >/dev/null 2>&1 || ok=1
  rm -rf "$probe"
  return "$ok"
}
if ! fuzzer_links; then
  if [[ "${KDA_SKIP_DEPS:-0}" == 1 ]]; then
    echo "fuzz.sh: clang++ cannot link -fsanitize=fuzzer (install clang and libclang-rt-dev)" >&2
    exit 1
  fi
  as_root=()
  if [[ "$(id -u)" -ne 0 ]]; then as_root=(sudo); fi
  echo "fuzz.sh: installing clang libclang-rt-dev" >&2
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -qq >/dev/null
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-dev >/dev/null
  if ! fuzzer_links; then
    echo "fuzz.sh: clang++ still cannot link -fsanitize=fuzzer" >&2
    exit 1
  fi
fi

# Configure once (the preset fixes the compiler, which can only be chosen on the first configure);
# build only the harnesses and the libraries they link.
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake --preset fuzz -S "$root" -B "$build_dir" >/dev/null
fi
cmake --build "$build_dir" -j "$jobs" --target "${harnesses[@]/#/fuzz_}"

mkdir -p "$artifacts"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

failed=()
for name in "${harnesses[@]}"; do
  harness="$build_dir/tests/fuzz/fuzz_$name"
  cp -r "$root/tests/fuzz/corpus/$name" "$work/$name"
  log="$artifacts/fuzz_$name.log"
  echo "fuzz.sh: fuzz_$name for ${seconds}s (log: $log)"
  # -timeout: one input running 30 s is a hang; -rss_limit_mb: runaway memory is a finding too.
  # A dictionary where the input is text (the structured operator harness has none).
  dict=()
  if [[ -f "$root/tests/fuzz/$name.dict" ]]; then dict=(-dict="$root/tests/fuzz/$name.dict"); fi
  if "$harness" "$work/$name" -seed="$seed" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=2560 \
       "${dict[@]}" -artifact_prefix="$artifacts/fuzz_$name-" \
       -print_final_stats=1 >"$log" 2>&1; then
    grep -E '^stat::number_of_executed_units' "$log" | sed "s/^/fuzz.sh: fuzz_$name /" || true
  else
    failed+=("$name")
    echo "fuzz.sh: fuzz_$name FOUND A PROBLEM; last lines of its log:" >&2
    tail -n 60 "$log" >&2
  fi
done

if [[ ${#failed[@]} -ne 0 ]]; then
  echo "fuzz.sh: findings in: ${failed[*]}; inputs saved as $artifacts/fuzz_<name>-*" >&2
  ls -l "$artifacts" >&2 || true
  exit 1
fi
echo "fuzz.sh: no findings (${seconds}s per harness)"
