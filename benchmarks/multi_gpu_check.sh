#!/usr/bin/env bash
# On a machine with several GPUs, in two parts, each meant to fit one of the GPU machine's
# 10-minute commands on 8 GPUs:
#   PART=tests: the multi-GPU tests (both reduction paths, N GPUs equal one, balanced
#     memory, p2p's chunked copy back, a step failing on one GPU), DDP over NCCL with 2
#     and N ranks (eager, ZeRO 1 and 2, recorded as CUDA graphs), dptrain --ddp;
#   PART=bench: the mlp workload on 1 and N GPUs with and without overlap, dpbench's weak
#     and strong scaling in fp32, tf32 and bf16, with bf16 gradients on the wire and with
#     ZeRO, the scaling levers (first bucket, updates per bucket, NCCL's thread blocks),
#     the reduction's bus bandwidth beside bare NCCL's (dpbench --comm), and PyTorch DDP
#     and nn.DataParallel.
# PART=all (the default) runs both. Every command runs under a time limit with its whole
# output in $OUT/logs/NAME.log; the screen shows each one's verdict lines, and says which
# failed or ran out of time. GPT-2 124M's weak scaling (issue 52's figure) is
# benchmarks/gpt_scaling.sh, a command of its own. Lean: builds only what it runs.
# PREBUILT=1 skips the build and runs the binaries already in build/ (built on another
# machine and copied there).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# shellcheck source=torch_cudnn.sh
source benchmarks/torch_cudnn.sh  # PyTorch's cuDNN, for dptrain too
out=${OUT:-/tmp/multi_gpu_check}
logs=$out/logs
mkdir -p "$logs"
part=${PART:-all}
case "$part" in tests | bench | all) ;; *) echo "multi_gpu_check: PART is tests, bench or all, got '$part'"; exit 2 ;; esac
n=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)  # GPUs, not MIG lines
nvidia-smi -L
[ "$n" -ge 2 ] || { echo "multi_gpu_check: $n GPU(s) here, it needs 2 or more"; exit 1; }
if [ "${PREBUILT:-0}" = 1 ]; then
  for bin in build/tests/dpt_gpu_tests build/apps/dptrain build/tests/ddp_check build/benchmarks/dpbench; do
    [ -x "$bin" ] || { echo "multi_gpu_check: PREBUILT=1 but $bin is missing or not executable"; exit 1; }
  done
else
  cmake -S . -B build -G Ninja -DDPT_WERROR=ON >/dev/null 2>&1 || exit 1
  cmake --build build --target dpt_gpu_tests dptrain_cli ddp_check dpbench >/dev/null 2>&1 || { echo build failed; exit 1; }
fi
mpi=(mpirun --bind-to none -x NCCL_NVLS_ENABLE)  # ranks not pinned to one core beside NCCL's threads
failures=0
# Each part keeps within one command of the GPU machine: a command gets at most what is
# left of BUDGET_S (540 s), and one with under 20 s left is skipped.
budget_end=$(($(date +%s) + ${BUDGET_S:-540}))

# check NAME SECONDS PATTERN COMMAND...: runs COMMAND within SECONDS (or what is left of
# the budget), its output in $logs/NAME.log; shows the lines matching PATTERN and any
# failure's, and the log's end when it failed.
check() {
  local name=$1 secs=$2 pattern=$3 left
  shift 3
  left=$((budget_end - $(date +%s)))
  if [ "$left" -lt 20 ]; then
    echo "!! $name: skipped, the budget is spent"
    failures=$((failures + 1))
    return
  fi
  [ "$secs" -le "$left" ] || secs=$left
  echo "-- $name: $*"
  timeout -k 10 "$secs" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  grep -E "$pattern|FAILED|error:|rror [a-z]" "$logs/$name.log" | head -30
  if [ "$rc" -ne 0 ]; then
    failures=$((failures + 1))
    local why=""
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (out of time: ${secs} s)"
    echo "!! $name: exit $rc$why; the log's end:"
    tail -8 "$logs/$name.log"
  fi
}
summary='^done|^step time|^memory|^param|tuned'

