#!/usr/bin/env bash
# A machine without the CUDA toolkit builds dptrain for the CPU (README's two commands,
# .ci/deps), taking the other side of every `#if DPT_WITH_CUDA`. On a CUDA machine that
# side is never compiled, so a variable only the CUDA side reads can break the CPU build
# unseen (-Werror). Here each source file with such a branch is compiled, syntax only,
# with the macros off and the build's warnings as errors.
# Usage: cpu_only_test.sh SOURCE_DIR CXX
set -u
src=$1
cxx=$2
cd "$src" || exit 1
flags=(-std=c++20 -fsyntax-only -DDPT_WITH_CUDA=0 -DDPT_WITH_CUDNN=0 -DDPT_WITH_CUDNN_FRONTEND=0 -Iinclude -I.
  -Itests -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Wno-restrict -Werror)
files=$(grep -rlE 'DPT_WITH_(CUDA|CUDNN)' --include='*.cpp' apps benchmarks common data layers optim parallel \
  runtime tests train 2>/dev/null | sort)
[ -n "$files" ] || { echo "FAIL: no source file with a DPT_WITH_CUDA branch found under $src"; exit 1; }
fails=0
for f in $files; do
  if ! out=$("$cxx" "${flags[@]}" "$f" 2>&1); then
    echo "FAIL: $f without CUDA:"
    echo "$out" | grep -E 'error' | head -5
    fails=$((fails + 1))
  fi
done
echo "$(echo "$files" | wc -w) files compiled without CUDA, $fails failed"
[ "$fails" -eq 0 ]
