#!/usr/bin/env bash
# benchmarks/gpt_max_batch.sh (compare.sh maxbatch) without a GPU: its bash parses (and
# passes shellcheck where installed); gpt_max_batch.py's table reads a hand-written log of
# the real programs' lines (fixtures/gpt_max_batch.log); and the search, run against
# stand-ins for dptrain, torch_gpt_bench.py and nvidia-smi that fit up to a known batch,
# finds the edge to the resolution, tells out of memory from other failures, predicts
# torch's batch from two peaks (trying one out of memory beside the other again alone),
# and stops at its time caps. Seconds.
# Usage: gpt_max_batch_test.sh SOURCE_DIR
# shellcheck disable=SC2015  # `check && ok || bad`: ok never fails
set -u
src=$(cd "$1" && pwd)
# shellcheck source=cli_lib.sh
source "$src/tests/cli_lib.sh"
make_tmp
script=$src/benchmarks/gpt_max_batch.sh judge=$src/benchmarks/gpt_max_batch.py

bash -n "$script" && ok || bad "gpt_max_batch.sh does not parse"
if command -v shellcheck >/dev/null; then
  (cd "$src/tests" && shellcheck -x "$script" gpt_max_batch_test.sh) && ok || bad "shellcheck"
fi

# row TABLE RUN: the table's row of RUN, its fields after the name.
row() { grep -E "^$2 " "$1" | sed -E "s/^$2 +//"; }
# expect TABLE RUN FIELDS...: the row's leading fields are FIELDS (whitespace-separated).
expect() {
  local table=$1 run=$2 got
  shift 2
  got=$(row "$table" "$run" | tr -s ' ' | cut -d' ' -f1-$#)
  [ "$got" = "$*" ] && ok || bad "$run: '$got', expected '$*' in: $(cat "$table")"
}
# note TABLE RUN TEXT: the row's notes hold TEXT (a fixed string).
note() { row "$1" "$2" | grep -qF -- "$3" && ok || bad "$2 has no note '$3': $(row "$1" "$2")"; }

# ---- the table on the fixture --------------------------------------------------------
python3 "$judge" table "$src/tests/fixtures/gpt_max_batch.log" >"$tmp/fixture.txt" 2>&1 ||
  bad "table on the fixture failed: $(cat "$tmp/fixture.txt")"
grep -qF 'NVIDIA H100 80GB HBM3, 81559 MiB, 2026-12-10' "$tmp/fixture.txt" && ok || bad "no GPU in: $(cat "$tmp/fixture.txt")"
# run: largest B, peak GiB, reserved GiB, ms/step, tokens/s, first OOM, tries
expect "$tmp/fixture.txt" "dptrain none" 40 71.52 72.00 312.4 131,114 48 4
expect "$tmp/fixture.txt" "dptrain gelu\\+ln" 64 70.10 71.00 540.0 121,363 - 3
note "$tmp/fixture.txt" "dptrain gelu\\+ln" "error at B 128 (status 1: dptrain: error: CUDA error: an illegal memory access"
expect "$tmp/fixture.txt" "torch compile" 56 75.22 - 455.0 126,031 64 4
note "$tmp/fixture.txt" "torch compile" "predicted B 56"
expect "$tmp/fixture.txt" "torch eager" 32 45.90 - 290.1 112,954 40 4
note "$tmp/fixture.txt" "torch eager" "stopped: the 240 s cap (TORCH_SECONDS)"

# ---- the search against stand-ins ------------------------------------------------------
mkdir -p "$tmp/bin"
cat >"$tmp/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "$*" in
  *name*) echo "NVIDIA H100 80GB HBM3" ;;
  *memory.total*) echo "81559" ;;
esac
EOF
# dptrain and the bench, one stand-in by its name's two links. dptrain fits up to B 88
# without recomputation, with gelu+ln up to 200 but fails (not out of memory) at 256. The
# bench's peak is 1500 + 600 B MiB (compile) or 2500 + 900 B (eager), out of memory above
# 80559; eager's as a traceback (status 1), as if the bench did not catch it.
cat >"$tmp/stand-in" <<'EOF'
#!/usr/bin/env bash
while [ $# -gt 0 ]; do
  case $1 in --batch) b=$2 ;; --recompute) r=$2 ;; --mode) mode=$2 ;; esac
  shift
done
if [ "$(basename "$0")" = dptrain ]; then
  limit=88
  [ "$r" = gelu+ln ] && limit=200
  if [ "$r" = gelu+ln ] && [ "$b" -eq 256 ]; then echo "dptrain: error: CUDA error: misaligned address" >&2; exit 1; fi
  if [ "$b" -gt "$limit" ]; then
    echo "dptrain: error: out of memory on cuda:0: asked 3.00 GiB, allocated 76.10 GiB, reserved 77.00 GiB, total 79.19 GiB; use a smaller batch, more devices, or bf16 compute" >&2
    exit 3
  fi
  echo "done: 3 steps in 2.1s; loss 11.0123 -> 10.2 (92.6% of the first); 297.3 samples/s; $((b * 3)).5 ms/step"
  echo "memory cuda:0: peak $((b / 2)).25 GiB allocated, $((b / 2 + 1)).00 GiB reserved, 40 system allocations"
  exit 0
fi
peak=$((1500 + 600 * b))
[ "$mode" = eager ] && peak=$((2500 + 900 * b))
if [ "$peak" -gt 80559 ] && [ "$mode" = eager ]; then
  printf 'Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n' >&2
  exit 1
elif [ "$peak" -gt 80559 ]; then
  echo "torch gpt2 B $b T 1024 $mode: out of memory (peak 70000 MiB before it): CUDA out of memory." >&2
  exit 3
