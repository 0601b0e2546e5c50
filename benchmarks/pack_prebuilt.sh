#!/usr/bin/env bash
# Packs the binaries that the GPU machine's scripts run with PREBUILT=1 (multi_gpu_check.sh,
# gpt_scaling.sh, compare.sh gpt) into one archive to carry there: a build on an 8-GPU
# machine takes minutes of its 10-minute command, and a carried folder is at most 64 MiB.
# Builds them here (the CUDA toolkit compiles without a GPU), strips them and writes
# ARCHIVE (default .dev/prebuilt.tar.xz) with build/'s paths; on the GPU machine:
#   tar xJf ARCHIVE && PREBUILT=1 bash benchmarks/multi_gpu_check.sh
# cudart is linked statically; cuBLAS, NCCL and cuDNN come from the GPU machine.
set -eu
cd "$(dirname "$0")/.."
archive=${1:-.dev/prebuilt.tar.xz}
bins=(build/tests/dpt_gpu_tests build/tests/ddp_check build/apps/dptrain build/benchmarks/dpbench
  build/benchmarks/step_bench)
[ -f build/build.ninja ] || cmake -S . -B build -G Ninja -DDPT_WERROR=ON >/dev/null
cmake --build build --target dpt_gpu_tests ddp_check dptrain_cli dpbench step_bench >/dev/null
grep -qE "^CMAKE_CUDA_COMPILER:[A-Z]+=/" build/CMakeCache.txt ||
  { echo "pack_prebuilt: build/ has no CUDA: the GPU machine needs a CUDA build" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for bin in "${bins[@]}"; do
  mkdir -p "$stage/$(dirname "$bin")"
  strip -o "$stage/$bin" "$bin"
done
mkdir -p "$(dirname "$archive")"
tar -C "$stage" -cJf "$archive" "${bins[@]}"
echo "pack_prebuilt: $archive, $(du -h "$archive" | cut -f1) ($(printf '%s ' "${bins[@]}"))"
