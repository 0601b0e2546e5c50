#!/usr/bin/env bash
# step_bench --check (the update the training loop makes: it also checks the gradients and
# records the check) trains as the plain step does while the gradients are finite: the same
# losses, on the CPU, and on a GPU where there is one (eager and as graphs; a model of
# twins_by_default's size takes twin buffers, a recording for each parity), a
# small GPT's too (AdamW), and a GPT's line has the fields torch_gpt_bench.py's has.
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
gpt=(--model gpt:L2-H2-C64-T32-V128 --batch 2)
same --devices cpu "${gpt[@]}"
# A GPT's line: batch and sequence length, bf16 by default, tokens/s and MFU (6N + 6LCT
# flops a token, N = 110336 parameters less the 32 x 64 position embedding) against the
# peak it names.
line=$("$bench" --blocks 1 --steps 2 --warmup 1 --devices cpu "${gpt[@]}" --seq 16 --peak-tflops 0.001)
if python3 - "$line" <<'PY'; then echo "ok: the GPT line ($line)"; else echo "FAIL: the GPT line: '$line'"; fails=$((fails + 1)); fi
import re, sys
m = re.fullmatch(r"dptrain gpt:L2-H2-C64-T32-V128 B 2 T 16 bf16 cpu: ([\d.]+) ms/step, (\d+) tokens/s, "
                 r"MFU ([\d.]+)% of 0.001 TFLOPS, peak ([\d.]+) MiB, loss ([\d.]+) -> ([\d.]+); mean ([\d.]+) ms/step",
                 sys.argv[1])
ms, tokens, mfu, peak, first, last, mean = map(float, m.groups())
assert abs(tokens - 2 * 16 * 1e3 / ms) <= 1 + 1e-3 * tokens, (tokens, ms)
flops = 6 * (110336 - 32 * 64) + 6 * 2 * 64 * 16
assert abs(mfu - 100 * flops * tokens / 1e9) <= 0.1 + 1e-3 * mfu, (mfu, flops, tokens)
assert peak > 0 and 4.0 < first < 5.5 and mean > 0, m.groups()  # ln 128 = 4.85 at the start
PY
# Bad flags: one line and status 2 before any step (--blocks 0 once read the median of no
# blocks: a segfault), and no flag taken where it means nothing.
for bad in "--blocks 0" "--steps -1" "--warmup 0" "--batch 0" "--steps 9223372036854775807" "--graph-steps 4" \
  "--cuda-graph" "--gemm native" "--peak-tflops 989" "--precision fp16" "--batch 1e3" "--attention-backward fast"; do
  # shellcheck disable=SC2086  # the words of each case are separate arguments
  err=$("$bench" --devices cpu --model 16-32-4 $bad 2>&1 >/dev/null)
  rc=$?
  if [ $rc -eq 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && [[ $err == "step_bench: error: "* ]]; then
    echo "ok: refused $bad ($err)"
  else
    echo "FAIL: $bad: rc $rc: $err"
    fails=$((fails + 1))
  fi
done
err=$("$bench" --devices cpu "${gpt[@]}" --attention-backward slow 2>&1 >/dev/null)
if [ "$err" = "step_bench: error: unknown --attention-backward 'slow': expected deterministic or fast" ]; then
  echo "ok: a GPT's attention backward is named"
else
  echo "FAIL: --attention-backward slow: $err"
  fails=$((fails + 1))
fi
err=$("$bench" --devices cpu:0,cpu:1 2>&1 >/dev/null)
if [ "$err" = "step_bench: error: step_bench times one device's step; --devices names 2" ]; then echo "ok: one device"
else
  echo "FAIL: --devices cpu:0,cpu:1: $err"
  fails=$((fails + 1))
fi
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  for graph in "" --cuda-graph; do
    same --devices cuda:0 $graph
    same --devices cuda:0 --model 1024-1024x2-1024 --batch 256 $graph
    same --devices cuda:0 "${gpt[@]}" $graph
  done
  # cuDNN's fast attention backward: its line says so, the same first loss (the forward is
  # the same), the last within rounding of the deterministic one's.
  det=$("$bench" --blocks 1 --steps 3 --warmup 2 --devices cuda:0 "${gpt[@]}")
  fast=$("$bench" --blocks 1 --steps 3 --warmup 2 --devices cuda:0 "${gpt[@]}" --attention-backward fast)
  if python3 - "$det" "$fast" <<'PY'; then echo "ok: fast attention ($fast)"; else echo "FAIL: fast attention: '$det' against '$fast'"; fails=$((fails + 1)); fi
import re, sys
det, fast = sys.argv[1:]
assert " bf16 cublas-fast-attention: " in fast and " bf16 cublas: " in det
(d0, d1), (f0, f1) = (map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", s).groups()) for s in (det, fast))
assert d0 == f0 and abs(d1 - f1) < 1e-2 * d1, (d0, d1, f0, f1)
PY
fi
[ "$fails" -eq 0 ]
