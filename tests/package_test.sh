#!/usr/bin/env bash
# The library as others embed it: install the package into a temporary prefix, then
# build apps/example.cpp as a separate CMake project with find_package(dptrain) and run it.
set -eu
src=$1 build=$2 cmake=$3 generator=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$cmake" --install "$build" --prefix "$tmp/prefix" >/dev/null
mkdir -p "$tmp/app"
cp "$src/apps/example.cpp" "$tmp/app/"
cat >"$tmp/app/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(embed LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(dptrain REQUIRED)
add_executable(example example.cpp)
target_link_libraries(example PRIVATE dptrain::dptrain)
CM
"$cmake" -S "$tmp/app" -B "$tmp/app/build" -G "$generator" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
"$cmake" --build "$tmp/app/build" >/dev/null
"$tmp/app/build/example"
