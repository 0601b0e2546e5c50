#!/usr/bin/env bash
# dptrain against PyTorch on the GPU machine, in one call: builds dptrain (if needed), runs
# dpbench and torch_bench.py on the same workloads (BENCHMARKS.md: MSE + SGD lr 0.01 on a
# fixed random batch, the same number of steps on both sides) and prints one table.
#   single: one GPU, seed (batch 64), mlp (batch 4096) and cnn (batch 256 of 3x32x32,
#           cross-entropy), fp32/tf32/bf16; dptrain's
#           plain step against PyTorch eager, and PyTorch's CUDA-graph step against
#           dptrain's where dpbench has --cuda-graph; the training loop end to end
#           (dptrain's CLI against torch_loop_bench.py, a loop that also makes its batch on
#           the GPU each step and reads the loss every 100 steps, eager and graph); and
#           training from .npy files against synthetic data and PyTorch's DataLoader loop
#           (file_data_bench.sh)
#   multi:  (more than one GPU) mlp fp32 on 1, 2, 4, ... N GPUs, weak scaling (4096 per
#           GPU) and strong scaling (4096 x N in all): dptrain nccl against DDP, dptrain
#           p2p against nn.DataParallel; efficiency against each side's plain 1-GPU step
#   loop:   single's training loop block alone
#   gpt:    GPT-2 124M bf16 (not part of all): step_bench --model gpt2 at B 16 and 32 (eager
#           and --cuda-graph) beside torch_gpt_bench.py (eager and torch.compile) and dptrain's
#           loop beside the bare step, in one table with tokens/s and MFU (gpt_compare.sh)
#   maxbatch: GPT-2 124M bf16 (not part of all): the largest batch that trains on one GPU,
#           dptrain's (--recompute none and gelu+ln) and torch.compile's (gpt_max_batch.sh)
# Usage: compare.sh [single|multi|loop|gpt|maxbatch|all] (all). Logs and dpbench's files go to $OUT
# (the device tool's folder) or /tmp/dpt_compare.
set -u
cd "$(dirname "$0")/.." || exit 1
what=${1:-all}
case $what in
  single | multi | loop | all) ;;
  gpt) exec bash benchmarks/gpt_compare.sh ;;
  maxbatch) exec bash benchmarks/gpt_max_batch.sh ;;
  *) echo "usage: $0 [single|multi|loop|gpt|maxbatch|all]" >&2; exit 2 ;;
esac
out=${OUT:-/tmp/dpt_compare}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0  # NVLink multicast can take a shared host's GPUs down (GPU.md)

if [ ! -f build/build.ninja ]; then
  bash .ci/deps
  cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
fi
dpbench=build/benchmarks/dpbench
gpus=$(nvidia-smi -L | wc -l)
graph=0
if [ "$what" != loop ]; then
  cmake --build build --target dpbench >"$out/build.log" 2>&1 || { grep -E 'error' "$out/build.log" | head -40; exit 1; }
  "$dpbench" --help | grep -q -- '--cuda-graph' && graph=1
fi

# Steps on both sides: dpbench's warm-up + timed steps = torch_bench's warm-up + blocks x steps.
# dpbench NAME ARGS...: a dpbench run into $out/NAME; a failure ends the script.
run_dpbench() {
  local name=$1
  shift
  "$dpbench" "$@" --out "$out/$name" >"$out/$name.log" 2>&1 || { tail -5 "$out/$name.log"; exit 1; }
}

if [ "$what" = single ] || [ "$what" = all ]; then
  for w in "seed 64" "mlp 4096" "cnn 256"; do
    read -r model batch <<<"$w"
    args=(--gpus 1 --model "$model" --batch "$batch" --precision "fp32,tf32,bf16" --scaling weak
      --warmup 20 --steps 140)
    run_dpbench "single-$model" "${args[@]}"
    [ "$graph" = 1 ] && run_dpbench "single-$model-graph" "${args[@]}" --cuda-graph
  done
  for w in "seed 64" "mlp 4096" "cnn 256"; do
    read -r model batch <<<"$w"
    for p in fp32 tf32 bf16; do
      for mode in eager graph; do
        python3 benchmarks/torch_bench.py --model "$model" --batch "$batch" --precision "$p" --mode "$mode" \
          --warmup 20 --blocks 7 --steps 20
      done
    done
  done 2>&1 | tee "$out/torch-single.log"
