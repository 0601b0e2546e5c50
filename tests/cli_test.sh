#!/usr/bin/env bash
# dptrain as a user meets it: good runs, metrics and config files, and bad input, which
# must give exactly one line on stderr and exit status 2 (never a crash).
set -u
exe=$1
# shellcheck source=cli_lib.sh
source "$(cd "$(dirname "$0")" && pwd)/cli_lib.sh"
make_tmp

# bad input: exit 2 and one line on stderr, an error line (this refuse, not cli_lib's)
refuse() {
  "$exe" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$? lines
  lines=$(wc -l <"$tmp/err")
  if [ "$rc" -ne 2 ]; then bad "dptrain $* exited $rc, not 2: $(cat "$tmp/err")"
  elif [ "$lines" -ne 1 ]; then bad "dptrain $* wrote $lines lines on stderr: $(cat "$tmp/err")"
  elif ! grep -q '^dptrain: error: ' "$tmp/err"; then bad "dptrain $*: stderr is not an error line: $(cat "$tmp/err")"
  else ok; fi
}
refuse --bogus
refuse --batch 0
refuse --batch -5
refuse --batch many
refuse --steps 0
refuse --lr -1
refuse --lr abc
refuse --model 10-
refuse --model 0-4
# A model too large for the device's memory (480 GiB of parameters; on the CPU more than
# the machine has, which overcommit would grant and then kill): the out-of-memory status 3
# and one line with the sizes, not std::bad_alloc or SIGKILL.
"$exe" --model cnn:3x65536x65536-f10 --steps 1 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 3 ] && grep -q '^dptrain: error: out of memory on .* making the model.*480.00 GiB' "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 1 ] &&
  ok || bad "huge model: rc $rc: $(cat "$tmp/err")"
refuse --model x
refuse --task ranking
refuse --optimizer lion
refuse --precision fp8
refuse --gemm magic
refuse --schedule linear
refuse --devices gpu:0
refuse --devices cuda:7
refuse --devices cpu:0,
refuse --devices cpu:0,cuda:0
refuse --epochs 2
refuse --config "$tmp/missing.toml"
refuse --metrics "$tmp/no/such/dir/m.jsonl"
refuse --task classification --model 4-1
refuse --gpus 0
refuse --cpus 0
refuse --cpus -2
refuse --cpus 2 --gpus 1
refuse --devices cpu:0 --cpus 2
refuse --reduce allgather
refuse --cpus 2 --reduce nccl
refuse --bucket-mb 0
printf 'bogus-key = 3\n' >"$tmp/extra.toml"
refuse --config "$tmp/extra.toml"
printf 'batch = abc\n' >"$tmp/badvalue.toml"
refuse --config "$tmp/badvalue.toml"

# CNN specs that do not fit their input: refused before training, naming the layer
refuse_naming() {
  local layer=$1
  shift
  refuse "$@"
  grep -q "$layer" "$tmp/err" || bad "dptrain $*: the error does not name $layer: $(cat "$tmp/err")"
}
refuse_naming "layer 1 'c16k9p0': kernel 9 does not fit the input 3x8x8" --model cnn:3x8x8-c16k9p0-f10
refuse_naming "layer 3 'p2': window 2 does not fit the input 3x1x1" --model cnn:3x4x4-p2-p2-p2-f10
refuse_naming "layer 2 'bn': batch norm needs an image" --model cnn:3x8x8-f10-bn-f5
refuse_naming "layer 1 'c16q3': 'c16q3' is not a layer" --model cnn:3x8x8-c16q3-f10
refuse_naming "the last layer must be fN" --model cnn:3x8x8-c4k3
refuse_naming "input '3x8': expected CxHxW" --model cnn:3x8-f10
refuse_naming "unknown CNN preset" --model cnn-large
refuse_naming "a CNN model" --model cnn-small --task regression
refuse --model cnn:3x8x8-c4k3-f1

# --version and --help
if "$exe" --version | grep -q '^dptrain [0-9]'; then ok; else bad "--version"; fi
if "$exe" --help | grep -q -- '--metrics'; then ok; else bad "--help"; fi

