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
one() {  # one NAME ARGS...: a dptrain run into $out/NAME.log
  local name=$1
  shift
  "$dptrain" --devices cuda:0 --lr 0.01 --momentum 0 --log-every 1000 "$@" >"$out/$name.log" 2>&1 ||
    { tail -3 "$out/$name.log"; exit 1; }
}
torch_one() {  # torch_one NAME ARGS...: PyTorch's DataLoader loop into $out/NAME.log
  local name=$1
  shift
  python3 benchmarks/torch_file_bench.py "$@" >"$out/$name.log" 2>&1 || tail -3 "$out/$name.log"
}
for p in fp32 tf32 bf16; do
  m=(--model mlp --batch 4096 --steps 160 --precision $p)
  one "mlp-$p-synthetic" "${m[@]}"
  one "mlp-$p-file" "${m[@]}" --data "$out/mlp_x.npy" --targets "$out/mlp_y.npy" --no-shuffle
  one "mlp-$p-shuffled" "${m[@]}" --data "$out/mlp_x.npy" --targets "$out/mlp_y.npy"
  torch_one "mlp-$p-torch" --x "$out/mlp_x.npy" --y "$out/mlp_y.npy" --model mlp --batch 4096 --precision $p --steps 160
done
s=(--model seed --batch 64 --steps 3000)
one seed-fp32-synthetic "${s[@]}"
one seed-fp32-file "${s[@]}" --data "$out/seed_x.npy" --targets "$out/seed_y.npy" --no-shuffle
one seed-fp32-shuffled "${s[@]}" --data "$out/seed_x.npy" --targets "$out/seed_y.npy"
torch_one seed-fp32-torch --x "$out/seed_x.npy" --y "$out/seed_y.npy" --model seed --batch 64 --steps 3000

echo "== training from .npy files against synthetic data ($(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"
python3 - "$out" <<'PY'
import os, re, sys
out = sys.argv[1]
def read(name):
    path = os.path.join(out, name + ".log")
    return open(path).read() if os.path.exists(path) else ""
def ms(text, pattern):
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else None
def pct(v, base):
    return f"{v:.3f} ({100 * (v / base - 1):+.1f}%)" if v and base else "-"
print("ms/step from dptrain's summary (--devices cuda:0) and PyTorch's DataLoader loop over the same files;")
print("gather: the loader's host gather rate; copy: the copy engine's share of a step (shuffled run)")
print(f"{'workload':<6}{'prec':<6}{'synthetic':>11}{'file order':>20}{'shuffled':>20}{'torch loader':>14}"
      f"{'speed-up':>10}{'gather GB/s':>13}{'copy':>7}")
for model, precs in (("mlp", ("fp32", "tf32", "bf16")), ("seed", ("fp32",))):
    for p in precs:
        synth, order, shuf = (ms(read(f"{model}-{p}-{k}"), r"^done.* ([\d.]+) ms/step")
                              for k in ("synthetic", "file", "shuffled"))
        torch = ms(read(f"{model}-{p}-torch"), r"^torch-file .*: ([\d.]+) ms/step")
        pipe = re.search(r"^input pipeline: .* at ([\d.]+) GB/s .*\((\d+)% of a step", read(f"{model}-{p}-shuffled"), re.M)
        print(f"{model:<6}{p:<6}{synth or 0:>11.3f}{pct(order, synth):>20}{pct(shuf, synth):>20}"
              f"{torch or 0:>14.3f}{(f'{torch / shuf:.2f}x' if torch and shuf else '-'):>10}"
              f"{(pipe.group(1) if pipe else '-'):>13}{(pipe.group(2) + '%' if pipe else '-'):>7}")
PY