fi
if [ "$what" != multi ]; then
  cmake --build build --target dptrain_cli >>"$out/build.log" 2>&1 || { grep -E 'error' "$out/build.log" | head; exit 1; }
  # The loop end to end: dptrain's summary ms/step beside PyTorch's loop (the same steps).
  {
    for w in "default 256 fp32 5000" "seed 64 fp32 5000" "mlp 4096 tf32 300" "mlp 4096 bf16 300"; do
      read -r model batch prec steps <<<"$w"
      margs=()
      [ "$model" != default ] && margs=(--model "$model" --batch "$batch")
      for graph_flag in "" --cuda-graph; do
        ms=$(build/apps/dptrain --devices cuda:0 "${margs[@]}" --precision "$prec" --lr 0.01 --momentum 0 \
          --steps "$steps" --log-every 100 $graph_flag | grep -E '^done' | grep -oE '[0-9.]+ ms/step')
        echo "dptrain-loop $model batch $batch $prec ${graph_flag:-eager}: $ms"
      done
      for mode in eager graph; do
        python3 benchmarks/torch_loop_bench.py --model "$model" --batch "$batch" --precision "$prec" --mode "$mode" \
          --steps "$steps" --log-every 100
      done
    done
  } 2>&1 | tee "$out/loop.log"
  [ "$what" = loop ] || OUT="$out/file-data" bash benchmarks/file_data_bench.sh build >"$out/file-data.txt" 2>&1
fi

if { [ "$what" = multi ] || [ "$what" = all ]; } && [ "$gpus" -gt 1 ]; then
  run_dpbench multi --gpus "$gpus" --model mlp --batch 4096 --precision fp32 --reduce nccl,p2p \
    --scaling weak,strong --warmup 10 --steps 49
  counts=()
  for ((n = 1; n < gpus; n *= 2)); do counts+=("$n"); done
  counts+=("$gpus")
  declare -A done_runs=()
  torch_run() {  # mode gpus global-batch, each distinct run once
    local key="$1 $2 $3"
    [ -n "${done_runs[$key]:-}" ] && return
    done_runs[$key]=1
    python3 benchmarks/torch_bench.py --model mlp --precision fp32 --mode "$1" --gpus "$2" --batch "$3" \
      --warmup 10 --blocks 7 --steps 7
  }
  {
    for b in 4096 $((4096 * gpus)); do torch_run eager 1 "$b"; done  # the 1-GPU baselines
    for n in "${counts[@]}"; do
      for mode in ddp dp; do
        torch_run "$mode" "$n" $((4096 * n))     # weak
        torch_run "$mode" "$n" $((4096 * gpus))  # strong
      done
    done
  } 2>&1 | tee "$out/torch-multi.log"
fi

echo
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "== dptrain vs PyTorch, same run ($(date -u +%F), ${gpus}x $gpu_name) =="
python3 - "$out" "$gpus" <<'PY'
import csv, os, re, sys

out, gpus = sys.argv[1], int(sys.argv[2])
LINE = re.compile(r"torch (\S+) batch (\d+) (\S+) (\S+): ([\d.]+) ms/step, \S+ samples/s, peak ([\d.]+) MiB, "
                  r"loss (\S+) -> ([^,\s]+)(?:, per-GPU MiB (.*))?")
torch = {}  # (model, batch, precision, impl) -> dict
for name in ("torch-single.log", "torch-multi.log"):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        continue
    for line in open(path):
        m = LINE.match(line)
        if m:
            model, batch, prec, impl, ms, peak, l0, l1, per_gpu = m.groups()
            torch[(model, int(batch), prec, impl)] = dict(
                ms=float(ms), peak=float(peak), loss=f"{float(l0):.4g} -> {float(l1):.4g}",
                peaks=[float(p) for p in per_gpu.split()] if per_gpu else [float(peak)])


def dpbench(folder):
    path = os.path.join(out, folder, "dpbench.csv")
    return list(csv.DictReader(open(path))) if os.path.exists(path) else []


def peaks(row):  # "cuda:0=900.000;cuda:1=899.000" -> [900.0, 899.0]
    return [float(p.split("=")[1]) for p in row["peak_mib"].split(";")]


def loss(row):
    return f"{float(row['loss_first']):.4g} -> {float(row['loss_last']):.4g}"


def ratio(slow, fast):
    return f"{slow / fast:.2f}x" if slow and fast else "-"


def cell(v, f="{:.4f}"):
    return f.format(v) if v is not None else "-"


