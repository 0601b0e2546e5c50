#!/usr/bin/env bash
# dptrain --ddp under mpirun, as users run it: rank 0 alone reports, the ranks agree on
# the parameters, an error names its rank, and a rank that dies or stops answering ends
# the whole job with a non-zero status within --comm-timeout instead of hanging it.
set -u
exe=$1 mpirun=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"; kill -9 $(jobs -p) 2>/dev/null' EXIT
run=("$mpirun" --oversubscribe)
# shellcheck source=cli_lib.sh
source "$(cd "$(dirname "$0")" && pwd)/cli_lib.sh"
one_error() { [ "$(grep -c '^dptrain: error' "$tmp/err")" -eq 1 ]; }  # no rank repeats it

# A good run: one report, metrics from rank 0 only, the hash agreed by both ranks.
if "${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 20 --batch 32 --log-every 10 --bucket-mb 0.01 \
    --metrics "$tmp/m.jsonl" >"$tmp/out" 2>"$tmp/err"; then ok; else bad "ddp run failed: $(cat "$tmp/err")"; fi
[ "$(grep -c '^done:' "$tmp/out")" -eq 1 ] && ok || bad "expected one summary (rank 0): $(cat "$tmp/out")"
grep -q 'identical on all 2 ranks' "$tmp/out" && ok || bad "no agreed parameter hash: $(cat "$tmp/out")"
grep -q '2 processes' "$tmp/out" && ok || bad "no process count in the header"
[ "$(wc -l <"$tmp/m.jsonl")" -eq 3 ] && ok || bad "metrics: expected 3 lines from rank 0 alone"
# mpirun's output goes to a file: plain lines, never a redrawn progress line (Open MPI
# gives its ranks a pty, so a rank cannot tell from isatty alone).
! grep -q $'\r' "$tmp/out" && grep -q '^step 20/20 loss ' "$tmp/out" && ok ||
  bad "progress under mpirun is not plain lines: $(cat -A "$tmp/out" | head -5)"

# Gradient accumulation through the CLI.
"${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 5 --batch 32 --grad-accum 4 >"$tmp/out" 2>&1 &&
  grep -q 'gradient accumulation: 4' "$tmp/out" && ok || bad "--grad-accum: $(cat "$tmp/out")"

# ZeRO over the ranks: each rank's optimizer state is its third, the ranks agree.
"${run[@]}" -np 3 "$exe" --ddp --devices cpu --steps 10 --batch 30 --optimizer adamw --zero 1 >"$tmp/out" 2>&1 &&
  grep -q 'identical on all 3 ranks' "$tmp/out" && grep -q 'ZeRO stage 1' "$tmp/out" && ok ||
  bad "--ddp --zero 1: $(cat "$tmp/out")"
# A ZeRO checkpoint of 4 ranks resumes on 3, on 2 (sharded or not, to the same parameters:
# two ranks sum in one addition, so the reduce and the all-reduce agree bit for bit) and in
# one process.
z=(--devices cpu --batch 30 --optimizer adamw --log-every 100)
"${run[@]}" -np 4 "$exe" --ddp "${z[@]}" --zero 1 --steps 8 --save "$tmp/z4.safetensors" >"$tmp/out" 2>&1 ||
  bad "--zero 1 save on 4 ranks: $(cat "$tmp/out")"
hash_of() { grep -oE 'hash [0-9a-f]{16}' "$1" | head -1; }
"${run[@]}" -np 2 "$exe" --ddp "${z[@]}" --zero 1 --steps 16 --resume "$tmp/z4.safetensors" >"$tmp/z1" 2>&1
"${run[@]}" -np 2 "$exe" --ddp "${z[@]}" --zero 0 --steps 16 --resume "$tmp/z4.safetensors" >"$tmp/z0" 2>&1
[ -n "$(hash_of "$tmp/z1")" ] && [ "$(hash_of "$tmp/z1")" = "$(hash_of "$tmp/z0")" ] && ok ||
  bad "a 4-rank ZeRO checkpoint resumed on 2 ranks: $(hash_of "$tmp/z1") against $(hash_of "$tmp/z0"): $(tail -2 "$tmp/z1")"