fi
echo "torch gpt2 B $b T 1024 $mode: $((35 * b / 10)).$((35 * b % 10))0 ms/step, 292,571 tokens/s, MFU 40.0% of 989 TFLOPS, peak $peak MiB, loss 10.9876 -> 10.5000"
EOF
chmod +x "$tmp/bin/nvidia-smi" "$tmp/stand-in"
ln -s "$tmp/stand-in" "$tmp/bin/dptrain"
ln -s "$tmp/stand-in" "$tmp/bin/bench"
# python3 itself, not a version manager's shim before it: the script runs it at every try.
ln -s "$(python3 -c 'import sys; print(sys.executable)')" "$tmp/bin/python3"
stand_ins=(env PATH="$tmp/bin:$PATH" DPTRAIN="$tmp/bin/dptrain" TORCH_BENCH="$tmp/bin/bench")

"${stand_ins[@]}" OUT="$tmp/run" TORCH_MODES="compile eager" TORCH_PEAKS_EAGER="16:16900 32:31300" TORCH_HEADROOM_MIB=2048 \
  bash "$script" >"$tmp/run.out" 2>&1 || bad "gpt_max_batch.sh failed: $(cat "$tmp/run.out")"
table=$tmp/run/table.txt
[ -s "$table" ] && ok || bad "no table: $(cat "$tmp/run.out")"
# none: 16 32 64 fit, 128 out of memory; 96 out, 80 fit, 88 fit: the edge within 8.
expect "$table" "dptrain none" 88 44.25 45.00 264.5 340,688 96 7
grep -q '^dptrain none B 80: fit' "$tmp/run.out" && ok || bad "no bisection to B 80: $(cat "$tmp/run.out")"
# gelu+ln: 16 ... 128 fit; 256 fails otherwise: no out of memory, and the search stops there.
expect "$table" "dptrain gelu\\+ln" 128 64.25 65.00 384.5 340,889 - 5
note "$table" "dptrain gelu\\+ln" "error at B 256 (status 1: dptrain: error: CUDA error: misaligned address)"
# compile: B 16 and 32 side by side; (81559 - 2048 - 1500) / 600 = 130 -> 128 fits, 136 does not.
expect "$table" "torch compile" 128 76.46 - 448.0 292,571 136 4
note "$table" "torch compile" "predicted B 128"
# eager from the given peaks: (79511 - 2500) / 900 = 85.6 -> 80 fits, 88 (a traceback) does not.
expect "$table" "torch eager" 80 72.75 - 280.0 292,571 88 2
grep -q '^torch eager B 88: oom' "$tmp/run.out" && ok || bad "eager's traceback is not out of memory: $(cat "$tmp/run.out")"
[ -s "$tmp/run/max_batch.log" ] && [ -s "$tmp/run/dptrain-gelu-ln-B64.log" ] && ok || bad "logs missing: $(ls "$tmp/run")"

# The caps: no try once a part's time is up. (A try the cap kills, status 124, is the
# fixture's torch eager B 32.)
"${stand_ins[@]}" OUT="$tmp/caps" DPTRAIN_SECONDS=0 TORCH_SECONDS=0 RECOMPUTE=none \
  bash "$script" >"$tmp/caps.out" 2>&1 || bad "gpt_max_batch.sh with caps failed: $(cat "$tmp/caps.out")"
expect "$tmp/caps/table.txt" "dptrain none" - - - - - - 0 stopped: the 0 s cap '(DPTRAIN_SECONDS)'
expect "$tmp/caps/table.txt" "torch compile" - - - - - - 0 stopped: the 0 s cap '(TORCH_SECONDS)'

# A batch out of memory beside the other is tried again alone, and counts once; one peak
# predicts nothing.
"${stand_ins[@]}" OUT="$tmp/alone" DPTRAIN_SECONDS=0 RECOMPUTE=none TORCH_FIT_BATCHES="16 200" \
  bash "$script" >"$tmp/alone.out" 2>&1 || bad "gpt_max_batch.sh, B 200 beside 16, failed: $(cat "$tmp/alone.out")"
expect "$tmp/alone/table.txt" "torch compile" 16 10.84 - 56.0 292,571 200 2
note "$tmp/alone/table.txt" "torch compile" "stopped: fewer than two peaks to predict from (16:11100)"
[ -s "$tmp/alone/torch-compile-B200.log" ] && ok || bad "B 200 was not tried alone: $(ls "$tmp/alone")"

# The default headroom, a fifth of the GPU: (81559 - 16311 - 1500) / 600 = 106.2 -> B 104.
"${stand_ins[@]}" OUT="$tmp/fifth" DPTRAIN_SECONDS=0 RECOMPUTE=none TORCH_PEAKS_COMPILE="16:11100 32:20700" \
  bash "$script" >"$tmp/fifth.out" 2>&1 || bad "gpt_max_batch.sh, default headroom, failed: $(cat "$tmp/fifth.out")"
grep -q '^torch compile: predicted B 104 ' "$tmp/fifth.out" && ok || bad "not B 104 a fifth short: $(cat "$tmp/fifth.out")"

# No GPU (nvidia-smi finds none): one line, status 1.
mkdir -p "$tmp/no-gpu"
printf '#!/bin/sh\necho "No devices were found"\nexit 6\n' >"$tmp/no-gpu/nvidia-smi"
chmod +x "$tmp/no-gpu/nvidia-smi"
env PATH="$tmp/no-gpu:$PATH" DPTRAIN=/bin/false OUT="$tmp/none" bash "$script" >/dev/null 2>"$tmp/err"
rc=$?
[ $rc -eq 1 ] && grep -q 'no GPU' "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 1 ] && ok || bad "no GPU: status $rc: $(cat "$tmp/err")"
finish