single = [(m, b) for m, b in (("seed", 64), ("mlp", 4096), ("cnn", 256)) if dpbench(f"single-{m}")]
if single:
    print("single GPU; speed-up = PyTorch ms / dptrain ms; peak = most memory allocated on the GPU")
    print(f"{'workload':<9}{'prec':<6}{'step':<7}{'dptrain ms':>11}{'torch ms':>10}{'speed-up':>10}"
          f"{'dptrain MiB':>13}{'torch MiB':>11}   {'dptrain loss':<20}{'torch loss':<20}")
    for model, batch in single:
        for impl, folder in (("eager", f"single-{model}"), ("graph", f"single-{model}-graph")):
            rows = {r["precision"]: r for r in dpbench(folder) if r["devices"] == "1"}
            for prec in ("fp32", "tf32", "bf16"):
                d, t = rows.get(prec), torch.get((model, batch, prec, impl))
                if not d and not t:
                    continue
                dms = float(d["step_ms"]) if d else None
                print(f"{model:<9}{prec:<6}{impl:<7}{cell(dms):>11}{cell(t and t['ms']):>10}"
                      f"{ratio(t and t['ms'], dms):>10}{cell(d and peaks(d)[0], '{:.1f}'):>13}"
                      f"{cell(t and t['peak'], '{:.1f}'):>11}   {d and loss(d) or '-':<20}{t and t['loss'] or '-':<20}")
    print()

multi = dpbench("multi")
if multi:
    print("N GPUs, mlp fp32; ratio = PyTorch ms / dptrain ms; eff = samples/s / (N x the plain 1-GPU step's), "
          "each side against its own; MiB = master / most of the others")
    print(f"{'scaling':<8}{'gpus':>5}{'batch':>7}{'nccl ms':>10}{'DDP ms':>10}{'ratio':>8}{'eff':>6}{'DDP':>6}"
          f"{'p2p ms':>10}{'DP ms':>10}{'ratio':>8}{'eff':>6}{'DP':>6}  {'nccl MiB':<15}{'DDP MiB':<15}"
          f"{'p2p MiB':<15}{'DP MiB':<15}")

    def mib(p):
        return f"{p[0]:.0f}/{max(p[1:]):.0f}" if len(p) > 1 else f"{p[0]:.0f}"

    for scaling in ("weak", "strong"):
        by = {(r["reduce"], int(r["devices"])): r for r in multi if r["scaling"] == scaling}
        for n in sorted({n for _, n in by}):
            batch = 4096 * (n if scaling == "weak" else gpus)
            batch1 = 4096 if scaling == "weak" else batch  # the batch of the 1-GPU run
            base = torch.get(("mlp", batch1, "fp32", "eager"))
            cols = []
            for path, mode in (("nccl", "ddp"), ("p2p", "dp")):
                d, t = by.get((path, n)), torch.get(("mlp", batch, "fp32", f"{mode}:{n}"))
                dms = float(d["step_ms"]) if d else None
                # samples/s on n GPUs over n x samples/s of PyTorch's eager step on one
                teff = (batch / t["ms"]) / (n * batch1 / base["ms"]) if base and t else None
                cols.append(f"{cell(dms):>10}{cell(t and t['ms']):>10}{ratio(t and t['ms'], dms):>8}"
                            f"{cell(d and float(d['efficiency']), '{:.0%}'):>6}{cell(teff, '{:.0%}'):>6}")
                cols.append((mib(peaks(d)) if d else "-", mib(t["peaks"]) if t else "-"))
            print(f"{scaling:<8}{n:>5}{batch:>7}{cols[0]}{cols[2]}  {cols[1][0]:<15}{cols[1][1]:<15}"
                  f"{cols[3][0]:<15}{cols[3][1]:<15}")
    print("(1-GPU rows: dptrain runs one device without reduction; PyTorch runs DDP world size 1 and "
          "nn.DataParallel(device_ids=[0]))")
PY
if [ -f "$out/loop.log" ]; then
  echo
  echo "training loop end to end, ms/step (dptrain's summary; PyTorch's loop makes its batch on the GPU too)"
  python3 - "$out/loop.log" <<'PY'
import re, sys
ms = {}
for line in open(sys.argv[1]):
    m = re.match(r"(dptrain|torch)-loop (\S+) batch (\d+) (\S+) (\S+): ([\d.]+)", line)
    if m:
        side, model, batch, prec, mode, v = m.groups()
        ms[(side, model, batch, prec, "graph" if mode in ("graph", "--cuda-graph") else "eager")] = float(v)
print(f"{'workload':<10}{'batch':>6}{'prec':>6}{'mode':>7}{'dptrain':>10}{'torch':>10}{'speed-up':>10}")
for (side, model, batch, prec, mode), v in ms.items():
    if side != "dptrain":
        continue
    t = ms.get(("torch", model, batch, prec, mode))
    print(f"{model:<10}{batch:>6}{prec:>6}{mode:>7}{v:>10.4f}{(t or 0):>10.4f}{(f'{t / v:.2f}x' if t else '-'):>10}")
PY
fi
if [ -f "$out/file-data.txt" ]; then
  echo
  sed -n '/^== training from/,$p' "$out/file-data.txt"
fi
