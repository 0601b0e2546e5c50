#!/usr/bin/env bash
# step_bench --check (the update the training loop makes: it also checks the gradients and
# records the check) trains as the plain step does while the gradients are finite: the same
# losses, on the CPU, and on a GPU where there is one (eager and as graphs; a model of
# kTwinsFromParams parameters or more takes twin buffers, a recording for each parity).
# Usage: step_bench_test.sh STEP_BENCH
set -u
bench=$1 fails=0
# The workload's tag (-checked with --check, so a flag parsed and ignored fails) and its losses.
losses() { "$bench" --blocks 1 --steps 3 --warmup 2 "$@" | grep -oE '(-checked)?: .*loss [^;]*' | sed 's/: .*loss/ loss/'; }
same() {
  local plain checked
  plain=$(losses "$@") checked=$(losses "$@" --check)
  if [ -n "$plain" ] && [ "-checked$plain" = "$checked" ]; then
    echo "ok: $* ($plain)"
  else
    echo "FAIL: $*: '$plain' plain, '$checked' checked"
    fails=$((fails + 1))
  fi
}
same --devices cpu
same --devices cpu --model 16-64x2-4 --batch 32
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  for graph in "" --cuda-graph; do
    same --devices cuda:0 $graph
    same --devices cuda:0 --model 1024-1024x2-1024 --batch 256 $graph
  done
fi
[ "$fails" -eq 0 ]
