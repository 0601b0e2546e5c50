#!/usr/bin/env bash
# The library as others embed it, following README's recipe to the letter: install the
# package into a temporary prefix, then build apps/example.cpp as a separate CMake project
# whose CMakeLists.txt says only find_package(dptrain) and target_link_libraries (no C++
# standard, no include path of its own: the exported target carries them), and run it.
# The install holds the public headers (include/dptrain) and nothing else.
set -euo pipefail
src=$1 build=$2 cmake=$3 generator=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null

installed=$(cd "$tmp/prefix/include" && find . -type f | sort)
public=$(cd "$src/include" && find . -type f | sort)
if [ "$installed" != "$public" ]; then
  echo "FAIL: the installed headers are not exactly include/dptrain:"
  diff <(echo "$public") <(echo "$installed") || true
  exit 1
fi

mkdir -p "$tmp/app"
cp "$src/apps/example.cpp" "$tmp/app/"
cat >"$tmp/app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(embed LANGUAGES CXX)
find_package(dptrain REQUIRED)
add_executable(example example.cpp)
target_link_libraries(example PRIVATE dptrain::dptrain)
CM
"$cmake" -S "$tmp/app" -B "$tmp/app/build" -G "$generator" -DCMAKE_PREFIX_PATH="$tmp/prefix" >"$tmp/configure.log" ||
  { cat "$tmp/configure.log"; exit 1; }
"$cmake" --build "$tmp/app/build" >"$tmp/build.log" || { tail -n 40 "$tmp/build.log"; exit 1; }
"$tmp/app/build/example"