"${run[@]}" -np 3 "$exe" --ddp "${z[@]}" --zero 1 --steps 16 --resume "$tmp/z4.safetensors" >"$tmp/z3" 2>&1 &&
  grep -q 'identical on all 3 ranks' "$tmp/z3" && ok || bad "a 4-rank ZeRO checkpoint resumed on 3 ranks: $(tail -2 "$tmp/z3")"
"$exe" "${z[@]}" --steps 16 --resume "$tmp/z4.safetensors" >"$tmp/z" 2>&1 && grep -q '^done:' "$tmp/z" && ok ||
  bad "a 4-rank ZeRO checkpoint resumed in one process: $(tail -2 "$tmp/z")"

# Stage 2 the same way: a checkpoint of 4 ranks resumes on 3 (stage 2), on 2 (stage 1: the
# same parameters as stage 2 there) and in one process.
"${run[@]}" -np 4 "$exe" --ddp "${z[@]}" --zero 2 --steps 8 --save "$tmp/s4.safetensors" >"$tmp/out" 2>&1 &&
  grep -q 'ZeRO stage 2' "$tmp/out" && ok || bad "--zero 2 save on 4 ranks: $(cat "$tmp/out")"
"${run[@]}" -np 3 "$exe" --ddp "${z[@]}" --zero 2 --steps 16 --resume "$tmp/s4.safetensors" >"$tmp/s3" 2>&1 &&
  grep -q 'identical on all 3 ranks' "$tmp/s3" && ok || bad "a 4-rank stage-2 checkpoint resumed on 3 ranks: $(tail -2 "$tmp/s3")"
"${run[@]}" -np 2 "$exe" --ddp "${z[@]}" --zero 2 --steps 16 --resume "$tmp/s4.safetensors" >"$tmp/s2" 2>&1
"${run[@]}" -np 2 "$exe" --ddp "${z[@]}" --zero 1 --steps 16 --resume "$tmp/s4.safetensors" >"$tmp/s1" 2>&1
[ -n "$(hash_of "$tmp/s2")" ] && [ "$(hash_of "$tmp/s2")" = "$(hash_of "$tmp/s1")" ] && ok ||
  bad "a 4-rank stage-2 checkpoint on 2 ranks, stage 2 and 1: $(hash_of "$tmp/s2") against $(hash_of "$tmp/s1")"
"$exe" "${z[@]}" --steps 16 --resume "$tmp/s4.safetensors" >"$tmp/s" 2>&1 && grep -q '^done:' "$tmp/s" && ok ||
  bad "a 4-rank stage-2 checkpoint resumed in one process: $(tail -2 "$tmp/s")"

# An error on one rank reaches the user with that rank's number, and the job ends: rank 0
# alone writes the checkpoint, and here its disk is full.
DPT_CKPT_FAIL_AFTER_BYTES=100 "${run[@]}" -x DPT_CKPT_FAIL_AFTER_BYTES -np 2 "$exe" --ddp --devices cpu --steps 5 \
  --save "$tmp/ck.safetensors" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -ne 0 ] && grep -q "dptrain: error: rank 0: checkpoint '$tmp/ck.safetensors': writing failed" "$tmp/err" && ok ||
  bad "error without its rank (rc $rc): $(cat "$tmp/err")"
# A bad output path is bad input, found before the job starts: one line, exit 2.
"${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 5 --metrics "$tmp/no/dir/m.jsonl" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c 'dptrain: error: --metrics' "$tmp/err")" -eq 1 ] && one_error && ok ||
  bad "a bad --metrics path under mpirun (rc $rc): $(cat "$tmp/err")"

# Bad input under mpirun: one line (from rank 0), exit 2.
"${run[@]}" -np 2 "$exe" --ddp --batch 0 >"$tmp/out" 2>"$tmp/err"
one_error && ok || bad "bad input: expected one error line: $(cat "$tmp/err")"
# bf16 gradients need a reduction that has them: MPI between CPU ranks sums fp32.
"${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 5 --grad-comm bf16 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c 'dptrain: error: --grad-comm bf16 is for NCCL, p2p and host reductions' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "--grad-comm bf16 under MPI (rc $rc): $(cat "$tmp/err")"

