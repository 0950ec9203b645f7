#!/usr/bin/env bash
# Installs missing Debian packages, builds everything (Release, CUDA when a toolkit is found) and runs
# the tests. GPU tests report "skipped" when no CUDA device is present. Arguments go to ctest, e.g.
#   scripts/test.sh -L cpu        scripts/test.sh -R planner
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${KDA_BUILD_DIR:-$root/build}"

bash "$root/scripts/deps.sh"
bash "$root/scripts/build.sh"
ctest --test-dir "$build_dir" --output-on-failure -j "${KDA_TEST_JOBS:-2}" "$@"
