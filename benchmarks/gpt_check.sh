#!/usr/bin/env bash
# The language-model work on the GPU machine in one call: build what it runs, the GPU tests
# (TESTS: a Catch2 filter, default every GPU case; none: skip), then GPT training through
# the CLI on the GPU beside the CPU (fp32: the same losses; bf16; a CUDA graph; two logical
# replicas), with MEMORY=1 GPT-2's peak memory with each --recompute, with TRACE=1 a GPT-2 124M step's kernels summed by name (kernel_trace), and with BENCH=1 the GPT-2 124M step (bf16, B 16, T 1024, random tokens) in
# dptrain beside PyTorch eager and torch.compile in the same call. Logs go to $OUT.
# The cuDNN frontend's headers come with the tree (build/_deps/cudnn_frontend/include),
# as the GPU machine has no network.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/dpt_gpt_check}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
grep -E "dptrain: (CUDA|cuDNN)" "$out/configure.log"
targets="dptrain_cli $([ "${TESTS:-}" != none ] && echo dpt_gpu_tests) $([ "${TRACE:-0}" = 1 ] && echo dpt_kernel_trace)"
cmake --build build --target $targets >"$out/build.log" 2>&1 ||
  { grep -E 'error|warning' "$out/build.log" | head -40; exit 1; }
echo "built in ${SECONDS}s"

if [ "${TESTS:-}" != none ]; then
  timeout 420 build/tests/dpt_gpu_tests ${TESTS:+"$TESTS"} >"$out/gpu_tests.log" 2>&1
  echo "dpt_gpu_tests ${TESTS:-}: exit $? | $(grep -E 'All tests passed|test cases' "$out/gpu_tests.log" | tail -1)"
  grep -B5 -A15 -E 'FAILED|REQUIRE|CHECK\(' "$out/gpu_tests.log" | head -60
fi

# The losses of a small GPT: the GPU's fp32 steps against the CPU's, then bf16 and a graph.
gpt() { build/apps/dptrain --model gpt:L4-H4-C128-T64-V512 --batch 16 --steps 50 --optimizer adamw --lr 0.003 --weight-decay 0.1 \
  --log-every 10 "$@" 2>&1; }
losses() { grep -E '^step' | awk '{print $4}' | tr '\n' ' '; }
echo "cpu    fp32: $(gpt --devices cpu | losses)"
echo "cuda:0 fp32: $(gpt --devices cuda:0 --precision fp32 | losses)"
echo "cuda:0 x2  : $(gpt --devices cuda:0,cuda:0 --precision fp32 | losses)"
echo "cuda:0 bf16: $(gpt --devices cuda:0 --precision bf16 | losses)"
echo "graph  bf16: $(gpt --devices cuda:0 --precision bf16 --cuda-graph | losses)"
echo "x2 bf16 gradients: $(gpt --devices cuda:0,cuda:0 --precision fp32 --grad-comm bf16 | losses)"
echo "zero 2 fp32: $(gpt --devices cuda:0 --precision fp32 --zero 2 --bucket-mb 0.05 | losses)"
echo "zero 2 bf16: $(gpt --devices cuda:0 --precision bf16 --zero 2 --bucket-mb 0.05 | losses)"

# Where a GPT-2 124M bf16 step's GPU time goes (B 16 x T 1024, eager), summed by kernel.
if [ "${TRACE:-0}" = 1 ]; then
  CUDA_INJECTION64_PATH=build/benchmarks/libdpt_kernel_trace.so DPT_TRACE_OUT="$out/gpt2_trace.csv" \
    build/apps/dptrain --model gpt2 --devices cuda:0 --precision bf16 --batch 16 --steps 24 --log-every 12 \
    --optimizer adamw --lr 6e-4 --beta2 0.95 --weight-decay 0.1 >"$out/gpt2_trace.log" 2>&1
  python3 benchmarks/kernel_trace.py "$out/gpt2_trace.csv" --by-kernel --label "gpt2 B16 bf16 eager" | tee "$out/gpt2_trace.txt" | head -60
fi

# GPT-2 124M's peak memory and step with each recomputation, at B 16 and 32 (MEMORY=1).
if [ "${MEMORY:-0}" = 1 ]; then
  for run in "16 none" "16 gelu" "16 gelu+ln" "32 none" "32 gelu+ln"; do
    read -r b r <<<"$run"
    build/apps/dptrain --model gpt2 --devices cuda:0 --precision bf16 --batch "$b" --steps 12 --log-every 12 \
      --optimizer adamw --lr 6e-4 --beta2 0.95 --weight-decay 0.1 --recompute "$r" 2>&1 | tee -a "$out/memory.log" |
      grep -E '^(done|memory)' | sed "s/^/dptrain gpt2 B $b --recompute $r: /"
  done
fi
[ "${BENCH:-0}" = 1 ] || exit 0

# GPT-2 124M, bf16, B 16 x T 1024 of random tokens: dptrain's loop and PyTorch's step.
for g in "" "--cuda-graph"; do
  build/apps/dptrain --model gpt2 --devices cuda:0 --precision bf16 --batch 16 --steps 30 --log-every 10 \
    --optimizer adamw --lr 6e-4 --beta2 0.95 --weight-decay 0.1 $g 2>&1 | tee -a "$out/gpt2.log" |
    grep -E '^(step 30|done|memory)' | sed "s/^/dptrain gpt2 B 16 bf16 ${g:-eager}: /"
done
python3 benchmarks/torch_gpt_bench.py --model gpt2 --batch 16 --mode eager 2>&1 | tail -1
timeout 300 python3 benchmarks/torch_gpt_bench.py --model gpt2 --batch 16 --mode compile 2>&1 | tail -1
# The bare step beside them (step_bench: the same batch of random tokens, fixed, and AdamW),
# eager and as a graph; compare.sh gpt puts all of them in one table.
cmake --build build --target step_bench >>"$out/build.log" 2>&1 || { grep -E 'error' "$out/build.log" | head -20; exit 1; }
for g in "" --cuda-graph; do
  build/benchmarks/step_bench --model gpt2 --batch 16 --warmup 10 --blocks 5 --steps 10 $g 2>&1 | tail -1
done
