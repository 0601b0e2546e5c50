#!/usr/bin/env bash
# dptrain on the GPU as users run it: checkpoints resume bit-identically on one GPU and
# on logical replicas, non-finite gradients stop a run or are skipped, out of memory ends
# with its message and status 3 (no core dump, no checkpoint), and DDP with NCCL runs
# under mpirun, eager and recorded as a CUDA graph (`ddp_check`, the second argument where
# the build has MPI), and two ranks on one GPU are refused. Exits 77 (skipped) without a GPU.
set -u
exe=$1 ddp_check=${2:-}
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || { echo "no GPU: skipped"; exit 77; }
# shellcheck source=cli_lib.sh
source "$(cd "$(dirname "$0")" && pwd)/cli_lib.sh"
make_tmp

for devs in "--devices cuda:0" "--devices cuda:0,cuda:0 --reduce p2p"; do
  # shellcheck disable=SC2086  # the words of each setting are separate arguments
  for opt in "--optimizer sgd" "--optimizer adamw --lr 0.003"; do check_resume "GPU resume" $devs $opt; done
done

# A bad token in a training shard, met mid-run (the input pipeline loads ahead): the steps
# before it saved, eager, as a graph and on two replicas.
check_data_fault --devices cuda:0
check_data_fault --devices cuda:0 --cuda-graph
check_data_fault --devices cuda:0,cuda:0 --reduce p2p

# Non-finite gradients on one GPU (the fused check and update): stop names the step and
# the parameter, or says the squares overflowed (the seed model's gradients at lr 1e30),
# eager and as a graph alike; skip-step goes on and counts.
for graph in "" "--cuda-graph"; do
  "$exe" --devices cuda:0 --model seed --batch 64 --lr 1e30 --steps 50 $graph >"$tmp/out" 2>"$tmp/err$graph"
  rc=$?
  [ $rc -eq 4 ] && grep -q "step [0-9]*: the gradient\\('s norm\\| of parameter 0\\.\\(weight\\|bias\\)\\) is not finite" \
    "$tmp/err$graph" && [ "$(wc -l <"$tmp/err$graph")" -eq 1 ] && ok ||
    bad "GPU non-finite stop ($graph): rc $rc: $(cat "$tmp/err$graph")"
done
cmp -s "$tmp/err" "$tmp/err--cuda-graph" && ok || bad "non-finite stop differs as a graph: $(cat "$tmp/err" "$tmp/err--cuda-graph")"
"$exe" --devices cuda:0 --model seed --batch 64 --lr 1e30 --steps 20 --on-nonfinite skip-step >"$tmp/out" 2>"$tmp/err" &&
  grep -q 'skipped [0-9]* step' "$tmp/out" && ok || bad "GPU skip-step: $(cat "$tmp/err")"

# A bf16 GPT (head size 64: cuDNN's attention) repeats itself bit for bit by default; with
# --attention-backward fast it ends within rounding of that run.
lm=(--devices cuda:0 --model gpt:L2-H2-C128-T64-V128 --precision bf16 --batch 8 --steps 30 --log-every 30 --optimizer adamw
  --lr 1e-3)
"$exe" "${lm[@]}" >"$tmp/lm1" 2>&1
"$exe" "${lm[@]}" >"$tmp/lm2" 2>&1
"$exe" "${lm[@]}" --attention-backward fast >"$tmp/lm_fast" 2>&1
[ -n "$(hash_of "$tmp/lm1")" ] && [ "$(hash_of "$tmp/lm1")" = "$(hash_of "$tmp/lm2")" ] && ok ||
  bad "a GPT on cuda:0 twice: $(hash_of "$tmp/lm1") against $(hash_of "$tmp/lm2")"
last_loss() { grep -oE '^done: .*loss [0-9.]+ -> [0-9.]+' "$1" | grep -oE '[0-9.]+$'; }
python3 -c 'import sys; d, f = map(float, sys.argv[1:]); assert abs(d - f) < 1e-2 * d' \
  "$(last_loss "$tmp/lm1")" "$(last_loss "$tmp/lm_fast")" 2>/dev/null && ok ||
  bad "--attention-backward fast: loss $(last_loss "$tmp/lm_fast") against $(last_loss "$tmp/lm1")"

ulimit -c 0
"$exe" --devices cuda:0 --model mlp --batch 10000000 --steps 2 --save "$tmp/oom.safetensors" \
  >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 3 ] && grep -q 'out of memory on cuda:0: asked .* total .*use a smaller batch, more devices, or bf16' "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 1 ] &&
  ok || bad "out of memory: status $rc: $(cat "$tmp/err")"
[ ! -e "$tmp/oom.safetensors" ] && ok || bad "out of memory left a checkpoint"
ls "$tmp"/*.tmp* >/dev/null 2>&1 && bad "a temporary checkpoint file was left behind" || ok

if command -v mpirun >/dev/null; then
  mpi=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 1 -x NCCL_NVLS_ENABLE=0)
  "${mpi[@]}" "$exe" --ddp --steps 50 --log-every 50 >"$tmp/out" 2>&1 && grep -q 'reduce nccl' "$tmp/out" &&
    grep -q 'identical on all 1 ranks' "$tmp/out" && ok || bad "mpirun -np 1 dptrain --ddp: $(cat "$tmp/out")"
  # A rank's step recorded once: AdamW, a cosine schedule and clipping give the eager
  # step's parameters bit for bit.
  job=(--ddp --optimizer adamw --lr 0.003 --schedule cosine --warmup 5 --clip 0.5 --steps 40 --log-every 40)
  "${mpi[@]}" "$exe" "${job[@]}" >"$tmp/eager.out" 2>&1
  "${mpi[@]}" "$exe" "${job[@]}" --cuda-graph >"$tmp/graph.out" 2>&1
  [ -n "$(hash_of "$tmp/eager.out")" ] && [ "$(hash_of "$tmp/eager.out")" = "$(hash_of "$tmp/graph.out")" ] && ok ||
    bad "--ddp --cuda-graph is not the eager --ddp run bit for bit: $(tail -3 "$tmp/eager.out") vs $(tail -3 "$tmp/graph.out")"
  # Two ranks on the one GPU: refused before NCCL is asked (which would fail as "invalid
  # usage"), naming the ranks and the GPU, exit 2, within the timeout.
  timeout 120 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    mpirun -np 2 -x NCCL_NVLS_ENABLE=0 "$exe" --ddp --devices cuda:0 --steps 5 >"$tmp/out" 2>&1
  rc=$?
  [ $rc -eq 2 ] && grep -q 'ranks 0 and 1 would train on one GPU (PCI [0-9a-f:]* of rank 0' "$tmp/out" && ok ||
    bad "two ranks on one GPU: status $rc: $(cat "$tmp/out")"
  if [ -n "$ddp_check" ]; then
    for extra in "" "--zero 1" "--grad-accum 3 --batch 21"; do
      "${mpi[@]}" "$ddp_check" --device cuda --cuda-graph 1 $extra >"$tmp/out" 2>&1 &&
        grep -q 'all checks passed' "$tmp/out" && ok || bad "ddp_check --cuda-graph 1 $extra: $(cat "$tmp/out")"
    done
  fi
fi
finish
