#!/usr/bin/env bash
# compare.sh gpt: GPT-2 124M (bf16, T 1024, a fixed batch of random tokens; AdamW lr 6e-4,
# betas 0.9 0.95, weight decay 0.1) in dptrain beside PyTorch, in one call on the GPU machine:
#   step      step_bench --model gpt2 (the bare step), eager and --cuda-graph
#   torch     torch_gpt_bench.py: the same model (nanoGPT's, F.scaled_dot_product_attention,
#             fused AdamW, bf16 autocast), eager and torch.compile
#   loop      dptrain's CLI end to end (the same optimizer), eager and --cuda-graph, beside the
#             bare step: loop/step = the loop's ms/step (its summary, a mean after the first
#             step) over step_bench's mean
# at each batch of BATCHES (default "16 32"), then one table: ms/step, tokens/s, MFU (6N +
# 6LCT flops a token, N without the position embedding, against PEAK_TFLOPS a GPU, default
# 989: the dense bf16 peak of an H100 or H200 SXM), peak MiB (allocated; the loop's as its
# summary prints it), and speed against torch.compile (its ms over this row's).
# TRACE=1 adds where the bare eager step's GPU time goes at the first batch (kernel_trace,
# summed by kernel). STEPS: the loop's steps (default 60). Logs go to $OUT or /tmp/dpt_compare.
set -u
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/dpt_compare}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 # NVLink multicast can take a shared host's GPUs down (GPU.md)
peak=${PEAK_TFLOPS:-989} batches=${BATCHES:-16 32} loop_steps=${STEPS:-60}

if [ ! -f build/build.ninja ]; then
  bash .ci/deps
  cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
fi
targets="step_bench dptrain_cli $([ "${TRACE:-0}" = 1 ] && echo dpt_kernel_trace)"
# shellcheck disable=SC2086  # the target list splits
cmake --build build --target $targets >"$out/gpt-build.log" 2>&1 ||
  { grep -E 'error' "$out/gpt-build.log" | head -40; exit 1; }

adamw=(--optimizer adamw --lr 6e-4 --beta2 0.95 --weight-decay 0.1)
{
  for batch in $batches; do
    for graph in "" --cuda-graph; do
      build/benchmarks/step_bench --model gpt2 --batch "$batch" --precision bf16 --warmup 10 --blocks 5 --steps 10 \
        --peak-tflops "$peak" $graph || echo "dptrain gpt2 B $batch ${graph:-eager}: failed"
    done
    for mode in eager compile; do
      timeout 400 python3 benchmarks/torch_gpt_bench.py --model gpt2 --batch "$batch" --mode "$mode" \
        --peak-tflops "$peak" 2>&1 | tail -1
    done
    for graph in "" --cuda-graph; do
      log="$out/gpt-loop-B$batch${graph:+-graph}.log"
      build/apps/dptrain --model gpt2 --devices cuda:0 --precision bf16 --batch "$batch" --steps "$loop_steps" \
        --log-every "$loop_steps" "${adamw[@]}" $graph >"$log" 2>&1
      ms=$(grep -E '^done' "$log" | grep -oE '[0-9.]+ ms/step')
      mem=$(grep -E '^memory cuda:0' "$log" | grep -oE 'peak [0-9.]+ [KMGT]?i?B')
      echo "dptrain-loop gpt2 B $batch ${graph:-eager}: ${ms:-failed (see $log)}, ${mem:-peak ?}"
    done
  done
} 2>&1 | tee "$out/gpt.log"

echo
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "== GPT-2 124M, bf16, T 1024, dptrain vs PyTorch, same run ($(date -u +%F), $gpu_name) =="
python3 - "$out/gpt.log" "$peak" <<'PY'
import re, sys

log, peak = sys.argv[1], float(sys.argv[2])
STEP = re.compile(r"dptrain gpt2 B (\d+) T (\d+) \S+ \S+?(-graph)?: ([\d.]+) ms/step, (\d+) tokens/s, MFU ([\d.]+)% "
                  r"of \S+ TFLOPS, peak ([\d.]+) MiB, loss \S+ -> [^;]+; mean ([\d.]+) ms/step")
