#!/usr/bin/env bash
# Where a step's GPU time goes: Nsight Compute times each kernel of a few steps after
# warm-up, for step_bench and for its PyTorch twin, on one workload and precision.
# Prints each kernel's name and duration (ncu serializes kernels, so the gaps between
# them are not shown; the sum is the step's pure kernel time). ncu locks the clocks at
# base by default, which slows the GEMMs more than the memory-bound kernels; CLOCKS=none
# leaves them to the GPU, as in a real run.
# Usage: [CLOCKS=none] [COUNT=N] profile_step.sh BUILD_DIR MODEL BATCH PRECISION [OUT_DIR]
set -u
build=$1 model=$2 batch=$3 prec=$4 out=${5:-/tmp/dpt_profile}
mkdir -p "$out"
cd "$(dirname "$0")/.."
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
[ -n "$ncu" ] || { echo "profile_step: ncu not found"; exit 0; }
run() {  # name, launches to skip, launches to time, command...
  local name=$1 skip=$2 count=$3; shift 3
  "$ncu" --clock-control "${CLOCKS:-base}" --metrics gpu__time_duration.sum --csv --launch-skip "$skip" --launch-count "$count" "$@" \
    >"$out/$name.csv" 2>"$out/$name.log"
  echo "== $name"
  python3 - "$out/$name.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if not rows:
    print("  (no kernels)"); sys.exit()
head, rows = rows[0], rows[1:]
name, value = head.index("Kernel Name"), head.index("Metric Value")
total = 0.0
for r in rows:
    us = float(r[value].replace(",", "")) / 1e3
    total += us
    print(f"  {us:9.2f} us  {r[name][:100]}")
print(f"  {total:9.2f} us  total of {len(rows)} kernels")
PY
}
run "dptrain_${model}_$prec" 300 "${COUNT:-24}" "$build/benchmarks/step_bench" --model "$model" --batch "$batch" \
  --precision "$prec" --warmup 60 --blocks 1 --steps 5
run "torch_${model}_$prec" 2000 "${COUNT:-24}" python3 benchmarks/torch_bench.py --model "$model" --batch "$batch" --warmup 200 --blocks 1 --steps 5 \
  --precision "$prec"