# a good run on the CPU with metrics
if "$exe" --devices cpu --steps 20 --batch 32 --log-every 5 --metrics "$tmp/m.jsonl" >"$tmp/out" 2>"$tmp/err"; then ok
else bad "training run failed: $(cat "$tmp/err")"; fi
[ "$(wc -l <"$tmp/m.jsonl")" -eq 5 ] && ok || bad "metrics: expected 5 lines (steps 1,5,10,15,20), got $(wc -l <"$tmp/m.jsonl")"
if command -v python3 >/dev/null; then
  python3 - "$tmp/m.jsonl" <<'PY' && ok || bad "metrics lines are not the JSON asked for"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 5, 10, 15, 20], rows
for r in rows:
    assert {"step", "loss", "lr", "samples_per_s"} <= r.keys(), r
PY
fi
grep -q '^done: 20 steps' "$tmp/out" && ok || bad "no summary line: $(cat "$tmp/out")"
grep -q '^memory cpu:0: peak' "$tmp/out" && ok || bad "no memory line"

# data parallelism on virtual CPU devices: 4 replicas, uneven shards, per-device memory
if "$exe" --cpus 3 --batch 10 --steps 5 --log-every 5 >"$tmp/out" 2>"$tmp/err"; then ok
else bad "--cpus 3 failed: $(cat "$tmp/err")"; fi
grep -q '3 replica(s) on cpu:0 cpu:1 cpu:2, reduce host' "$tmp/out" && ok || bad "no replica line: $(cat "$tmp/out")"
[ "$(grep -c '^memory cpu:' "$tmp/out")" -eq 3 ] && ok || bad "expected a memory line per device"
grep -q '^step time' "$tmp/out" && ok || bad "no step-time split"
"$exe" --cpus 4 --batch 2 --steps 2 >"$tmp/out" 2>"$tmp/err" && grep -q 'smaller than the 4 replicas' "$tmp/err" && ok ||
  bad "a batch smaller than the device count is not reported: $(cat "$tmp/err")"

# checkpoints: a resumed run continues bit-identically (same parameter hash), on one
# device and on three replicas
for devs in "--devices cpu" "--cpus 3"; do
  # shellcheck disable=SC2086  # the words of each setting are separate arguments
  for opt in "--optimizer sgd" "--optimizer adamw --lr 0.003"; do check_resume resume $devs $opt; done
done
refuse --resume "$tmp/missing.safetensors"
printf 'garbage' >"$tmp/garbage.safetensors"
refuse --resume "$tmp/garbage.safetensors"
refuse --resume "$tmp/ck.safetensors" --model 16-64-4
refuse --resume "$tmp/ck.safetensors" --batch 31
refuse --save-every 5
refuse --save "$tmp/no/dir/ck.safetensors"
refuse --on-nonfinite ignore
refuse --cuda-graph --devices cpu
refuse --cuda-graph --cpus 2

# non-finite gradients: stop names the step and the parameter (exit 4); skip-step goes on
"$exe" --devices cpu --lr 1e30 --steps 50 --save "$tmp/nan.safetensors" --save-every 1000 >"$tmp/out" 2>"$tmp/err"
rc=$?
[ $rc -eq 4 ] && grep -q 'step [0-9]*: the gradient of parameter [0-9]*\.\(weight\|bias\) is not finite' "$tmp/err" &&
  [ "$(wc -l <"$tmp/err")" -eq 1 ] && ok || bad "non-finite stop: rc $rc: $(cat "$tmp/err")"
[ ! -e "$tmp/nan.safetensors" ] && ok || bad "a stopped non-finite run wrote a checkpoint"
"$exe" --devices cpu --lr 1e30 --steps 20 --on-nonfinite skip-step >"$tmp/out" 2>"$tmp/err" &&
  grep -q 'skipped [0-9]* step' "$tmp/out" && ok || bad "skip-step: $(cat "$tmp/err")"

# signals: the current step finishes, the checkpoint is written, status 128 + signal
for sig in INT TERM; do
  rm -f "$tmp/sig.safetensors"
  # A file of its own: a 'step 1/' left by an earlier run would send the signal before
  # dptrain even started.
  out="$tmp/sig_$sig.out"
  "$exe" --devices cpu --steps 100000000 --log-every 1000 --save "$tmp/sig.safetensors" >"$out" 2>&1 &
  pid=$!
  # After its first step (its handlers are in place by then: a signal before them would end
  # it, or under a loaded machine leave a background job, which ignores SIGINT, running).
  for ((i = 0; i < 600; ++i)); do grep -q '^step 1/' "$out" 2>/dev/null && break; sleep 0.1; done
  kill -s $sig $pid
  wait $pid
  rc=$?
  want=$([ $sig = INT ] && echo 130 || echo 143)
  [ $rc -eq "$want" ] && grep -q "stopped by SIG$sig" "$out" && ok || bad "SIG$sig: status $rc, want $want: $(tail -2 "$out")"
  "$exe" --devices cpu --resume "$tmp/sig.safetensors" --steps 1 >/dev/null 2>"$tmp/err"
  grep -q 'past --steps' "$tmp/err" && ok || bad "SIG$sig: the checkpoint does not load: $(cat "$tmp/err")"
