#!/usr/bin/env bash
# One call on the GPU machine does it all: build, every test (GPU ones included), the
# default job, the hand-written SGEMM against cuBLAS, and the reference workloads of
# BENCHMARKS.md timed in dptrain and in PyTorch in the same run. The table comes last.
# Logs go to $OUT (the device tool's folder) or /tmp/dpt_gpu_check.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/dpt_gpu_check}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bash .ci/deps
cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build build >"$out/build.log" 2>&1 || { grep -E 'error|warning' "$out/build.log" | head -40; exit 1; }
ctest --test-dir build --output-on-failure >"$out/ctest.log" 2>&1
grep -E 'tests passed|Passed|Failed|Skipped|\*\*\*' "$out/ctest.log"
build/apps/dptrain --log-every 100 | tee "$out/default_job.log" | tail -4
# Data parallelism: logical replicas on one GPU, NCCL with one rank, and every GPU there is.
{
  build/apps/dptrain --devices cuda:0,cuda:0 --reduce p2p --log-every 250
  build/apps/dptrain --devices cuda:0 --reduce nccl --log-every 250
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  mpirun -np 1 -x NCCL_NVLS_ENABLE build/apps/dptrain --ddp --log-every 250
  mpirun -np 1 -x NCCL_NVLS_ENABLE build/tests/ddp_check --device cuda:0 --batch 10
  gpus=$(nvidia-smi -L | wc -l)
  if [ "$gpus" -ge 2 ]; then
    for r in nccl p2p; do
      build/apps/dptrain --gpus "$gpus" --reduce $r --model mlp --batch $((4096 * gpus)) --steps 30 --log-every 10
    done
    build/apps/dptrain --gpus 1 --model mlp --batch 4096 --steps 30 --log-every 10
  fi
} 2>&1 | tee "$out/parallel.log" | grep -E '^dptrain|^done|^step time|^memory'

build/benchmarks/sgemm_bench | tee "$out/sgemm.log"
{
  for p in fp32 tf32 bf16; do
    build/benchmarks/step_bench --model seed --batch 64 --precision $p
    python3 benchmarks/torch_bench.py --model seed --batch 64 --precision $p
    build/benchmarks/step_bench --model mlp --batch 4096 --precision $p
    python3 benchmarks/torch_bench.py --model mlp --batch 4096 --precision $p
  done
  build/benchmarks/step_bench --model mlp --batch 4096 --precision fp32 --gemm native
} 2>&1 | tee "$out/steps.log"

echo
echo "== dptrain vs PyTorch eager, same run ($(date -u +%F), $(head -1 "$out/gpu.txt" | cut -d, -f1)) =="
python3 - "$out/steps.log" <<'PY'
import re, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"(dptrain|torch) (\S+) batch (\d+) (\S+) (\S+): ([\d.]+) ms/step.*peak ([\d.]+) MiB", line)
    if m:
        who, model, batch, prec, impl, ms, peak = m.groups()
        rows[(who, model, prec, impl)] = (float(ms), float(peak))
print(f"{'workload':<10}{'precision':<10}{'dptrain ms':>12}{'torch ms':>10}{'speed-up':>10}{'dptrain MiB':>13}{'torch MiB':>11}")
for model in ("seed", "mlp"):
    for prec in ("fp32", "tf32", "bf16"):
        d = rows.get(("dptrain", model, prec, "cublas")); t = rows.get(("torch", model, prec, "eager"))
        if d and t:
            print(f"{model:<10}{prec:<10}{d[0]:>12.4f}{t[0]:>10.4f}{t[0] / d[0]:>9.2f}x{d[1]:>13.1f}{t[1]:>11.1f}")
n = rows.get(("dptrain", "mlp", "fp32", "native"))
if n:
    print(f"mlp fp32 with --gemm native: {n[0]:.3f} ms/step")
PY
grep -E 'native/cublas' "$out/sgemm.log"