TORCH = re.compile(r"torch gpt2 B (\d+) T (\d+) (eager|compile): ([\d.]+) ms/step, ([\d,]+) tokens/s, MFU ([\d.]+)% "
                   r"of \S+ TFLOPS, peak ([\d.]+) MiB")
LOOP = re.compile(r"dptrain-loop gpt2 B (\d+) (\S+): ([\d.]+) ms/step, peak ([\d.]+) ([KMGT]?i?B)")
UNIT = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20}
rows = {}  # (batch, run) -> dict(ms, tokens, mfu, mib, mean)
flops = {}  # batch -> flops a token, from the step's line (MFU x peak / tokens/s)
for line in open(log):
    if m := STEP.match(line):
        b, t, graph, ms, tok, mfu, mib, mean = m.groups()
        run = "dptrain step " + ("graph" if graph else "eager")
        rows[(int(b), run)] = dict(ms=float(ms), tokens=float(tok), mfu=float(mfu), mib=float(mib), mean=float(mean))
        flops[int(b)] = float(mfu) / 100 * peak * 1e12 / float(tok)
    elif m := TORCH.match(line):
        b, t, mode, ms, tok, mfu, mib = m.groups()
        rows[(int(b), "torch " + mode)] = dict(ms=float(ms), tokens=float(tok.replace(",", "")), mfu=float(mfu),
                                              mib=float(mib))
    elif m := LOOP.match(line):
        b, mode, ms, amount, unit = m.groups()
        ms, b = float(ms), int(b)
        rows[(b, "dptrain loop " + ("graph" if mode == "--cuda-graph" else "eager"))] = dict(
            ms=ms, tokens=b * 1024 * 1e3 / ms, mib=float(amount) * UNIT[unit])
order = ["dptrain step eager", "dptrain step graph", "dptrain loop eager", "dptrain loop graph", "torch eager",
         "torch compile"]
print(f"MFU: 6N + 6LCT flops a token against {peak:g} TFLOPS; vs compile: torch.compile's ms / this row's "
      "(above 1: faster); loop/step: the loop's ms over the bare step's mean (the same mode)")
print(f"{'run':<20}{'B':>4}{'ms/step':>10}{'tokens/s':>11}{'MFU':>7}{'peak MiB':>10}{'vs compile':>12}{'loop/step':>11}")
for b in sorted({b for b, _ in rows}):
    compiled = rows.get((b, "torch compile"))
    for run in order:
        r = rows.get((b, run))
        if not r:
            print(f"{run:<20}{b:>4}{'-':>10}")
            continue
        mfu = r.get("mfu")
        if mfu is None and b in flops:
            mfu = 100 * flops[b] * r["tokens"] / (peak * 1e12)
        step = rows.get((b, run.replace("loop", "step"))) if "loop" in run else None
        mfu_text = f"{mfu:.1f}%" if mfu else "-"
        vs_compile = f"{compiled['ms'] / r['ms']:.2f}x" if compiled else "-"
        loop_step = f"{r['ms'] / step['mean']:.3f}" if step else "-"
        print(f"{run:<20}{b:>4}{r['ms']:>10.2f}{r['tokens']:>11,.0f}{mfu_text:>7}{r['mib']:>10.0f}{vs_compile:>12}"
              f"{loop_step:>11}")
PY

if [ "${TRACE:-0}" = 1 ]; then
  batch=${batches%% *}
  echo
  CUDA_INJECTION64_PATH=build/benchmarks/libdpt_kernel_trace.so DPT_TRACE_OUT="$out/gpt2_step_trace.csv" \
    build/benchmarks/step_bench --model gpt2 --batch "$batch" --precision bf16 --warmup 5 --blocks 2 --steps 10 \
    >"$out/gpt2_step_trace.log" 2>&1
  python3 benchmarks/kernel_trace.py "$out/gpt2_step_trace.csv" --by-kernel --label "step_bench gpt2 B$batch bf16 eager" |
    tee "$out/gpt2_step_trace.txt" | head -60
fi