done

# a CNN trains on synthetic images: its loss falls (over 64 samples seen 15 times, so
# that the check does not hang on the noise of a 32-sample batch); with batch norm on 3
# replicas a resumed run continues bit-identically
"$exe" --model cnn-small --devices cpu --samples 64 --batch 32 --steps 30 --lr 0.02 --log-every 30 >"$tmp/out" \
  2>"$tmp/err" || bad "cnn-small failed: $(cat "$tmp/err")"
python3 - "$tmp/out" <<'PY' && ok || bad "cnn-small: the loss did not fall: $(grep '^done' "$tmp/out")"
import re, sys
first, final = map(float, re.search(r"loss (\S+) -> (\S+) ", open(sys.argv[1]).read()).groups())
assert final < 0.7 * first, (first, final)
PY
grep -q 'classification, batch 32' "$tmp/out" && ok || bad "cnn-small is not a classification run: $(head -2 "$tmp/out")"
cnn=cnn:3x8x8-c8k3-bn-p2-f4
"$exe" --model $cnn --cpus 3 --batch 10 --steps 8 --log-every 8 >"$tmp/full.out" 2>&1
"$exe" --model $cnn --cpus 3 --batch 10 --steps 4 --log-every 8 --save "$tmp/cnn.safetensors" >/dev/null 2>&1
"$exe" --model $cnn --cpus 3 --batch 10 --steps 8 --log-every 8 --resume "$tmp/cnn.safetensors" >"$tmp/resumed.out" 2>&1
[ -n "$(hash_of "$tmp/full.out")" ] && [ "$(hash_of "$tmp/full.out")" = "$(hash_of "$tmp/resumed.out")" ] && ok ||
  bad "CNN resume is not bit-identical: $(hash_of "$tmp/full.out") vs $(hash_of "$tmp/resumed.out")"
refuse --resume "$tmp/cnn.safetensors" --model cnn:3x8x8-c8k3-p2-f4 --cpus 3 --batch 10 --steps 8

# --plot draws the loss curve and samples/s as SVG
"$exe" --devices cpu --steps 30 --log-every 5 --plot "$tmp/run.svg" >/dev/null 2>&1 &&
  python3 -c 'import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); assert r.tag.endswith("svg")' \
    "$tmp/run.svg" && ok || bad "--plot did not write an SVG"
refuse --plot "$tmp/no/dir/run.svg" --steps 2

# a config file sets flags; the command line still wins
printf 'steps = 7\nbatch = 32\nlog-every = 7\n' >"$tmp/run.toml"
"$exe" --devices cpu --config "$tmp/run.toml" --batch 16 >"$tmp/out" 2>&1
grep -q 'batch 16, 7 steps' "$tmp/out" && ok || bad "config file not applied: $(cat "$tmp/out")"

# The library names option fields (TrainConfig::grad_accum); dptrain shows each as its flag.
says() {  # says "EXPECTED LINE" ARGS...: the error line is exactly the expected one
  local want=$1
  shift
  "$exe" "$@" >/dev/null 2>"$tmp/err"
  [ "$(cat "$tmp/err")" = "$want" ] && ok || bad "dptrain $*: '$(cat "$tmp/err")', not '$want'"
}
refuses() {  # refuses "EXPECTED LINE" ARGS...: exit 2 and exactly that error line
  local want=$1
  shift
  refuse "$@"
  [ "$(cat "$tmp/err")" = "$want" ] && ok || bad "dptrain $*: '$(cat "$tmp/err")', not '$want'"
}
says "dptrain: error: --grad-accum must be >= 1, got 0" --devices cpu --grad-accum 0
# A float flag's value is a decimal number, whole: '' was read as 0 (--momentum '' trained
# without momentum), '0x10' as 16, and '1.0abc' was refused in CLI11's words.
refuses "dptrain: error: --momentum: '' is not a decimal number (see --help)" --devices cpu --momentum ''
refuses "dptrain: error: --lr: '1.0abc' is not a decimal number (see --help)" --devices cpu --lr 1.0abc
refuses "dptrain: error: --lr: '0x10' is not a decimal number (see --help)" --devices cpu --lr 0x10
refuses "dptrain: error: --comm-timeout: ' 5' is not a decimal number (see --help)" --devices cpu --comm-timeout ' 5'
says "dptrain: error: --save-every needs --save (a checkpoint path)" --devices cpu --save-every 3
says "dptrain: error: --nesterov needs --momentum > 0, got 0" \
  --devices cpu --nesterov --momentum 0
