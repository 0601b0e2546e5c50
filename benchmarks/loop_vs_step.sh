#!/usr/bin/env bash
# The training loop end to end against the bare step it runs: dptrain's summary ms/step
# beside step_bench's on the same workload and SGD step (lr 0.01, no momentum), eager and
# as a CUDA graph, in turns, ROUNDS times; prints a line a pair and a table of the ratios'
# medians. Each step_bench run takes as many steps as the loop's, after 20 of warm-up: the
# GPU's clock falls as it warms (an mlp run's 100-step intervals spread over 10%), so a
# short bench beside a long loop would flatter the bench. Its blocks are of 100 steps, each
# ending in a wait for the GPU, as the loop's log points (every 100 steps) do. The loop's
# figure is its time over its steps, a mean, so the bench's is the mean of its blocks (its
# median too, in the line a pair: a median leaves out the slow blocks that a mean counts).
# The bare step is timed twice: plain (its update a plain SGD kernel) and with --check,
# whose update also checks the gradients and records the check in host memory, as the
# loop's must (a non-finite step is never applied); the table gives the loop's ratio to
# each.
# Usage: loop_vs_step.sh BUILD_DIR [ROUNDS]
set -u
build=$1 rounds=${2:-3}
dptrain=$build/apps/dptrain bench=$build/benchmarks/step_bench
ms() { grep -oE '[0-9.]+ ms/step' | head -1 | grep -oE '^[0-9.]+'; }
mean() { grep -oE 'mean [0-9.]+ ms/step' | grep -oE '[0-9.]+'; }
for w in "default 16-128x2-4 256 fp32 5000" "seed seed 64 fp32 5000" "mlp mlp 4096 tf32 300" \
  "mlp mlp 4096 bf16 300"; do
  read -r name model batch prec steps <<<"$w"
  for mode in eager graph; do
    graph=()
    [ "$mode" = graph ] && graph=(--cuda-graph)
    for ((i = 0; i < rounds; ++i)); do
      loop=$("$dptrain" --devices cuda:0 --model "$model" --batch "$batch" --precision "$prec" --lr 0.01 --momentum 0 \
        --steps "$steps" --log-every 100 "${graph[@]}" | grep -E '^done' | ms)
      run_bench=("$bench" --model "$model" --batch "$batch" --precision "$prec" --warmup 20 --blocks $((steps / 100))
        --steps 100 "${graph[@]}")
      line=$("${run_bench[@]}") checked=$("${run_bench[@]}" --check)
      step=$(mean <<<"$line") median=$(ms <<<"$line") step_checked=$(mean <<<"$checked")
      echo "loop-vs-step $name $prec $mode: loop ${loop:-?} step ${step:-?} (median ${median:-?})" \
        "checked ${step_checked:-?}"
    done
  done
done | tee /dev/stderr | python3 -c '
import re, statistics, sys
rows = {}
for line in sys.stdin:
    m = re.match(r"loop-vs-step (\S+) (\S+) (\S+): loop ([\d.]+) step ([\d.]+) .*checked ([\d.]+)", line)
    if m:
        rows.setdefault(m.group(1, 2, 3), []).append(tuple(float(m.group(i)) for i in (4, 5, 6)))
print("%-10s%-6s%-7s%10s%10s%8s%12s%8s  (medians)" %
      ("workload", "prec", "mode", "loop ms", "step ms", "ratio", "checked ms", "ratio"))
for (name, prec, mode), v in rows.items():
    med = lambda f: statistics.median(f(r) for r in v)
    loop, step, checked = med(lambda r: r[0]), med(lambda r: r[1]), med(lambda r: r[2])
    ratio, ratio_checked = med(lambda r: r[0] / r[1]), med(lambda r: r[0] / r[2])
    print(f"{name:<10}{prec:<6}{mode:<7}{loop:>10.4f}{step:>10.4f}{ratio:>8.3f}{checked:>12.4f}{ratio_checked:>8.3f}")
'
