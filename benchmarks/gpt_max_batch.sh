#!/usr/bin/env bash
# compare.sh maxbatch: the largest batch B of GPT-2 124M (bf16, T 1024, random tokens; AdamW
# lr 6e-4, betas 0.9 0.95, weight decay 0.1) that trains on one GPU without running out of
# memory, dptrain's and PyTorch's, in one call on the GPU machine:
#   dptrain  dptrain --model gpt2 --steps 3 --recompute R, for each R of RECOMPUTE (default
#            "none gelu+ln"): B doubles from 16 to the first out of memory (at most MAX_BATCH,
#            1024), then a bisection between the last fit and it down to BATCH_RESOLUTION (8)
#            sequences; a try takes seconds, all of them together at most DPTRAIN_SECONDS (150)
#   torch    torch_gpt_bench.py --mode M (3 + 3 x 3 steps), for each M of TORCH_MODES (default
#            compile; "compile eager" for both): a torch.compile try takes 40-60 s, so no
#            bisection. The peaks at two batches (TORCH_FIT_BATCHES, default "16 32", run side
#            by side; or TORCH_PEAKS_COMPILE / TORCH_PEAKS_EAGER, e.g. "16:15000 32:28000", peak
#            MiB from an earlier run) give a line; where it crosses the GPU's memory less
#            TORCH_HEADROOM_MIB (a fifth of it: the CUDA context, the allocator's slack),
#            rounded down to the resolution, is the predicted B. A try there, then up by the resolution to the
#            first out of memory (down to the first fit if it did not fit), at most 3 tries;
#            a mode takes at most TORCH_SECONDS (240)
# then one table (gpt_max_batch.py table): each run's largest B that fit, its peak memory and
# ms/step, and the first B that ran out of memory. Out of memory (status 3 and its one line,
# dptrain's and the bench's alike) is told from other failures; a failure or the time cap ends
# that run's search, and the table says which. Logs go to $OUT or /tmp/dpt_max_batch:
# max_batch.log (every try's output after its "== try" line), one file a try, table.txt.
# DPTRAIN and TORCH_BENCH: programs to run instead of dptrain and python3 torch_gpt_bench.py
# (the test's stand-ins); without DPTRAIN, build/apps/dptrain is built first.
set -u
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-/tmp/dpt_max_batch}
mkdir -p "$out"
resolution=${BATCH_RESOLUTION:-8} max_batch=${MAX_BATCH:-1024}
recompute=${RECOMPUTE:-none gelu+ln} torch_modes=${TORCH_MODES:-compile}
dptrain_seconds=${DPTRAIN_SECONDS:-150} torch_seconds=${TORCH_SECONDS:-240}
fit_batches=${TORCH_FIT_BATCHES:-16 32}
dptrain=${DPTRAIN:-build/apps/dptrain} torch_bench=(python3 benchmarks/torch_gpt_bench.py)
[ -n "${TORCH_BENCH:-}" ] && torch_bench=("$TORCH_BENCH")
judge=benchmarks/gpt_max_batch.py log=$out/max_batch.log

gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null) || gpu_name=""
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null) || total_mib=""
if [ -z "$gpu_name" ] || [[ ! $total_mib =~ ^\ *[0-9]+\ *$ ]]; then
  echo "$0: no GPU (nvidia-smi names none)" >&2
  exit 1
