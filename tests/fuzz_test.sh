#!/usr/bin/env bash
# Fuzzes the checkpoint loader (dpt::ckpt::parse) with libFuzzer, under AddressSanitizer
# and UndefinedBehaviorSanitizer, for a bounded time from the seed corpus in
# tests/fuzz_corpus (made by tests/fuzz_seeds.py). A crash, a sanitizer report, an
# exception other than dpt::Error, a single allocation over 64 MiB or an input taking
# over 10 s fails the test, and the input is printed (base64) to reproduce it with.
# Skipped (exit 77) where there is no clang++ with libFuzzer.
# Usage: fuzz_test.sh SOURCE_DIR [SECONDS]
set -u
src=$1 seconds=${2:-30}
cxx=""
for c in clang++ clang++-{20..14}; do
  if command -v "$c" >/dev/null; then cxx=$c; break; fi
done
if [ -z "$cxx" ]; then
  echo "no clang++ here: the checkpoint fuzzer is skipped"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$tmp/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer "$tmp/probe.cpp" -o "$tmp/probe" 2>/dev/null; then
  echo "$cxx has no libFuzzer runtime here: the checkpoint fuzzer is skipped"
  exit 77
fi
# The loader depends on nothing but the standard library and <dptrain/error.hpp>; its
# header parser is data/safetensors.cpp, which data files share.
if ! "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I "$src/include" "$src/tests/fuzz_checkpoint.cpp" "$src/train/checkpoint.cpp" "$src/train/atomic_file.cpp" \
    "$src/data/safetensors.cpp" "$src/data/array.cpp" -o "$tmp/fuzz"; then
  echo "FAIL: the fuzz target does not build"
  exit 1
fi
mkdir "$tmp/corpus"  # new inputs go here, the seeds stay as they are
# libFuzzer's own exit code for a finding is 77, which ctest would read as "skipped".
"$tmp/fuzz" "$tmp/corpus" "$src/tests/fuzz_corpus" -dict="$src/tests/fuzz_checkpoint.dict" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -malloc_limit_mb=64 -rss_limit_mb=2048 \
  -error_exitcode=1 -timeout_exitcode=1 -artifact_prefix="$tmp/" -print_final_stats=1 >"$tmp/log" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
  tail -n 60 "$tmp/log"
  for f in "$tmp"/crash-* "$tmp"/leak-* "$tmp"/timeout-* "$tmp"/oom-* "$tmp"/slow-unit-*; do
    [ -e "$f" ] && echo "reproducer $(basename "$f") (base64): $(base64 -w0 "$f")"
  done
  echo "FAIL: the checkpoint fuzzer found a problem (exit $rc)"
  exit 1
fi
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$tmp/log")
echo "checkpoint fuzzer: ${runs:-?} inputs in ${seconds} s, $(ls "$tmp/corpus" | wc -l) new corpus entries, no finding"