says "dptrain: error: --reduce nccl needs CUDA devices; use host on CPU devices" --cpus 2 --reduce nccl
"$exe" --cpus 3 --batch 2 --steps 2 >/dev/null 2>"$tmp/err"
[ "$(cat "$tmp/err")" = "dptrain: note: batch 2 is smaller than the 3 replicas; only 2 of them get samples" ] && ok ||
  bad "the small-batch note: '$(cat "$tmp/err")'"

# A GPT: trained and saved, exported as a Hugging Face folder, fine-tuned from it; and what
# a GPT run refuses.
gpt=(--model gpt:L2-H2-C32-T16-V64 --batch 4 --optimizer adamw --devices cpu --samples 8)  # 8 windows, learnt by heart
"$exe" "${gpt[@]}" --seq 8 --steps 20 --lr 0.01 --save "$tmp/gpt.safetensors" >"$tmp/out" 2>&1 &&
  "$exe" export --resume "$tmp/gpt.safetensors" --hf "$tmp/hf" >>"$tmp/out" 2>&1 &&
  [ -s "$tmp/hf/model.safetensors" ] && grep -q '"n_layer": 2' "$tmp/hf/config.json" &&
  "$exe" "${gpt[@]}" --seq 8 --steps 1 --init-from "$tmp/hf/model.safetensors" >"$tmp/tuned" 2>&1 && ok ||
  bad "a GPT saved, exported and fine-tuned: $(cat "$tmp/out" "$tmp/tuned" 2>/dev/null | tail -3)"
first=$(grep -oE '^step 1/20 loss [0-9.]+' "$tmp/out" | awk '{print $4}')
tuned=$(grep -oE '^step 1/1 loss [0-9.]+' "$tmp/tuned" | awk '{print $4}')
awk -v a="$first" -v b="$tuned" 'BEGIN { exit !(b < a - 0.3) }' && ok ||
  bad "fine-tuning starts from the exported weights: loss $tuned, a fresh model's $first"
# --auto-resume: a GPT run cut at step 4 and run again ends where one run straight through does.
"$exe" "${gpt[@]}" --seq 8 --steps 4 --save "$tmp/auto.safetensors" --auto-resume >/dev/null 2>&1
"$exe" "${gpt[@]}" --seq 8 --steps 8 --save "$tmp/auto.safetensors" --auto-resume >"$tmp/auto" 2>&1
"$exe" "${gpt[@]}" --seq 8 --steps 8 >"$tmp/straight" 2>&1
grep -q "resumed from '$tmp/auto.safetensors' at step 4" "$tmp/auto" && [ -n "$(hash_of "$tmp/auto")" ] &&
  [ "$(hash_of "$tmp/auto")" = "$(hash_of "$tmp/straight")" ] && ok ||
  bad "a GPT's --auto-resume: $(hash_of "$tmp/auto") against $(hash_of "$tmp/straight"): $(tail -3 "$tmp/auto")"
# --recompute rebuilds activations in backward: the same losses and weights, bit for bit.
"$exe" "${gpt[@]}" --seq 8 --steps 8 --log-every 1 >"$tmp/kept" 2>&1
"$exe" "${gpt[@]}" --seq 8 --steps 8 --log-every 1 --recompute gelu+ln >"$tmp/rebuilt" 2>&1
losses() { grep -oE '^step [0-9]+/8 loss [0-9.]+' "$1"; }
[ "$(losses "$tmp/kept" | wc -l)" -eq 8 ] && [ "$(losses "$tmp/rebuilt")" = "$(losses "$tmp/kept")" ] &&
  [ -n "$(hash_of "$tmp/kept")" ] && [ "$(hash_of "$tmp/rebuilt")" = "$(hash_of "$tmp/kept")" ] && ok ||
  bad "--recompute gelu+ln: $(hash_of "$tmp/rebuilt") against $(hash_of "$tmp/kept"): $(tail -3 "$tmp/rebuilt")"
