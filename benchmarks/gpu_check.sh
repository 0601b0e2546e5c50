#!/usr/bin/env bash
# One call on the GPU machine does it all: build, the tests (GPU ones included; the slow
# CPU-only ones - ASan build, fuzzing, rank faults - are CI's), compute-sanitizer over the
# GPU kernels, the hand-written SGEMM against cuBLAS, the reference workloads of
# BENCHMARKS.md in dptrain and in PyTorch in the same run, and the replicator's overhead
# with logical replicas. The tables come last. Logs go to $OUT or /tmp/dpt_gpu_check.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/dpt_gpu_check}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
bash .ci/deps
cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
cmake --build build >"$out/build.log" 2>&1 || { grep -E 'error|warning' "$out/build.log" | head -40; exit 1; }
ctest --test-dir build --output-on-failure -E 'asan|checkpoint_fuzz|ddp_cli' >"$out/ctest.log" 2>&1
grep -E 'tests passed|Test +#|\*\*\*' "$out/ctest.log"

# compute-sanitizer: memcheck over every single-GPU test but the two that make CUDA calls
# fail on purpose ([faults]); API errors are not reported because NCCL probes kernels
# of other architectures with cudaFuncGetAttributes and fails on purpose too (every
# call of ours is checked and throws). racecheck over the tests that run every kernel
# family once ([ops] [random] [gemm] [graph] and the cuDNN kernels); the training and
# data-parallel tests run the same kernels and take too long under it.
# SANITIZE=0 skips the sanitizers, BENCH=0 the benchmarks (to fit a call's time limit).
if [ "${SANITIZE:-1}" = 1 ]; then
timeout 400 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 build/tests/dpt_gpu_tests \
  '~[multigpu]~[faults]' >"$out/sanitizer_memcheck.log" 2>&1
echo "compute-sanitizer memcheck: exit $? | $(grep -E 'ERROR SUMMARY|All tests passed|test cases' "$out/sanitizer_memcheck.log" | tr '\n' ' ')"
timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 build/tests/dpt_gpu_tests \
  '[ops],[random],[gemm],[graph]~[train],cuDNN*' >"$out/sanitizer_racecheck.log" 2>&1
echo "compute-sanitizer racecheck: exit $? | $(grep -E 'RACECHECK SUMMARY|All tests passed|test cases' "$out/sanitizer_racecheck.log" | tr '\n' ' ')"
# The kernels racecheck flags, once each: on the H200 it reports hazards inside cuBLAS's own
# bf16 GEMM kernels (nvjet_sm90_*, which synchronize through TMA barriers), none in ours.
grep -oE 'Race reported between \S+ access at [^+ ]+' "$out/sanitizer_racecheck.log" | awk '{print $NF}' | sort | uniq -c
fi
[ "${BENCH:-1}" = 1 ] || exit 0

build/benchmarks/sgemm_bench >"$out/sgemm.log" 2>&1
{
  for p in fp32 tf32 bf16; do
    build/benchmarks/step_bench --model seed --batch 64 --precision $p
    python3 benchmarks/torch_bench.py --model seed --batch 64 --precision $p
    build/benchmarks/step_bench --model mlp --batch 4096 --precision $p
    python3 benchmarks/torch_bench.py --model mlp --batch 4096 --precision $p
    build/benchmarks/step_bench --model cnn --batch 256 --precision $p
    python3 benchmarks/torch_bench.py --model cnn --batch 256 --precision $p
  done
  build/benchmarks/step_bench --model cnn --batch 256 --cuda-graph
  python3 benchmarks/torch_bench.py --model cnn --batch 256 --mode graph
  build/benchmarks/step_bench --model mlp --batch 4096 --precision fp32 --gemm native
  python3 benchmarks/torch_bench.py --model seed --batch 64 --mode graph
  build/benchmarks/step_bench --model seed --batch 64 --cuda-graph
  build/apps/dptrain --devices cuda:0 --cuda-graph --log-every 100 | grep -E '^done'
  build/apps/dptrain --devices cuda:0 --log-every 100 | grep -E '^done'
} 2>&1 | tee "$out/steps.log" >/dev/null

# The replicator's own overhead: N logical replicas share cuda:0, so any slow-down in
# strong scaling beyond 1/N of the work is the replicator's (threads, copies, reduction).
for m in seed mlp; do
  build/benchmarks/dpbench --devices cuda:0,cuda:0,cuda:0,cuda:0 --model $m --reduce p2p --steps 20 --warmup 3 \
    --scaling strong --out "$out/dpbench_$m" >"$out/dpbench_$m.log" 2>&1 || echo "dpbench $m failed: $(tail -3 "$out/dpbench_$m.log")"
done
build/apps/dptrain --devices cuda:0 --log-every 50 --plot "$out/loss.svg" >"$out/default_job.log" 2>&1

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
for model in ("seed", "mlp", "cnn"):
    for prec in ("fp32", "tf32", "bf16"):
        d = rows.get(("dptrain", model, prec, "cublas")); t = rows.get(("torch", model, prec, "eager"))
        if d and t:
            print(f"{model:<10}{prec:<10}{d[0]:>12.4f}{t[0]:>10.4f}{t[0] / d[0]:>9.2f}x{d[1]:>13.1f}{t[1]:>11.1f}")
n = rows.get(("dptrain", "mlp", "fp32", "native"))
if n:
    print(f"mlp fp32 with --gemm native: {n[0]:.3f} ms/step")
PY
grep -E 'graph|^done' "$out/steps.log"
grep -E 'native/cublas|^sgemm' "$out/sgemm.log"
echo "== replicator overhead: 1..4 logical replicas on cuda:0 (strong scaling, p2p) =="
cat "$out"/dpbench_seed.log "$out"/dpbench_mlp.log | grep -vE '^\s*$' | tail -24
grep -E '^done|^memory' "$out/default_job.log"