# Graphs record GPU steps: CPU ranks are refused in one line (GPU ranks: gpu_cli_test.sh).
"${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 5 --cuda-graph >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c 'dptrain: error: --cuda-graph records steps on GPUs: not on CPU devices' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "--cuda-graph on CPU ranks (rc $rc): $(cat "$tmp/err")"

# A fault of one rank's own before the ranks have met (here a data file that only rank 1
# is given, as a file missing on one machine): that rank reports it, naming itself, and
# the job ends (rank 0 alone reports the faults every rank finds, above).
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 50 : -np 1 "$exe" --ddp --devices cpu --steps 50 \
  --data "$tmp/missing.npy" --targets "$tmp/missing_y.npy" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -ne 0 ] && [ "$(grep -c '^dptrain: error: rank 1: .*missing.npy' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "a fault of rank 1 alone (rc $rc): $(cat "$tmp/err")"
# The same once MPI runs (a checkpoint to resume that rank 1 alone lacks), and in the
# command line (a config file that rank 1 alone lacks): the job ends at once, not at
# --comm-timeout.
start=$(date +%s)
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 50 --comm-timeout 60 : -np 1 "$exe" --ddp --devices cpu \
  --steps 50 --comm-timeout 60 --resume "$tmp/missing.safetensors" >"$tmp/out" 2>"$tmp/err"
rc=$? took=$(($(date +%s) - start))
[ $rc -ne 0 ] && [ $took -lt 30 ] && [ "$(grep -c '^dptrain: error: rank 1: .*missing.safetensors' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "a fault of rank 1 alone once MPI runs (rc $rc, $took s): $(cat "$tmp/err")"
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 50 : -np 1 "$exe" --ddp --devices cpu --steps 50 \
  --config "$tmp/missing.toml" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: rank 1: .*missing.toml' "$tmp/err")" -eq 1 ] && one_error && ok ||
  bad "a command-line fault of rank 1 alone (rc $rc): $(cat "$tmp/err")"

# Ranks that were given other settings (per-node config files, say): a model of another
# size corrupted the heap in the first collective, another batch trained and reported the
# parameters identical. Refused before the first collective, the first field that differs
# named once.
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 3 --model 4-8-2 : -np 1 "$exe" --ddp --devices cpu --steps 3 \
  --model 64-1024x4-64 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: --model differs between rank 0 and rank 1' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "ranks with other models (rc $rc): $(cat "$tmp/err")"
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 3 --batch 8 : -np 1 "$exe" --ddp --devices cpu --steps 3 \
  --batch 8 --log-every 2 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: --log-every differs between rank 0 and rank 1' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "ranks with other log points (rc $rc): $(cat "$tmp/err")"
"$exe" --devices cpu --steps 5 --batch 8 --save "$tmp/five.safetensors" >/dev/null 2>&1
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 10 --batch 8 : -np 1 "$exe" --ddp --devices cpu --steps 10 \
  --batch 8 --resume "$tmp/five.safetensors" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: --resume differs between rank 0 and rank 1' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "rank 1 alone resuming (rc $rc): $(cat "$tmp/err")"
# More devices listed than ranks on the machine: said (they were idle without a word).
"${run[@]}" -np 2 "$exe" --ddp --cpus 4 --steps 3 >"$tmp/out" 2>"$tmp/err" &&
  [ "$(grep -c '^dptrain: note: 4 devices (--devices) for the 2 process(es) of this machine' "$tmp/err")" -eq 1 ] &&
  ok || bad "idle devices under --ddp: $(cat "$tmp/err")"
# A non-finite step stops every rank alike (they check the same reduced gradients): one
# line, from rank 0, status 4 (each rank printed it).
"${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 30 --lr 1e30 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 4 ] && [ "$(grep -c '^dptrain: error: step [0-9]*: the gradient of parameter .* is not finite' "$tmp/err")" \
  -eq 1 ] && one_error && ok || bad "a non-finite stop under mpirun (rc $rc): $(cat "$tmp/err")"
# The flag the user gave is named, not one derived from it (the samples for
# --val-fraction, the data's identity for --shuffle, an --overlap that is no flag).
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 3 : -np 1 "$exe" --ddp --devices cpu --steps 3 --no-overlap \
  >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: --no-overlap differs between rank 0 and rank 1' "$tmp/err")" -eq 1 ] &&
  one_error && ok || bad "ranks with other --no-overlap (rc $rc): $(cat "$tmp/err")"
# Ranks that resume copies of other checkpoints at the same step trained replicas that
# never agreed, and wrote checkpoints of them, until the hash at the end.
"$exe" --devices cpu --steps 5 --batch 8 --momentum 0.5 --save "$tmp/other.safetensors" >/dev/null 2>&1
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 10 --batch 8 --resume "$tmp/five.safetensors" : -np 1 "$exe" \
  --ddp --devices cpu --steps 10 --batch 8 --resume "$tmp/other.safetensors" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: rank 0 and rank 1 resumed checkpoints of other parameters' "$tmp/err")" \
  -eq 1 ] && one_error && ok || bad "ranks resuming other checkpoints (rc $rc): $(cat "$tmp/err")"
# --save on one rank alone: under ZeRO its optimizer state's gather met another collective
# of the other rank (a segfault in MPI); without, no checkpoint and no word.
"${run[@]}" -np 1 "$exe" --ddp --devices cpu --steps 5 --zero 1 --save "$tmp/z.safetensors" : -np 1 "$exe" --ddp \
  --devices cpu --steps 5 --zero 1 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: --save differs between rank 0 and rank 1' "$tmp/err")" -eq 1 ] &&
  [ ! -e "$tmp/z.safetensors" ] && one_error && ok || bad "--save on rank 0 alone (rc $rc): $(cat "$tmp/err")"
# Under mpirun without --ddp each process trained the whole job alone and wrote the same
# files (a metrics file of two interleaved runs); predict and eval ran twice.
"${run[@]}" -np 2 "$exe" --devices cpu --steps 5 --metrics "$tmp/twice.jsonl" >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: this is one of 2 processes that mpirun started, without --ddp' \
  "$tmp/err")" -eq 1 ] && [ ! -e "$tmp/twice.jsonl" ] && one_error && ok ||
  bad "mpirun without --ddp (rc $rc): $(cat "$tmp/err")"
"${run[@]}" -np 2 "$exe" predict --resume "$tmp/five.safetensors" --data "$tmp/none.npy" --out "$tmp/p.npy" \
  >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 2 ] && [ "$(grep -c '^dptrain: error: predict runs in one process' "$tmp/err")" -eq 1 ] && one_error && ok ||
  bad "predict under mpirun (rc $rc): $(cat "$tmp/err")"

# Faults: kill (-9) or stop (-STOP) one rank mid-run; the job must end non-zero within
# --comm-timeout (plus the launcher's own grace).
fault() {
  local sig=$1 timeout=5 limit=40
  "${run[@]}" -np 3 "$exe" --ddp --devices cpu --steps 100000000 --batch 64 --log-every 1000 \
    --comm-timeout $timeout >"$tmp/fault.out" 2>"$tmp/fault.err" &
  local launcher=$! victim="" i
  for i in $(seq 50); do  # wait for the ranks to be training
    sleep 0.2
    victim=$(pgrep -P $launcher -f dptrain | sed -n 2p)
    [ -n "$victim" ] && grep -q '^step' "$tmp/fault.out" && break
  done
  if [ -z "$victim" ]; then bad "SIG$sig: no rank found to fault"; kill -9 $launcher; return; fi
  local start=$SECONDS
  kill -"$sig" "$victim"
  local waited=0
  while kill -0 $launcher 2>/dev/null && [ $waited -lt $limit ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 $launcher 2>/dev/null; then
    bad "SIG$sig: the job still runs ${limit}s after a rank was faulted (a hang)"
    pkill -9 -P $launcher; kill -9 $launcher
    return
  fi
  wait $launcher
  local rc=$?
  [ $rc -ne 0 ] && ok || bad "SIG$sig: the job ended with status 0"
  echo "SIG$sig on rank $victim: job ended after $((SECONDS - start)) s with status $rc"
  [ "$sig" = STOP ] && { grep -q 'did not complete within 5 s' "$tmp/fault.err" && ok ||
    bad "SIGSTOP: no timeout message: $(cat "$tmp/fault.err")"; }
  # A rank that is asked to stop stops them all, after one step; rank 0 names the signal
  # (it said SIGPIPE, and ended with 128, when the signal was another rank's).
  [ "$sig" = TERM ] && { [ $rc -eq 143 ] &&
    grep -qE '^stopped by (a signal to another rank|SIGTERM) after step' "$tmp/fault.out" && ok ||
    bad "SIGTERM to a rank (rc $rc): $(tail -2 "$tmp/fault.out")"; }
}
fault KILL
fault STOP
fault TERM

# Signals never lose the checkpoint under mpirun either: a burst of SIGTERMs to every rank
# (a scheduler that insists; Slurm's scancel signals each task). Waits for the first step
# (bounded), then signals. (mpirun itself, signalled, ends its ranks: SIGTERM, then
# SIGKILL odls_base_sigkill_timeout seconds later, 1 by default; that is Open MPI's.)
rm -f "$tmp/stop.out" "$tmp/stop.safetensors"
"${run[@]}" -np 2 "$exe" --ddp --devices cpu --steps 100000000 --batch 16 --log-every 1000 \
  --save "$tmp/stop.safetensors" >"$tmp/stop.out" 2>"$tmp/stop.err" &
job=$!
for ((i = 0; i < 600; ++i)); do grep -q '^step 1/' "$tmp/stop.out" 2>/dev/null && break; sleep 0.1; done
ranks=$(pgrep -P $job -f dptrain)
for ((i = 0; i < 20; ++i)); do kill -TERM $ranks 2>/dev/null; done
wait $job
rc=$?
[ $rc -eq 143 ] && grep -q '^stopped by SIGTERM after step' "$tmp/stop.out" && [ -s "$tmp/stop.safetensors" ] &&
  "$exe" --devices cpu --batch 16 --steps 1 --resume "$tmp/stop.safetensors" 2>&1 | grep -q 'past --steps' && ok ||
  bad "20 SIGTERMs to each rank (rc $rc): $(tail -1 "$tmp/stop.out"); $(head -3 "$tmp/stop.err"); $(ls "$tmp/stop.safetensors" 2>&1)"

# A GPT on 3 ranks (ZeRO 1, its tied embedding reduced once; ZeRO 2, the tied embedding's
# gradient in a slot of its own, small buckets so that the others take turns): the losses
# a process of 3 CPU devices logs, and one hash on every rank.
g=(--model gpt:L2-H2-C32-T16-V64 --seq 8 --batch 6 --steps 6 --optimizer adamw --weight-decay 0.1 --log-every 2)
losses() { grep -oE '^step [0-9]+/6 loss [0-9.e+-]+' "$1" | awk '{print $4}' | tr '\n' ' '; }
"$exe" --cpus 3 "${g[@]}" >"$tmp/g1" 2>&1
for zero in "--zero 1" "--zero 2 --bucket-mb 0.002"; do
  # shellcheck disable=SC2086  # the words of each setting are separate arguments
  "${run[@]}" -np 3 "$exe" --ddp --devices cpu $zero "${g[@]}" >"$tmp/g3" 2>&1
  [ -n "$(losses "$tmp/g1")" ] && [ "$(losses "$tmp/g3")" = "$(losses "$tmp/g1")" ] &&
    grep -q 'identical on all 3 ranks' "$tmp/g3" && ok ||
    bad "a GPT on 3 ranks ($zero) against 3 devices: '$(losses "$tmp/g3")' against '$(losses "$tmp/g1")': $(tail -2 "$tmp/g3")"
done

finish
