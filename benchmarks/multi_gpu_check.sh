#!/usr/bin/env bash
# On a machine with several GPUs: the multi-GPU tests (both reduction paths, N GPUs equal
# one, balanced memory, p2p's chunked copy back), DDP over NCCL with 2..N ranks (eager and
# recorded as CUDA graphs), the mlp workload on 1 and N GPUs with and without overlap,
# dpbench's weak and strong scaling in fp32, tf32 and bf16, with bf16 gradients on the
# wire and with ZeRO, the scaling levers (first bucket, updates per bucket, NCCL's thread
# blocks), the reduction's bus bandwidth beside bare NCCL's (dpbench --comm), and PyTorch
# DDP and nn.DataParallel. Lean: builds only what it runs. GPT-2 124M's weak scaling
# (issue 52's figure) is benchmarks/gpt_scaling.sh, a call of its own before this one:
# each has most of the GPU machine's 10 minutes a command. PREBUILT=1 skips the build and
# runs the binaries already in build/ (built on another machine and copied there).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
n=$(nvidia-smi -L | wc -l)
nvidia-smi -L
if [ "${PREBUILT:-0}" = 1 ]; then
  for bin in build/tests/dpt_gpu_tests build/apps/dptrain build/tests/ddp_check build/benchmarks/dpbench; do
    [ -x "$bin" ] || { echo "multi_gpu_check: PREBUILT=1 but $bin is missing or not executable"; exit 1; }
  done
else
  cmake -S . -B build -G Ninja -DDPT_WERROR=ON >/dev/null 2>&1 || exit 1
  cmake --build build --target dpt_gpu_tests dptrain_cli ddp_check dpbench >/dev/null 2>&1 || { echo build failed; exit 1; }
fi
build/tests/dpt_gpu_tests '[multigpu],[parallel]' 2>&1 | tail -3  # [parallel]: p2p's chunked copy on two GPUs too
for ((np = 2; np <= n; ++np)); do
  echo "-- ddp_check -np $np"
  mpirun -np "$np" -x NCCL_NVLS_ENABLE build/tests/ddp_check --device cuda --batch 10 2>&1 | tail -3
  for z in 1 2; do
    echo "-- ddp_check -np $np --zero $z"
    mpirun -np "$np" -x NCCL_NVLS_ENABLE build/tests/ddp_check --device cuda --batch 10 --zero $z 2>&1 | tail -3
  done
  for extra in "" "--zero 1"; do  # each rank's step and its NCCL collectives recorded as a CUDA graph
    echo "-- ddp_check -np $np --cuda-graph 1 $extra"
    mpirun -np "$np" -x NCCL_NVLS_ENABLE build/tests/ddp_check --device cuda --batch 10 --cuda-graph 1 $extra 2>&1 |
      tail -3
  done
done
run() { build/apps/dptrain "$@" --model mlp --steps 30 --log-every 10 2>&1 | grep -E '^done|^step time|^memory|^param'; }
echo "-- 1 GPU, batch 4096"; run --gpus 1 --batch 4096
for r in nccl p2p; do echo "-- $n GPUs, --reduce $r, batch $((4096 * n))"; run --gpus "$n" --reduce $r --batch $((4096 * n)); done
echo "-- $n GPUs, nccl, no overlap"; run --gpus "$n" --reduce nccl --batch $((4096 * n)) --no-overlap
for o in "" --no-overlap; do  # p2p's copy back in chunks beside the next forward, or whole after the update
  echo "-- $n GPUs, bf16, p2p $o"; run --gpus "$n" --reduce p2p --precision bf16 --batch $((4096 * n)) $o
done
echo "-- $n GPUs, bf16, nccl, bucket sizes tuned over the first 25 steps"
build/apps/dptrain --gpus "$n" --reduce nccl --model mlp --batch $((4096 * n)) --precision bf16 --steps 60 \
  --log-every 30 --tune-buckets 2>&1 | grep -E 'tuned|^done'

for ov in "" --no-overlap --cuda-graph; do
  echo "-- mpirun -np $n --ddp $ov"
  mpirun -np "$n" -x NCCL_NVLS_ENABLE build/apps/dptrain --ddp $ov --model mlp --batch $((4096 * n)) --steps 30 \
    --log-every 10 2>&1 | grep -E '^done|^step time|^memory|^param'
done
bench() { build/benchmarks/dpbench --gpus "$n" --model mlp --batch 4096 --warmup 5 --steps 21 "$@" 2>&1 | grep -vE '^wrote'; }
echo "-- dpbench: every precision, both paths, weak and strong scaling"
bench --precision fp32,tf32,bf16 --reduce nccl,p2p --scaling weak,strong --out "${OUT:-/tmp}/dpbench_multi"
echo "-- dpbench: bf16 gradients on the wire (the scaling issue)"
bench --precision fp32,bf16 --reduce nccl,p2p --scaling weak --grad-comm bf16 --out "${OUT:-/tmp}/dpbench_bf16wire"
echo "-- dpbench: the scaling issue's levers, bf16 and tf32 weak scaling (defaults: a 1 MiB first bucket, the"
echo "   communication stream at high priority, p2p reading peers in place): 25 MiB first bucket; each bucket"
echo "   updated once reduced; NCCL capped at 8 and 16 thread blocks"
bench --precision tf32,bf16 --reduce nccl,p2p --scaling weak --first-bucket-mb 25 --out "${OUT:-/tmp}/dpbench_first25"
bench --precision tf32,bf16 --reduce nccl,p2p --scaling weak --update-per-bucket --out "${OUT:-/tmp}/dpbench_perbucket"
for c in 8 16; do
  bench --precision bf16 --reduce nccl --scaling weak --comm-ctas $c --out "${OUT:-/tmp}/dpbench_ctas$c"
done
echo "-- dpbench: AdamW, ZeRO stage 0, 1 and 2, with each device's state (the sharding issue)"
for z in 0 1 2; do
  bench --precision fp32,bf16 --reduce nccl --scaling weak --optimizer adamw --zero $z --out "${OUT:-/tmp}/dpbench_zero$z"
done
echo "-- dpbench --comm: the gradient buffer's reduction through our paths and bare NCCL (busbw as nccl-tests)"
for extra in "--reduce nccl,p2p" "--reduce nccl,p2p --grad-comm bf16" "--reduce nccl --zero 1"; do
  build/benchmarks/dpbench --gpus "$n" --model mlp --comm --steps 20 $extra --out "${OUT:-/tmp}/dpbench_comm" 2>&1 |
    grep -vE '^wrote'
done
python3 benchmarks/torch_bench.py --model mlp --precision fp32 --mode eager --batch 4096 --warmup 5 --blocks 3 --steps 7
for m in ddp dp; do
  for ((g = 2; g <= n; g *= 2)); do
    python3 benchmarks/torch_bench.py --model mlp --precision fp32 --mode $m --gpus $g --batch $((4096 * g)) \
      --warmup 5 --blocks 3 --steps 7 2>&1 | grep -E 'ms/step|rror'
  done
done