fi
total_mib=${total_mib//[^0-9]/}
# A fifth of the GPU by default: on an H100 80GB (2026-12-06) torch.compile's allocated peak
# ran out of memory one resolution past 78% of it (B 144 fit at 61.9 GiB, B 152 did not),
# where a line to 2048 MiB short of it predicted B 176.
headroom=${TORCH_HEADROOM_MIB:-$((total_mib / 5))}
if [ -z "${DPTRAIN:-}" ]; then
  if [ ! -f build/build.ninja ]; then
    bash .ci/deps
    cmake -S . -B build -G Ninja -DDPT_WERROR=ON >"$out/configure.log" 2>&1 || { tail -20 "$out/configure.log"; exit 1; }
  fi
  cmake --build build --target dptrain_cli >"$out/build.log" 2>&1 || { grep -E 'error' "$out/build.log" | head -40; exit 1; }
fi
echo "== gpu: $gpu_name, $total_mib MiB, $(date -u +%F)" >"$log"

# record SIDE MODE B STATUS FILE [VERDICT]: a try's output into the log after its "== try"
# line; sets $result to its verdict, as given or as gpt_max_batch.py judges it ("fit <peak
# MiB> <ms>", "oom", "timeout", "error <line>").
record() {
  { echo "== try $1 $2 B $3: status $4"; cat "$5"; [ -z "$(tail -c 1 "$5")" ] || echo; } >>"$log"
  result=${6:-$(python3 "$judge" verdict "$1" "$4" "$5")}
  local word mib ms
  read -r word mib ms <<<"$result"
  if [ "$word" = fit ]; then echo "$1 $2 B $3: fit, peak $mib MiB, $ms ms/step"; else echo "$1 $2 B $3: $result"; fi
}

# attempt SIDE MODE B DEADLINE COMMAND...: one try, killed at DEADLINE (in $SECONDS), its
# output in a file of its own and the log; $result as record sets it, or "stopped" where
# the deadline had passed before it.
attempt() {
  local side=$1 mode=$2 batch=$3 left=$(($4 - SECONDS))
  shift 4
  if [ "$left" -le 0 ]; then result=stopped; return; fi
  local file="$out/$side-${mode//+/-}-B$batch.log"
  timeout --kill-after=10 "$left" "$@" >"$file" 2>&1
  record "$side" "$mode" "$batch" $? "$file"
}

# stop SIDE MODE WHY: a run's search ends before its edge; the table says why.
stop() {
  echo "== stop $1 $2: $3" >>"$log"
  echo "$1 $2: stopped: $3"
}

# ended SIDE MODE SECONDS KNOB: after a try that neither fit nor ran out of memory (an error
# is in the table already), notes the time cap where that was what ended it.
ended() {
  case $result in
    stopped | timeout) stop "$1" "$2" "the $3 s cap ($4)" ;;
  esac
}

# dptrain at B with recomputation R.
try_dptrain() {
  attempt dptrain "$1" "$2" "$dptrain_deadline" "$dptrain" --model gpt2 --devices cuda:0 --precision bf16 \
    --batch "$2" --steps 3 --log-every 3 --optimizer adamw --lr 6e-4 --beta2 0.95 --weight-decay 0.1 --recompute "$1"
}

search_dptrain() {
  local r=$1 lo=0 hi=0 b=16 mid
  while :; do  # doubling: 16, 32, 64, ... to the first out of memory
    try_dptrain "$r" "$b"
    case $result in
      fit*) lo=$b ;;
      oom) hi=$b && break ;;
      *) ended dptrain "$r" "$dptrain_seconds" DPTRAIN_SECONDS; return ;;
    esac
    [ $((b * 2)) -le "$max_batch" ] || return  # the table says that nothing ran out of memory
    b=$((b * 2))
  done
  while [ $((hi - lo)) -gt "$resolution" ]; do  # bisection, at multiples of the resolution
    mid=$(((lo + hi) / 2 / resolution * resolution))
    [ "$mid" -gt "$lo" ] || mid=$((lo + resolution))
    try_dptrain "$r" "$mid"
    case $result in
      fit*) lo=$mid ;;
      oom) hi=$mid ;;
      *) ended dptrain "$r" "$dptrain_seconds" DPTRAIN_SECONDS; return ;;
    esac
  done
}

# torch_command MODE B: sets $bench to the bench's command in MODE at B.
torch_command() {
  bench=("${torch_bench[@]}" --model gpt2 --batch "$2" --mode "$1" --warmup 3 --blocks 3 --steps 3)
}

