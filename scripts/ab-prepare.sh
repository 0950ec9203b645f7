#!/usr/bin/env bash
# Exports an earlier revision's source tree into .ab/<rev>/ (ignored by git), for a same-run A/B
# benchmark on the GPU machine, which gets the working tree but no git history:
#   scripts/ab-prepare.sh b97e338
#   then, there, with .gpudeps/ and .ab/ in the working tree:
#   scripts/gpu-check.sh ab b97e338 --prefill --decode
set -euo pipefail
rev=${1:?usage: scripts/ab-prepare.sh REVISION}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
short=$(git rev-parse --short "$rev")
rm -rf ".ab/$short"
mkdir -p ".ab/$short"
git archive "$rev" | tar -x -C ".ab/$short"
echo ".ab/$short ($(du -sh ".ab/$short" | cut -f1)): take .ab/ along with the working tree; then scripts/gpu-check.sh ab $short [bench args]"
