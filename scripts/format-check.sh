#!/usr/bin/env bash
# clang-format over the project's C, C++ and CUDA sources (kda/ planner/ engine/ examples/ tests/
# bench/: *.c *.h *.cpp *.hpp *.cu *.cuh; build trees and untracked ignored files are left alone),
# with the repository's .clang-format (100 columns).
#   scripts/format-check.sh            check: lists every file clang-format would change, exits 1
#   scripts/format-check.sh --fix      formats those files in place (the CMake target `format`)
#   scripts/format-check.sh --install  first installs Debian's clang-format when none is found (CI)
#   CLANG_FORMAT=/path/to/clang-format picks the binary (default: clang-format, clang-format-NN)
# Versions format some constructs differently: CI uses Debian 12's clang-format 14.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mode=check
install=0
for arg in "$@"; do
  case "$arg" in
    --fix) mode=fix ;;
    --install) install=1 ;;
    -h | --help)
      sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "format-check.sh: unknown argument '$arg' (--fix, --install, --help)" >&2
      exit 2
      ;;
  esac
done

find_clang_format() {
  if [[ -n "${CLANG_FORMAT:-}" ]]; then
    command -v "$CLANG_FORMAT" || true
    return
  fi
  local name
  for name in clang-format clang-format-{20,19,18,17,16,15,14}; do
    if command -v "$name" >/dev/null 2>&1; then
      command -v "$name"
      return
    fi
  done
}

clang_format="$(find_clang_format)"
if [[ -z "$clang_format" && "$install" == 1 ]]; then
  bash "$root/scripts/deps.sh" clang-format
  clang_format="$(find_clang_format)"
fi
if [[ -z "$clang_format" ]]; then
  echo "format-check.sh: clang-format not found${CLANG_FORMAT:+ (CLANG_FORMAT=$CLANG_FORMAT)};" \
       "install it (Debian: apt-get install clang-format) or run with --install" >&2
  exit 2
fi

# The sources: tracked and new (not ignored) files when this is a git checkout, else a directory walk
# that skips build trees.
cd "$root"
dirs=(kda layer planner engine examples tests bench)
files=()
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  while IFS= read -r -d '' file; do
    files+=("$file")
  done < <(git ls-files -z --cached --others --exclude-standard -- "${dirs[@]}")
else
  while IFS= read -r -d '' file; do
    files+=("${file#./}")
  done < <(find "${dirs[@]}" -name 'build*' -prune -o -type f -print0 2>/dev/null)
fi
sources=()
for file in "${files[@]}"; do
  case "$file" in
    *.c | *.h | *.cpp | *.hpp | *.cu | *.cuh) [[ -f "$file" ]] && sources+=("$file") ;;
  esac
done
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "format-check.sh: no sources found under ${dirs[*]}" >&2
  exit 2
fi

jobs="$(nproc 2>/dev/null || echo 2)"
if [[ "$mode" == fix ]]; then
  printf '%s\0' "${sources[@]}" | xargs -0 -n 8 -P "$jobs" "$clang_format" -i --style=file
  echo "format-check.sh: formatted ${#sources[@]} files with $("$clang_format" --version)"
  exit 0
fi

# One clang-format per file, so that every unformatted file is listed (not only the first).
unformatted="$(printf '%s\0' "${sources[@]}" | xargs -0 -n 1 -P "$jobs" sh -c \
  '"$0" --dry-run --Werror --style=file "$1" >/dev/null 2>&1 || echo "$1"' "$clang_format" |
  LC_ALL=C sort)"
if [[ -n "$unformatted" ]]; then
  count="$(printf '%s\n' "$unformatted" | wc -l)"
  echo "format-check.sh: $count of ${#sources[@]} files are not clang-formatted" \
       "($("$clang_format" --version)):" >&2
  printf '  %s\n' $unformatted >&2
  echo "fix: cmake --build <build dir> --target format  (or scripts/format-check.sh --fix)" >&2
  exit 1
fi
echo "format-check.sh: ${#sources[@]} files, all clang-formatted"
