#!/usr/bin/env bash
# Training from files against training on synthetic data, on one GPU, in one call: the
# mlp workload (4096 rows of 1024 floats and 1024 targets a step, 32 MiB of input) and
# the seed workload (64 rows of 1000) from .npy files in the page cache, through dptrain's
# CLI (synthetic, --data in file order, --data shuffled) and through PyTorch's DataLoader
# loop over the same files (benchmarks/torch_file_bench.py). dptrain's summary gives the
# input pipeline's host gather rate and the copies' share of a step.
# Usage: file_data_bench.sh [BUILD_DIR] (build). Logs go to $OUT or /tmp/dpt_file_bench.
set -u
cd "$(dirname "$0")/.." || exit 1
build=${1:-build}
out=${OUT:-/tmp/dpt_file_bench}
mkdir -p "$out"
if [ ! -x "$build/apps/dptrain" ]; then
  cmake -S . -B "$build" -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 &&
    cmake --build "$build" --target dptrain_cli >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
fi
python3 - "$out" <<'PY'
import sys
import numpy as np
out = sys.argv[1]
rng = np.random.default_rng(0)
for name, rows, width in (("mlp", 32768, 1024), ("seed", 8192, 1000)):
    np.save(f"{out}/{name}_x.npy", rng.standard_normal((rows, width), dtype=np.float32))
    np.save(f"{out}/{name}_y.npy", rng.standard_normal((rows, width), dtype=np.float32))
PY
dptrain=$build/apps/dptrain
one() {  # one LABEL ARGS...: dptrain's summary ms/step and pipeline line
  local label=$1
  shift
  "$dptrain" --devices cuda:0 --lr 0.01 --momentum 0 --log-every 1000 "$@" >"$out/$label.log" 2>&1
  printf '%-28s %s\n' "$label" "$(grep -E '^done' "$out/$label.log" | grep -oE '[0-9.]+ ms/step')"
  grep -E '^input pipeline' "$out/$label.log" | sed 's/^/                             /'
}
for p in fp32 bf16; do
  m=(--model mlp --batch 4096 --steps 160 --precision $p)
  one "mlp $p synthetic" "${m[@]}"
  one "mlp $p file" "${m[@]}" --data "$out/mlp_x.npy" --targets "$out/mlp_y.npy" --no-shuffle
  one "mlp $p file shuffled" "${m[@]}" --data "$out/mlp_x.npy" --targets "$out/mlp_y.npy"
  python3 benchmarks/torch_file_bench.py --x "$out/mlp_x.npy" --y "$out/mlp_y.npy" --model mlp --batch 4096 \
    --precision $p --steps 160 2>&1 | tail -1
done
s=(--model seed --batch 64 --steps 3000)
one "seed fp32 synthetic" "${s[@]}"
one "seed fp32 file" "${s[@]}" --data "$out/seed_x.npy" --targets "$out/seed_y.npy"
python3 benchmarks/torch_file_bench.py --x "$out/seed_x.npy" --y "$out/seed_y.npy" --model seed --batch 64 \
  --steps 3000 2>&1 | tail -1
