#!/usr/bin/env bash
# Installs the Debian packages kda-engine builds with, when any is missing. Quiet and a no-op when
# everything is present; runs `apt-get update` once, only when something has to be installed; uses
# sudo when not root. Arguments name other packages to check instead (scripts/format-check.sh:
# `deps.sh clang-format`).
#   KDA_SKIP_DEPS=1   skip the check (machines without apt, or dependencies from elsewhere)
set -euo pipefail

if [[ "${KDA_SKIP_DEPS:-0}" == 1 ]]; then
  exit 0
fi

packages=(cmake ninja-build g++ libeigen3-dev libyaml-cpp-dev doctest-dev nlohmann-json3-dev)
if [[ $# -gt 0 ]]; then
  packages=("$@")
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "deps.sh: not a Debian system (no dpkg-query); make sure these are installed:" \
       "${packages[*]} (or set KDA_SKIP_DEPS=1)" >&2
  exit 0
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}\n' "$package" 2>/dev/null | grep -q '^install ok installed$'; then
    missing+=("$package")
  fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

as_root=()
if [[ "$(id -u)" -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "deps.sh: missing packages: ${missing[*]}; not root and no sudo — install them as root" >&2
    exit 1
  fi
  as_root=(sudo)
fi

echo "deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq >/dev/null
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "deps.sh: done" >&2
