#!/usr/bin/env bash
# compare.sh gpt: GPT-2 124M (bf16, T 1024, a fixed batch of random tokens; AdamW lr 6e-4,
# betas 0.9 0.95, weight decay 0.1) in dptrain beside PyTorch, in one call on the GPU machine:
#   step      step_bench --model gpt2 (the bare step), eager and --cuda-graph
#   torch     torch_gpt_bench.py: the same model (nanoGPT's, F.scaled_dot_product_attention,
#             fused AdamW, bf16 autocast), eager and torch.compile
#   loop      dptrain's CLI end to end (the same optimizer), eager and --cuda-graph, beside the
#             bare step: loop/step = the loop's ms/step (its summary, a mean after the first
#             step; with --cuda-graph after the two that record) over step_bench's mean
# at each batch of BATCHES (default "16 32"), then one table: ms/step, tokens/s, MFU (6N +
# 6LCT flops a token, N without the position embedding, against PEAK_TFLOPS a GPU, default
# 989: the dense bf16 peak of an H100 or H200 SXM), peak MiB (allocated; the loop's as its
# summary prints it), and speed against torch.compile (its ms over this row's).
# TRACE=1 adds where the bare eager step's GPU time goes at the first batch (kernel_trace,
# summed by kernel). FAST_ATTENTION=1 adds the step and the loop with --attention-backward fast
# (cuDNN's non-deterministic attention backward, as PyTorch's cuDNN attention runs) beside dptrain's
# deterministic default. STEPS: the loop's steps (default 60). PREBUILT=1 skips the build and uses
# the binaries already in build/ (built elsewhere and copied there). Logs go to $OUT or
# /tmp/dpt_compare.
set -u
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/dpt_compare}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 # NVLink multicast can take a shared host's GPUs down (GPU.md)
# shellcheck source=torch_cudnn.sh
source benchmarks/torch_cudnn.sh  # PyTorch's cuDNN for both programs
peak=${PEAK_TFLOPS:-989} batches=${BATCHES:-16 32} loop_steps=${STEPS:-60}

if [ "${PREBUILT:-0}" = 1 ]; then
  for bin in build/benchmarks/step_bench build/apps/dptrain \
    $([ "${TRACE:-0}" = 1 ] && echo build/benchmarks/libdpt_kernel_trace.so); do
    [ -x "$bin" ] || { echo "PREBUILT=1 but $bin is missing or not executable" >&2; exit 1; }
  done
else
  if [ ! -f build/build.ninja ]; then
    bash .ci/deps
    cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
  fi
  targets="step_bench dptrain_cli $([ "${TRACE:-0}" = 1 ] && echo dpt_kernel_trace)"
  # shellcheck disable=SC2086  # the target list splits
  cmake --build build --target $targets >"$out/gpt-build.log" 2>&1 ||
    { grep -E 'error' "$out/gpt-build.log" | head -40; exit 1; }
fi

adamw=(--optimizer adamw --lr 6e-4 --beta2 0.95 --weight-decay 0.1)
attention=(deterministic)
[ "${FAST_ATTENTION:-0}" = 1 ] && attention+=(fast)
{
  for batch in $batches; do
    for backward in "${attention[@]}"; do
      for graph in "" --cuda-graph; do
        build/benchmarks/step_bench --model gpt2 --batch "$batch" --precision bf16 --warmup 10 --blocks 5 \
          --steps 10 --peak-tflops "$peak" --attention-backward "$backward" $graph ||
          echo "dptrain gpt2 B $batch ${graph:-eager} $backward: failed"
      done
    done
    for mode in eager compile; do
      timeout 400 python3 benchmarks/torch_gpt_bench.py --model gpt2 --batch "$batch" --mode "$mode" \
        --peak-tflops "$peak" 2>&1 | tail -1
    done
    for backward in "${attention[@]}"; do
      fast=$([ "$backward" = fast ] && echo -fast)
      for graph in "" --cuda-graph; do
        log="$out/gpt-loop-B$batch${graph:+-graph}$fast.log"
        build/apps/dptrain --model gpt2 --devices cuda:0 --precision bf16 --batch "$batch" --steps "$loop_steps" \
          --log-every "$loop_steps" "${adamw[@]}" --attention-backward "$backward" $graph >"$log" 2>&1
        ms=$(grep -E '^done' "$log" | grep -oE '[0-9.]+ ms/step')
        mem=$(grep -E '^memory cuda:0' "$log" | grep -oE 'peak [0-9.]+ [KMGT]?i?B')
        echo "dptrain-loop gpt2 B $batch ${graph:-eager}$fast: ${ms:-failed (see $log)}, ${mem:-peak ?}"
      done
    done
  done
} 2>&1 | tee "$out/gpt.log"

printf '\n== GPT-2 124M, bf16, T 1024, dptrain vs PyTorch, same run (%s, %s) ==\n' "$(date -u +%F)" \
  "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
python3 benchmarks/gpt_table.py "$out/gpt.log" --peak-tflops "$peak"

if [ "${TRACE:-0}" = 1 ]; then
  batch=${batches%% *}
  echo
  CUDA_INJECTION64_PATH=build/benchmarks/libdpt_kernel_trace.so DPT_TRACE_OUT="$out/gpt2_step_trace.csv" \
    build/benchmarks/step_bench --model gpt2 --batch "$batch" --precision bf16 --warmup 5 --blocks 2 --steps 10 \
    >"$out/gpt2_step_trace.log" 2>&1
  python3 benchmarks/kernel_trace.py "$out/gpt2_step_trace.csv" --by-kernel --label "step_bench gpt2 B$batch bf16 eager" |
    tee "$out/gpt2_step_trace.txt" | head -60
fi