says "dptrain: error: --recompute applies to GPT models; --model is not a GPT" --recompute gelu
# --attention-backward fast changes cuDNN's attention alone: on the CPU, the same weights.
"$exe" "${gpt[@]}" --seq 8 --steps 8 --attention-backward fast >"$tmp/fast_attention" 2>&1
[ "$(hash_of "$tmp/fast_attention")" = "$(hash_of "$tmp/kept")" ] && ok ||
  bad "--attention-backward fast on the CPU: $(hash_of "$tmp/fast_attention") against $(hash_of "$tmp/kept")"
says "dptrain: error: --attention-backward applies to GPT models; --model is not a GPT" --attention-backward fast
says "dptrain: error: unknown --attention-backward 'slow': expected deterministic or fast" \
  "${gpt[@]}" --attention-backward slow
"$exe" --devices cpu --steps 2 --save "$tmp/mlp.safetensors" >/dev/null 2>&1
says "dptrain: error: checkpoint '$tmp/mlp.safetensors' holds no GPT (its model is '16-128x2-4')" \
  export --resume "$tmp/mlp.safetensors" --hf "$tmp/nothing"
# An export replaces an earlier export of dptrain's and nothing else: not the checkpoint it
# reads (once it turned a checkpoint in the folder into an export), not a folder's files
# of other origins, not a folder that is a file; status 2 before a byte is written.
"$exe" export --resume "$tmp/gpt.safetensors" --hf "$tmp/hf" >/dev/null 2>&1 && ok || bad "an export over an export"
mkdir -p "$tmp/own" "$tmp/theirs" && cp "$tmp/gpt.safetensors" "$tmp/own/model.safetensors" &&
  echo '{}' >"$tmp/theirs/config.json"
own=$(cksum <"$tmp/own/model.safetensors")
refuse export --resume "$tmp/own/model.safetensors" --hf "$tmp/own"
[ "$(cksum <"$tmp/own/model.safetensors")" = "$own" ] && ok || bad "export wrote over the checkpoint it read"
says "dptrain: error: export: '$tmp/own/model.safetensors' is the checkpoint being exported (--resume); name another folder" \
  export --resume "$tmp/own/model.safetensors" --hf "$tmp/own"
says "dptrain: error: export: '$tmp/own' holds a model.safetensors that no export of dptrain's wrote, which export would replace (name another folder)" \
  export --resume "$tmp/gpt.safetensors" --hf "$tmp/own"
refuse export --resume "$tmp/gpt.safetensors" --hf "$tmp/theirs"
[ ! -e "$tmp/theirs/model.safetensors" ] && [ "$(cat "$tmp/theirs/config.json")" = "{}" ] && ok ||
  bad "a refused export wrote into the folder"
refuse export --resume "$tmp/gpt.safetensors" --hf "$tmp/gpt.safetensors"
says "dptrain: error: --seq of 17 tokens is longer than the model's context of 16 (gpt:L2-H2-C32-T16-V64)" \
  "${gpt[@]}" --seq 17
says "dptrain: error: --init-from is a GPT's starting weights; --model is not a GPT" --init-from "$tmp/hf/model.safetensors"
# The head count changes no tensor's shape: the config.json beside the file tells it.
refuses "dptrain: error: '$tmp/hf/model.safetensors': $tmp/hf/config.json says n_head 2, and the model has 4 heads (its spec must be the file's)" \
  --model gpt:L2-H4-C32-T16-V64 --batch 4 --devices cpu --samples 8 --seq 8 --steps 1 --init-from "$tmp/hf/model.safetensors"
# A missing or cut file to start from is bad input (status 2), as --resume's is.
head -c 3000 "$tmp/hf/model.safetensors" >"$tmp/cut.safetensors"
refuse "${gpt[@]}" --seq 8 --steps 1 --init-from "$tmp/none.safetensors"
refuse "${gpt[@]}" --seq 8 --steps 1 --init-from "$tmp/cut.safetensors"
says "dptrain: error: model spec 'gpt:L2-H3-C32-T16-V64': the width 32 is not a multiple of the heads 3 (a GPT is gpt2, gpt2-medium, gpt2-large, gpt2-xl or gpt:L<layers>-H<heads>-C<width>-T<context>-V<vocabulary>, e.g. gpt:L4-H4-C128-T256-V512)" \
  --model gpt:L2-H3-C32-T16-V64

