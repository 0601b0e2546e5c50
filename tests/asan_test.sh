#!/usr/bin/env bash
# The CPU tests (dpt_tests) again in a build of their own under AddressSanitizer (leaks
# included) and UndefinedBehaviorSanitizer: any report fails the run. The build is without
# CUDA and makes only what it runs (the library and dpt_tests): the GPU tests and the CLI
# are built without CUDA by README's command on any machine without the toolkit, and
# building them here too doubled this test's time (the slowest of the suite).
# Usage: asan_test.sh SOURCE_DIR BUILD_DIR CMAKE GENERATOR
set -eu
src=$1 build=$2 cmake=$3 generator=$4
start=$SECONDS
mkdir -p "$build"
# -O1, as ASan's documentation advises: the tests run twice as fast as at -O0. -g1 (line
# tables, no variables) is all a report's stack needs, and builds in 236 s where -g took
# about 350 (two cores, 2026-12-07). A unity build (CMake joins a folder's sources into a
# few files) built in 205 s where the same build file by file took 289 (two cores, nothing
# beside it, 2026-12-08); the sources whose file-local helpers share a name with another's
# are marked SKIP_UNITY_BUILD_INCLUSION in their CMakeLists.txt (a new one shows here as a
# redefinition).
flags="-O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
"$cmake" -S "$src" -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
  -DCMAKE_CXX_FLAGS="$flags" \
  -DDPT_ENABLE_CUDA=OFF -DDPT_BUILD_TESTS=ON -DCMAKE_UNITY_BUILD=ON >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
"$cmake" --build "$build" --target dpt_tests >"$build/build.log" 2>&1 || { tail -n 80 "$build/build.log"; exit 1; }
built=$SECONDS
ASAN_OPTIONS=detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1 \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$build/tests/dpt_tests"
echo "asan: built in $((built - start)) s, tests ran clean in $((SECONDS - built)) s"
