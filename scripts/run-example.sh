#!/usr/bin/env bash
# The main job: installs missing Debian packages, builds kda-run (Release, CUDA when a toolkit is
# found) and runs every KDA layer of Kimi-Linear-48B-A3B on synthetic inputs — on the GPU when one is
# present, else on the CPU. Arguments go to kda-run, e.g.
#   scripts/run-example.sh --tokens 1024 --backend cpu
#   scripts/run-example.sh --plan-only --json
# Passing --model, --case or --layer-case (kda-run's other inputs) replaces the default model.
#   KDA_BUILD_DIR=DIR   build directory (default: build/ in the repository)
#   KDA_SKIP_BUILD=1    run the kda-run already built there (no package check, configure or build)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${KDA_BUILD_DIR:-$root/build}"

# Build output goes to stderr, so that stdout carries only kda-run's (e.g. --plan-only --json).
if [[ "${KDA_SKIP_BUILD:-0}" != 1 ]]; then
  bash "$root/scripts/deps.sh" >&2
  bash "$root/scripts/build.sh" --target kda-run >&2
fi

model_args=(--model "$root/examples/models/kimi-linear-48b-a3b.yaml")
for arg in "$@"; do
  case "$arg" in
    --model | --model=* | --case | --case=* | --layer-case | --layer-case=*) model_args=() ;;
  esac
done
exec "$build_dir/examples/kda-run" "${model_args[@]}" "$@"