# GPT-2's tokenizer (a hand-made one, tests/fixtures/bpe: GPT-2's byte tokens and 31 merges):
# a GPT that learnt a text in its tokens continues a text prompt as text, the same from the
# prompt's ids; a character made of four byte tokens (🎉) prints whole; and the refusals.
fixture="$(cd "$(dirname "$0")" && pwd)/fixtures/bpe"
python3 - "$tmp/text.bin" <<'PY'
import struct, sys
# "Hello world, the café 🎉\n" in the fixture's tokens, 🎉 as its four byte tokens.
tokens = [274, 271, 11, 258, 220, 66, 64, 69, 280, 220, 172, 253, 236, 231, 198] * 100
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, len(tokens), *[0] * 253))
    f.write(struct.pack(f"<{len(tokens)}H", *tokens))
PY
"$exe" --model gpt:L2-H2-C32-T16-V288 --data "$tmp/text.bin" --batch 8 --optimizer adamw --lr 0.01 --devices cpu \
  --steps 80 --save "$tmp/text.safetensors" >/dev/null 2>&1
gen=(generate --resume "$tmp/text.safetensors" --max-new-tokens 15 --temperature 0)
want=$(printf ', the café 🎉\nHello world')
from_text=$("$exe" "${gen[@]}" --tokenizer "$fixture" --prompt "Hello world" 2>&1)
from_ids=$("$exe" "${gen[@]}" --tokenizer "$fixture" --prompt-tokens 274,271 2>&1)
[ "$from_text" = "$want" ] && [ "$from_ids" = "$want" ] && ok ||
  bad "generate --tokenizer: '$from_text' and '$from_ids', not '$want'"
ids=$("$exe" generate --resume "$tmp/text.safetensors" --temperature 0 --prompt-tokens 274,271 --max-new-tokens 4 2>&1)
[ "$ids" = "11,258,220,66" ] && ok || bad "generate without --tokenizer prints ids: '$ids'"
refuses "dptrain: error: generate takes one prompt: --prompt (text) or --prompt-tokens (ids), not both" \
  "${gen[@]}" --tokenizer "$fixture" --prompt "Hello" --prompt-tokens 274
refuses "dptrain: error: generate needs a prompt: --prompt TEXT (with --tokenizer) or --prompt-tokens IDS" \
  "${gen[@]}" --tokenizer "$fixture"
refuses "dptrain: error: --prompt is text, which needs --tokenizer DIR (GPT-2's encoder.json and vocab.bpe) to encode it; or give token ids with --prompt-tokens" \
  "${gen[@]}" --prompt "Hello"
refuses "dptrain: error: tokenizer '$tmp/none': cannot open: No such file or directory" \
  "${gen[@]}" --tokenizer "$tmp/none" --prompt "Hello"
mkdir "$tmp/half" && cp "$fixture/encoder.json" "$tmp/half/"
refuses "dptrain: error: tokenizer '$tmp/half': no vocab.bpe in it (No such file or directory); a GPT-2 tokenizer is a folder with encoder.json and vocab.bpe" \
  "${gen[@]}" --tokenizer "$tmp/half" --prompt "Hello"
refuses "dptrain: error: --tokenizer '$fixture' has 288 tokens, more than the model's vocabulary of 64 (gpt:L2-H2-C32-T16-V64 in '$tmp/gpt.safetensors'): it is not this model's tokenizer" \
  generate --resume "$tmp/gpt.safetensors" --tokenizer "$fixture" --prompt "Hello"
refuses "dptrain: error: tokenizer '$fixture': token id 300 is outside its vocabulary [0, 288)" \
  "${gen[@]}" --tokenizer "$fixture" --prompt-tokens 274,300
# A GPU that is not there is bad input, as training's --devices (it was a CUDA error, status 1).
refuse "${gen[@]}" --prompt-tokens 274 --device cuda:99
grep -q "^dptrain: error: device cuda:99 is not available: " "$tmp/err" && ok || bad "generate --device cuda:99: $(cat "$tmp/err")"
# generate's numbers are read as training's: decimal, never wrapped or clamped.
refuses "dptrain: error: --seed: '-1' is out of range (0 to 18446744073709551615) (see --help)" \
  "${gen[@]}" --prompt-tokens 274 --seed -1
