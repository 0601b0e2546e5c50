#!/usr/bin/env bash
# Where a step's time goes: Nsight Systems over step_bench and its PyTorch twin for one
# workload and precision, and the GPU kernels of each, summed over the run (name, calls,
# total and mean time). Usage: profile_step.sh BUILD_DIR MODEL BATCH PRECISION [OUT_DIR]
set -u
build=$1 model=$2 batch=$3 prec=$4 out=${5:-/tmp/dpt_profile}
mkdir -p "$out"
cd "$(dirname "$0")/.."
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
[ -n "$nsys" ] || { echo "profile_step: nsys not found"; exit 0; }
run() {  # name, command...
  local name=$1; shift
  "$nsys" profile -q -t cuda,nvtx -f true -o "$out/$name" "$@" >"$out/$name.log" 2>&1
  echo "== $name: $(grep -E 'ms/step' "$out/$name.log")"
  "$nsys" stats -q -r cuda_gpu_kern_sum -f csv "$out/$name.nsys-rep" 2>/dev/null |
    python3 -c '
import csv, sys
rows = list(csv.DictReader(l for l in sys.stdin if "," in l))
tot = sum(float(r["Total Time (ns)"]) for r in rows)
for r in rows[:14]:
    print(f"{float(r[\"Time (%)\"]):6.1f}% {int(r[\"Instances\"]):7d} x {float(r[\"Avg (ns)\"])/1e3:9.2f} us  {r[\"Name\"][:110]}")
print(f"kernels total {tot/1e6:.1f} ms")'
}
run "dpt_${model}_$prec" "$build/benchmarks/step_bench" --model "$model" --batch "$batch" --precision "$prec"
run "torch_${model}_$prec" python3 benchmarks/torch_bench.py --model "$model" --batch "$batch" --precision "$prec"
