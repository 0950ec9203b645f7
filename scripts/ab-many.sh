#!/usr/bin/env bash
# A same-run A/B of several revisions on the GPU machine: kda-bench of every tree under .ab/
# (export each with scripts/ab-prepare.sh REV), run round-robin for KDA_AB_ROUNDS rounds (default
# 3; the order reversed every other round; --host runs pinned to one core), then each tree against
# the base as ratios (scripts/bench-ab.py): KDA_AB_BASE=<name under .ab/>, or the first name in
# sort order. With .gpudeps/ and .ab/ in the working tree:
#   scripts/ab-many.sh --prefill --iters 10
# Output: one summary file, $OUT/ab-many.md.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 1
OUT=${OUT:-/tmp/kda-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$root/.gpudeps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
mapfile -t trees < <(find .ab -mindepth 1 -maxdepth 1 -type d -printf '%f\n' | sort)
[ ${#trees[@]} -ge 2 ] || { echo "ab-many.sh: needs two trees or more under .ab/" >&2; exit 2; }
report=$OUT/ab-many.md
echo "# kda-bench A/B of ${trees[*]} against ${KDA_AB_BASE:-${trees[0]}}, $(date -u +%F), args: $*" \
  > "$report"
for t in "${trees[@]}"; do
  b=/tmp/ab-many-build-$t
  { cmake -S ".ab/$t" -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$root/.gpudeps/usr" -DKDA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a &&
    cmake --build "$b" -j16 --target kda-bench; } > "/tmp/ab-many-build-$t.log" 2>&1 || {
    echo "build of .ab/$t failed:" | tee -a "$report"
    grep -E "error" -A3 "/tmp/ab-many-build-$t.log" | head -20 | tee -a "$report"
    exit 1
  } &
done
wait
for t in "${trees[@]}"; do
  [ -x "/tmp/ab-many-build-$t/bench/kda-bench" ] || { cat "$report"; exit 1; }
done
# Host-time rows (--host) move with the host CPU's scheduling: each run on one core. Rounds
# alternate the trees' order (ABC, CBA, ...), so that a drift over the call favours none of them.
pin=()
case " $* " in *" --host "*) command -v taskset > /dev/null && pin=(taskset -c 1) ;; esac
for round in $(seq 1 "${KDA_AB_ROUNDS:-3}"); do
  order=("${trees[@]}")
  if [ $((round % 2)) = 0 ]; then
    order=()
    for ((i = ${#trees[@]} - 1; i >= 0; i--)); do order+=("${trees[i]}"); done
  fi
  for t in "${order[@]}"; do
    "${pin[@]}" "/tmp/ab-many-build-$t/bench/kda-bench" "$@" > "/tmp/ab-many-$t-$round.md" 2>&1
  done
done
base=${KDA_AB_BASE:-${trees[0]}}
for t in "${trees[@]}"; do
  [ "$t" = "$base" ] && continue
  runs=()
  for round in $(seq 1 "${KDA_AB_ROUNDS:-3}"); do
    runs+=("/tmp/ab-many-$base-$round.md" "/tmp/ab-many-$t-$round.md")
  done
  { echo; echo "## $t against $base"; echo; python3 scripts/bench-ab.py "$base" "$t" "${runs[@]}"; } \
    >> "$report"
done
cat "$report"