refuses "dptrain: error: --max-new-tokens: '0x3' is not a whole decimal number (see --help)" \
  generate --resume "$tmp/text.safetensors" --prompt-tokens 274 --max-new-tokens 0x3
refuses "dptrain: error: --top-k: '99999999999999999999' is out of range (-9223372036854775808 to 9223372036854775807) (see --help)" \
  "${gen[@]}" --prompt-tokens 274 --top-k 99999999999999999999

# A validation shard is read whole at every evaluation: a token outside the vocabulary there
# is refused before the first step (it once ended the run at its first evaluation, after
# every step and before the checkpoint).
python3 - "$tmp/lm_train.bin" "$tmp/lm_val.bin" <<'PY'
import struct, sys
for path, tokens in ((sys.argv[1], [(i * 7) % 60 for i in range(400)]), (sys.argv[2], [1] * 40 + [64] + [2] * 20)):
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *[0] * 253))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))
PY
refuses "dptrain: error: data file '$tmp/lm_val.bin': token 40 is 64, outside [0, 64): the model's vocabulary has 64 tokens" \
  --model gpt:L1-H2-C32-T16-V64 --data "$tmp/lm_train.bin" --val-data "$tmp/lm_val.bin" --batch 4 --steps 3 \
  --devices cpu --save "$tmp/lm.safetensors"
grep -q '^step' "$tmp/out" && bad "a bad validation token was found after training began" || ok
# Validating on the training files is said (it was taken silently), also through a link.
ln -s "$tmp/lm_train.bin" "$tmp/lm_link.bin"
"$exe" --model gpt:L1-H2-C32-T16-V64 --data "$tmp/lm_train.bin" --val-data "$tmp/lm_link.bin" --batch 4 --steps 1 \
  --devices cpu >/dev/null 2>"$tmp/err"
[ "$(cat "$tmp/err")" = "dptrain: warning: --val-data '$tmp/lm_link.bin' is in --data too: the validation loss is measured on rows the model trains on" ] &&
  ok || bad "--val-data naming a training file: '$(cat "$tmp/err")'"
check_data_fault --devices cpu
check_data_fault --cpus 2
# What a GPT does not take: --act (its MLP is GPT-2's GELU; the flag did nothing and then
# blocked a resume), and a --task other than its tokens'.
refuses "dptrain: error: --act is an MLP's or a CNN's hidden activation; a GPT's MLP has GPT-2's GELU (tanh), and --model is a GPT" \
  --model gpt:L1-H2-C32-T16-V64 --act gelu --data "$tmp/lm_train.bin" --batch 4 --steps 1 --devices cpu
refuses "dptrain: error: --task: the task of --data follows from its targets: tokens train a language model (a GPT), not --task regression" \
  --model gpt:L1-H2-C32-T16-V64 --task regression --data "$tmp/lm_train.bin" --batch 4 --steps 1 --devices cpu
# eval and predict are for MLPs and CNNs over arrays: a GPT's checkpoint says so (it once
# got "neither a .npy nor a .safetensors file"), and token shards without a GPT name the fix.
refuses "dptrain: error: eval runs MLPs and CNNs over arrays; '$tmp/gpt.safetensors' holds a GPT (gpt:L2-H2-C32-T16-V64), whose validation loss is training's --val-data and whose text is dptrain generate's" \
  eval --resume "$tmp/gpt.safetensors" --data "$tmp/lm_train.bin"
refuses "dptrain: error: --data '$tmp/lm_train.bin' is neither a .npy nor a .safetensors file (token shards train a GPT: --model gpt2 or gpt:...)" \
  --data "$tmp/lm_train.bin" --devices cpu --steps 1
# A file named twice by the patterns (a list, a glob, another spelling) would be read twice an epoch.
refuses "dptrain: error: data files: '$tmp/lm_train.bin' and '$tmp/./lm_train.bin' are one file, named twice by the patterns; each file is read once" \
  --model gpt:L1-H2-C32-T16-V64 --data "$tmp/lm_train.bin,$tmp/./lm_train.bin" --batch 4 --steps 1 --devices cpu

finish
