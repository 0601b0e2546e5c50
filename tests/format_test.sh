#!/usr/bin/env bash
# House rules: every C++ and CUDA file is as clang-format 14 (Debian 12's; other majors
# lay code out differently) leaves it under .clang-format, and every text file ends in a
# newline and has no trailing whitespace (.editorconfig). Skipped (77) where there is no
# clang-format 14. Fix with: clang-format-14 -i $(git ls-files '*.cpp' '*.hpp' '*.cu' '*.cuh')
# Usage: format_test.sh SOURCE_DIR
set -u
src=$1
cd "$src" || exit 1
files() {  # tracked files when this is a git checkout, else what lies in the source folders
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files "$@"
  else
    for pattern in "$@"; do find . -path ./build -prune -o -type f -name "$pattern" -print; done | sed 's|^\./||'
  fi
}
fails=0
for f in $(files '*.cpp' '*.hpp' '*.cu' '*.cuh' '*.py' '*.sh' '*.md' '*.txt' '*.toml' '*.in' '*.cmake' '*.dict'); do
  [ -s "$f" ] || continue
  if [ "$(tail -c 1 "$f" | od -An -c | tr -d ' ')" != '\n' ]; then echo "FAIL: $f does not end in a newline"; fails=$((fails + 1)); fi
  if grep -nE '[[:space:]]+$' "$f" | head -3 | sed "s|^|FAIL: $f:|; s|\$| (trailing whitespace)|" | grep .; then
    fails=$((fails + 1))
  fi
done
cf=""
for c in clang-format-14 clang-format; do
  if command -v "$c" >/dev/null && "$c" --version | grep -q 'version 14\.'; then cf=$c; break; fi
done
if [ -z "$cf" ]; then
  echo "no clang-format 14 here: the layout check is skipped ($fails whitespace problem(s))"
  [ "$fails" -eq 0 ] && exit 77 || exit 1
fi
unformatted=$("$cf" --dry-run $(files '*.cpp' '*.hpp' '*.cu' '*.cuh') 2>&1 | grep -oE '^[^:]+:[0-9]+:[0-9]+: (warning|error)' |
  cut -d: -f1 | sort | uniq -c)
if [ -n "$unformatted" ]; then
  echo "FAIL: not laid out as .clang-format says (lines to change, file):"
  echo "$unformatted"
  fails=$((fails + 1))
fi
[ "$fails" -eq 0 ] && echo "format: every file as clang-format 14 and .editorconfig say" && exit 0
exit 1
