#!/usr/bin/env bash
# A same-run A/B of launcher settings (the KDA_PREFILL_* knobs of kda/src/cuda/prefill.cu) on
# one build, on the GPU machine: kda-bench of this tree under each setting, round-robin for
# KDA_AB_ROUNDS rounds (default 3), then every setting against the first as ratios
# (scripts/bench-ab.py). A setting is a space-separated list of VAR=VALUE ("-" for none):
# With .gpudeps/ in the working tree:
#   scripts/ab-env.sh - "KDA_PREFILL_PIPELINE=0" -- --prefill --iters 10
# Output: one summary file, $OUT/ab-env.md.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
OUT=${OUT:-/tmp/kda-out}
mkdir -p "$OUT"
settings=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do settings+=("$1"); shift; done
[ $# -gt 0 ] && shift  # the "--"
[ ${#settings[@]} -ge 2 ] || { echo "ab-env.sh: needs two settings or more before --" >&2; exit 2; }
export KDA_GPU_BUILD=${KDA_GPU_BUILD:-/tmp/kda-gpu-build}
export LD_LIBRARY_PATH=$root/.gpudeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
report=$OUT/ab-env.md
echo "# kda-bench under ${#settings[@]} settings against '${settings[0]}', $(date -u +%F), args: $*" \
  > "$report"
OUT=/tmp/ab-env-build KDA_GPU_TARGETS=kda-bench bash scripts/gpu-check.sh none \
  > /tmp/ab-env-build.log 2>&1 || { echo "build failed" | tee -a "$report"; tail -20 /tmp/ab-env-build.log; exit 1; }
bench=$KDA_GPU_BUILD/bench/kda-bench
rounds=${KDA_AB_ROUNDS:-3}
for round in $(seq 1 "$rounds"); do
  for i in "${!settings[@]}"; do
    vars=()
    [ "${settings[$i]}" = - ] || read -r -a vars <<< "${settings[$i]}"
    env "${vars[@]}" "$bench" "$@" > "/tmp/ab-env-$i-$round.md" 2>&1 ||
      { echo "setting '${settings[$i]}': kda-bench failed:" | tee -a "$report";
        tail -5 "/tmp/ab-env-$i-$round.md" | tee -a "$report"; exit 1; }
  done
done
for i in "${!settings[@]}"; do
  [ "$i" = 0 ] && continue
  runs=()
  for round in $(seq 1 "$rounds"); do runs+=("/tmp/ab-env-0-$round.md" "/tmp/ab-env-$i-$round.md"); done
  { echo; echo "## '${settings[$i]}' against '${settings[0]}'"; echo
    python3 scripts/bench-ab.py "base" "setting" "${runs[@]}"; } >> "$report"
done
cat "$report"