if [ "$part" != bench ]; then
  tests=build/tests/dpt_gpu_tests
  # [parallel]: p2p's chunked copy on two GPUs too. A step failing on one GPU, apart: were
  # it to hang, the others would still report.
  check gpu_tests 300 'test cases|All tests passed' "$tests" '[multigpu]~[failed_step],[parallel]~[failed_step]'
  check gpu_tests_failed_step 90 'test cases|All tests passed' "$tests" '[failed_step]' --durations yes
  for np in $(printf '%s\n' 2 "$n" | sort -un); do
    for extra in "" "--zero 1" "--zero 2" "--cuda-graph 1" "--cuda-graph 1 --zero 1"; do
      # (each rank's step and its NCCL collectives recorded as a CUDA graph with --cuda-graph)
      check "ddp_check_np$np${extra// /}" 120 'all checks passed' \
        "${mpi[@]}" -np "$np" build/tests/ddp_check --device cuda --batch 10 $extra
    done
  done
  for ov in "" --no-overlap --cuda-graph; do
    check "dptrain_ddp_np$n$ov" 120 "$summary" "${mpi[@]}" -np "$n" build/apps/dptrain --ddp $ov --model mlp \
      --batch $((4096 * n)) --steps 30 --log-every 10
  done
fi

if [ "$part" != tests ]; then
  run() { check "$1" 120 "$summary" build/apps/dptrain "${@:2}" --model mlp --steps 30 --log-every 10; }
  run mlp_1gpu --gpus 1 --batch 4096
  for r in nccl p2p; do run "mlp_${n}gpus_$r" --gpus "$n" --reduce $r --batch $((4096 * n)); done
  run "mlp_${n}gpus_nccl_no_overlap" --gpus "$n" --reduce nccl --batch $((4096 * n)) --no-overlap
  for o in "" --no-overlap; do  # p2p's copy back in chunks beside the next forward, or whole after the update
    run "mlp_${n}gpus_bf16_p2p$o" --gpus "$n" --reduce p2p --precision bf16 --batch $((4096 * n)) $o
  done
  check "mlp_${n}gpus_bf16_tuned_buckets" 120 "$summary" build/apps/dptrain --gpus "$n" --reduce nccl --model mlp \
    --batch $((4096 * n)) --precision bf16 --steps 60 --log-every 30 --tune-buckets

  bench() { check "$1" 240 '^(weak|strong|scaling) ' build/benchmarks/dpbench --gpus "$n" --model mlp --batch 4096 \
    --warmup 5 --steps 21 "${@:2}" --out "$out/$1"; }
  bench dpbench_every_precision --precision fp32,tf32,bf16 --reduce nccl,p2p --scaling weak,strong
  bench dpbench_bf16_wire --precision fp32,bf16 --reduce nccl,p2p --scaling weak --grad-comm bf16
  # The scaling issue's levers, bf16 and tf32 weak scaling (defaults: a 1 MiB first bucket,
  # the communication stream at high priority, p2p reading peers in place): a 25 MiB first
  # bucket; each bucket updated once reduced; NCCL capped at 8 and 16 thread blocks.
  bench dpbench_first25 --precision tf32,bf16 --reduce nccl,p2p --scaling weak --first-bucket-mb 25
  bench dpbench_per_bucket --precision tf32,bf16 --reduce nccl,p2p --scaling weak --update-per-bucket
  for c in 8 16; do bench "dpbench_ctas$c" --precision bf16 --reduce nccl --scaling weak --comm-ctas $c; done
  # AdamW, ZeRO stage 0, 1 and 2, with each device's state (the sharding issue).
  for z in 0 1 2; do
    bench "dpbench_zero$z" --precision fp32,bf16 --reduce nccl --scaling weak --optimizer adamw --zero $z
  done
  # The gradient buffer's reduction through our paths and bare NCCL (busbw as nccl-tests).
  for extra in "--reduce nccl,p2p" "--reduce nccl,p2p --grad-comm bf16" "--reduce nccl --zero 1"; do
    name=dpbench_comm${extra//[ ,-]/_}
    check "$name" 180 '^(op|all-|reduce|broadcast)' build/benchmarks/dpbench --gpus "$n" --model mlp --comm --steps 20 \
      $extra --out "$out/$name"
  done
  check torch_1gpu 120 'ms/step' python3 benchmarks/torch_bench.py --model mlp --precision fp32 --mode eager \
    --batch 4096 --warmup 5 --blocks 3 --steps 7
  for m in ddp dp; do
    for ((g = 2; g <= n; g *= 2)); do
      check "torch_${m}_$g" 180 'ms/step' python3 benchmarks/torch_bench.py --model mlp --precision fp32 --mode $m \
        --gpus $g --batch $((4096 * g)) --warmup 5 --blocks 3 --steps 7
    done
  done
fi
echo "multi_gpu_check: $failures command(s) failed or timed out (logs: $logs)"
[ "$failures" -eq 0 ]