# fit_peaks MODE DEADLINE: runs the bench at each of TORCH_FIT_BATCHES side by side (compiling
# is mostly host work, two small batches fit together, and a peak is the process's own) and
# sets $points to "B:MiB" of each that fit. One out of memory is tried again alone, so that
# only a try of its own says so in the table.
fit_peaks() {
  local mode=$1 deadline=$2 b i status file bench pids=() batches=() left=$(($2 - SECONDS))
  points=()
  [ "$left" -gt 0 ] || return
  for b in $fit_batches; do
    torch_command "$mode" "$b"
    timeout --kill-after=10 "$left" "${bench[@]}" >"$out/torch-$mode-B$b-side-by-side.log" 2>&1 &
    pids+=($!) batches+=("$b")
  done
  for i in "${!pids[@]}"; do
    b=${batches[$i]} file="$out/torch-$mode-B${batches[$i]}-side-by-side.log"
    wait "${pids[$i]}"
    status=$?
    result=$(python3 "$judge" verdict torch "$status" "$file")
    if [ "$result" = oom ]; then  # perhaps for the other's memory: alone, it counts
      torch_command "$mode" "$b"
      attempt torch "$mode" "$b" "$deadline" "${bench[@]}"
    else
      record torch "$mode" "$b" "$status" "$file" "$result"
    fi
    case $result in
      fit*) read -r _ mib _ <<<"$result" && points+=("$b:$mib") ;;
    esac
  done
}

search_torch() {
  local mode=$1 deadline=$((SECONDS + torch_seconds)) given_var b="" slope step=0 try bench points=()
  given_var=TORCH_PEAKS_${mode^^}
  if [ -n "${!given_var:-}" ]; then
    read -ra points <<<"${!given_var}"
  else
    fit_peaks "$mode" "$deadline"
  fi
  if [ "${#points[@]}" -lt 2 ] && [ $((deadline - SECONDS)) -le 0 ]; then
    stop torch "$mode" "the $torch_seconds s cap (TORCH_SECONDS)"
    return
  elif [ "${#points[@]}" -lt 2 ]; then
    stop torch "$mode" "fewer than two peaks to predict from (${points[*]:-none})"
    return
  fi
  read -r b slope < <(python3 "$judge" predict --total-mib "$total_mib" --headroom-mib "$headroom" \
    --resolution "$resolution" "${points[@]:0:2}" 2>"$out/predict-$mode.err")
  if [ -z "$b" ]; then
    stop torch "$mode" "no prediction: $(cat "$out/predict-$mode.err")"
    return
  fi
  echo "== predict torch $mode: B $b ($slope MiB a sequence through ${points[*]:0:2}; $total_mib MiB less $headroom)" \
    >>"$log"
  echo "torch $mode: predicted B $b ($slope MiB a sequence)"
  for try in 0 1 2 3; do  # the predicted B, then at most 3 more a resolution apart
    torch_command "$mode" "$b"
    attempt torch "$mode" "$b" "$deadline" "${bench[@]}"
    case $result in
      fit*) [ "$step" -lt 0 ] && return ;;  # down from a predicted B that did not fit: the edge
      oom) [ "$step" -gt 0 ] && return ;;   # up from one that did
      *) ended torch "$mode" "$torch_seconds" TORCH_SECONDS; return ;;
    esac
    [ "$try" -gt 0 ] || { [ "$result" = oom ] && step=-$resolution || step=$resolution; }
    b=$((b + step))
    [ "$b" -gt 0 ] || return
  done
  stop torch "$mode" "3 tries from the predicted B found no edge"
}

dptrain_deadline=$((SECONDS + dptrain_seconds))
for r in $recompute; do search_dptrain "$r"; done
for mode in $torch_modes; do search_torch "$mode"; done

echo
python3 "$judge" table "$log" | tee "$out/table.txt"
