#!/usr/bin/env bash
# Fuzzes a file parser with libFuzzer, under AddressSanitizer and UndefinedBehaviorSanitizer,
# for a bounded time from its seed corpus (made by tests/fuzz_seeds.py):
#   checkpoint  the checkpoint loader (dpt::ckpt::parse) and the safetensors header parser
#               it shares with data files; seeds in tests/fuzz_corpus
#   npy         the .npy header reader (dpt::data::parse_npy_header); seeds in
#               tests/fuzz_corpus_npy
# A crash, a sanitizer report, an exception other than the parser's own, a single
# allocation over 64 MiB or an input taking over 10 s fails the test, and the input is
# printed (base64) to reproduce it with. Skipped (exit 77) where there is no clang++ with
# libFuzzer.
# Usage: fuzz_test.sh SOURCE_DIR [SECONDS] [checkpoint|npy]
set -u
src=$1 seconds=${2:-30} target=${3:-checkpoint}
# Each parser depends on nothing but the standard library, POSIX, <dptrain/error.hpp> (with
# kernels/error.cpp, where its Message is defined) and common/.
case "$target" in
  checkpoint)
    sources=("$src/tests/fuzz_checkpoint.cpp" "$src/train/checkpoint.cpp" "$src/common/atomic_file.cpp"
             "$src/common/text.cpp" "$src/data/safetensors.cpp" "$src/data/array.cpp" "$src/kernels/error.cpp")
    corpus="$src/tests/fuzz_corpus" dict="$src/tests/fuzz_checkpoint.dict" what="checkpoint fuzzer" ;;
  npy)
    sources=("$src/tests/fuzz_npy.cpp" "$src/data/npy.cpp" "$src/data/array.cpp" "$src/kernels/error.cpp")
    corpus="$src/tests/fuzz_corpus_npy" dict="$src/tests/fuzz_npy.dict" what=".npy fuzzer" ;;
  *)
    echo "unknown fuzz target '$target' (checkpoint or npy)"
    exit 2 ;;
esac
cxx=""
for c in clang++ clang++-{20..14}; do
  if command -v "$c" >/dev/null; then cxx=$c; break; fi
done
if [ -z "$cxx" ]; then
  echo "no clang++ here: the $what is skipped"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$tmp/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer "$tmp/probe.cpp" -o "$tmp/probe" 2>/dev/null; then
  echo "$cxx has no libFuzzer runtime here: the $what is skipped"
  exit 77
fi
if ! "$cxx" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I "$src/include" -I "$src" "${sources[@]}" -o "$tmp/fuzz"; then
  echo "FAIL: the fuzz target does not build"
  exit 1
fi
mkdir "$tmp/corpus"  # new inputs go here, the seeds stay as they are
# libFuzzer's own exit code for a finding is 77, which ctest would read as "skipped".
"$tmp/fuzz" "$tmp/corpus" "$corpus" -dict="$dict" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -malloc_limit_mb=64 -rss_limit_mb=2048 \
  -error_exitcode=1 -timeout_exitcode=1 -artifact_prefix="$tmp/" -print_final_stats=1 >"$tmp/log" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
  tail -n 60 "$tmp/log"
  for f in "$tmp"/crash-* "$tmp"/leak-* "$tmp"/timeout-* "$tmp"/oom-* "$tmp"/slow-unit-*; do
    [ -e "$f" ] && echo "reproducer $(basename "$f") (base64): $(base64 -w0 "$f")"
  done
  echo "FAIL: the $what found a problem (exit $rc)"
  exit 1
fi
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$tmp/log")
echo "$what: ${runs:-?} inputs in ${seconds} s, $(ls "$tmp/corpus" | wc -l) new corpus entries, no finding"
