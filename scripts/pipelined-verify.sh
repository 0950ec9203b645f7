#!/usr/bin/env bash
# What the pipelined prefill (branch `pipelined`) needs before it can merge, in as few device
# calls as possible (docs/PERFORMANCE-NOTES.md v19). Run here first: scripts/ab-prepare.sh main
# (the A/B's base), then on the GPU machine, carry [".gpudeps", ".ab"]:
#   scripts/pipelined-verify.sh quick    build; racecheck of the smallest pipelined case and the
#                                        graph-captured one (the gate: stops on any hazard);
#                                        ctest -L gpu; 3-round A/B against .ab/<base> (~4 min)
#   scripts/pipelined-verify.sh sanitize every GPU test under the four tools (gpu-check.sh
#                                        sanitize-all; KDA_SANITIZE_PART=operator|others halves it)
# The device tool brings back at most 8 files of $OUT: gpu-check.sh writes into /tmp/gc-out, and
# $OUT gets verify.txt (the summary) and, where they were made, sanitizers.md,
# sanitizer-logs.tar.gz and bench-ab.md.
set -uo pipefail
what=${1:-quick}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
OUT=${OUT:-/tmp/kda-out}
mkdir -p "$OUT"
export KDA_GPU_BUILD=${KDA_GPU_BUILD:-/tmp/kda-gpu-build}
export LD_LIBRARY_PATH=$root/.gpudeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
t0=$(date +%s)
log() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a "$OUT/verify.txt"; }
gc=/tmp/gc-out
mkdir -p "$gc"
if [ "$what" = sanitize ]; then
  OUT=$gc bash scripts/gpu-check.sh sanitize-all > "$gc/gpu-check.txt" 2>&1
  log "sanitize-all rc $?"
  cp "$gc/sanitizers.md" "$gc/sanitizer-logs.tar.gz" "$OUT/" 2>/dev/null
  cat "$gc/sanitizers.md" >> "$OUT/verify.txt"
  exit 0
fi
OUT=$gc bash scripts/gpu-check.sh none > "$gc/gpu-check.txt" 2>&1 || {
  log "build failed"
  tail -30 "$gc/gpu-check.txt" | tee -a "$OUT/verify.txt"
  exit 1
}
log "built"
op=$KDA_GPU_BUILD/tests/test_kda_operator
timeout 200 compute-sanitizer --tool racecheck --error-exitcode 1 "$op" \
  '-tc=*matches the CPU backend [cuda],*graph-captured pipelined*' '-sc=pipelined: H32 T512*' \
  > /tmp/racecheck.log 2>&1
r=$?
log "racecheck (pipelined H32 T512, graph-captured pipelined) rc $r:" \
  "$(grep -E 'RACECHECK SUMMARY' /tmp/racecheck.log | tail -1)"
if [ $r -ne 0 ]; then
  grep -A4 -E 'Error|Warning' /tmp/racecheck.log | head -40 | tee -a "$OUT/verify.txt"
  exit 1
fi
ctest --test-dir "$KDA_GPU_BUILD" -L gpu --output-on-failure -j4 --timeout 300 > /tmp/ctest.log 2>&1
log "ctest -L gpu rc $?: $(grep -E 'tests passed|tests failed' /tmp/ctest.log)"
"$op" '-tc=*matches the CPU backend [cuda]' '-sc=pipelined*,scale: no*' 2>&1 |
  grep -E '^(pipelined|scale: no)|test cases' >> "$OUT/verify.txt"
base=$(find .ab -mindepth 1 -maxdepth 1 -type d -printf "%f\n" 2>/dev/null | head -1)
if [ -n "$base" ]; then
  OUT=$gc KDA_AB_ROUNDS=3 bash scripts/gpu-check.sh ab "$base" --prefill --iters 10 > /tmp/ab.log 2>&1
  log "A/B against .ab/$base rc $?"
  cp "$gc/bench-ab.md" "$OUT/" 2>/dev/null
  grep -E 'prefill' /tmp/ab.log >> "$OUT/verify.txt"
fi
log "done"
