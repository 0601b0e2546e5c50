#!/usr/bin/env bash
# dptrain against hostile input: paths that are not regular files, numbers that would wrap
# or read as octal, hyper-parameters that are not numbers, checkpoints with bad metadata
# or non-finite values; and what a long job needs: metrics that continue on resume,
# --auto-resume, plain log lines off a terminal, a stop summary, a warning before hours
# of CPU work. Bad input must give exactly one line on stderr and exit status 2, at once
# (every command runs under a timeout), and leave every file as it was.
# Usage: hostile_test.sh DPTRAIN DPBENCH SOURCE_DIR
# shellcheck disable=SC2015  # `check && ok || bad`: ok never fails
set -u
exe=$1 bench=$2 src=$3
# shellcheck source=cli_lib.sh
source "$(cd "$(dirname "$0")" && pwd)/cli_lib.sh"
make_tmp
cd "$tmp" || exit 1
run() { timeout 60 "$exe" "$@"; }
cpu=(--devices cpu --steps 2 --log-every 1)

# ---- Files the run writes or reads -------------------------------------------------
# Never replace what is not a regular file: device nodes (made here, never the system's),
# FIFOs, sockets, folders, and symlinks to them. Each is refused before training and is
# still what it was afterwards.
mkfifo fifo
ln -s fifo link-to-fifo
python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])' sock
mkdir folder
nodes=(fifo link-to-fifo sock folder)
if [ "$(id -u)" -eq 0 ] && mknod null c 1 3 2>/dev/null && mknod full c 1 7 2>/dev/null; then
  nodes+=(null full)
else
  echo "note: not root (or no mknod here): the device-node cases are left out"
fi
for node in "${nodes[@]}"; do
  for flag in --save --plot --metrics; do
    refuse "$flag '$node': is a" "${cpu[@]}" "$flag" "$node"
  done
done
[ -p fifo ] && [ -L link-to-fifo ] && [ -S sock ] && [ -d folder ] && ok || bad "a FIFO, link, socket or folder was replaced"
if [ -e null ]; then [ -c null ] && [ -c full ] && ok || bad "a device node was replaced by a file"; fi
# The program's own output, redirected to a file or a pipe, is not an output file (refuse
# sends stdout to ./out and stderr to ./err): metrics there overwrote the printed lines.
refuse "--metrics 'out': is this program's standard output, where it prints" "${cpu[@]}" --metrics out
refuse "--save 'err': is this program's standard error, where it prints" "${cpu[@]}" --save err
refuse "--metrics '/dev/stdout': is this program's standard output" "${cpu[@]}" --metrics /dev/stdout
timeout 10 "$exe" "${cpu[@]}" --metrics /dev/stdout 2>err | cat >/dev/null
[ "${PIPESTATUS[0]}" -eq 2 ] && grep -q "^dptrain: error: --metrics '/dev/stdout': is a FIFO" err && ok ||
  bad "--metrics /dev/stdout into a pipe: $(cat err)"
refuse "names a folder" "${cpu[@]}" --save "folder/"
refuse "does not exist" "${cpu[@]}" --save "no/such/folder/ck.safetensors"
refuse "does not exist" "${cpu[@]}" --plot "no/such/folder/run.svg"
# A folder this process cannot write into (root writes anywhere, so run as nobody there).
mkdir locked && chmod 555 locked
as_other=()
if [ "$(id -u)" -eq 0 ]; then
  if command -v setpriv >/dev/null && setpriv --reuid=65534 --regid=65534 --clear-groups true 2>/dev/null; then
    as_other=(setpriv --reuid=65534 --regid=65534 --clear-groups)
    chmod 755 "$tmp"
  fi
fi
if [ "$(id -u)" -ne 0 ] || [ ${#as_other[@]} -gt 0 ]; then
  "${as_other[@]}" timeout 10 "$exe" "${cpu[@]}" --save locked/ck.safetensors >out 2>err
  rc=$?
  [ $rc -eq 2 ] && grep -q "cannot create a file in its folder 'locked'" err && ok ||
    bad "an unwritable folder is not refused up front: rc $rc: $(cat err)"
fi
# A symlink to a regular file is followed: the file it points to is replaced, the link stays.
printf 'old' >target.safetensors
ln -s target.safetensors link.safetensors
run "${cpu[@]}" --save link.safetensors --overwrite >out 2>err && [ -L link.safetensors ] &&
  [ "$(wc -c <target.safetensors)" -gt 100 ] && ok || bad "--save through a symlink: $(cat err)"

# Inputs are bounded: a config file must be a regular file of at most 1 MiB.
refuse "--config: 'fifo' is a FIFO, not a regular file" "${cpu[@]}" --config fifo
refuse "--config: '/dev/zero' is a character device" "${cpu[@]}" --config /dev/zero
refuse "is a folder" "${cpu[@]}" --config folder
head -c 1048577 /dev/zero | tr '\0' '#' >big.toml
refuse "more than the 1048576 a config file may have" "${cpu[@]}" --config big.toml
refuse "checkpoint 'fifo': not a regular file" "${cpu[@]}" --resume fifo
refuse "checkpoint '/dev/zero': not a regular file" "${cpu[@]}" --resume /dev/zero

# Leftovers: a save removes the temporaries of its own target that dead processes left,
# and keeps those of live processes and files that are not its temporaries.
dead=999999
while kill -0 $dead 2>/dev/null; do dead=$((dead - 1)); done
touch ck.safetensors.tmp$dead.0 ck.safetensors.tmp$$.1 ck.safetensors.tmpnotes other.safetensors.tmp$dead.0
run "${cpu[@]}" --save ck.safetensors >out 2>err || bad "save failed: $(cat err)"
[ ! -e ck.safetensors.tmp$dead.0 ] && [ -e ck.safetensors.tmp$$.1 ] && [ -e ck.safetensors.tmpnotes ] &&
  [ -e other.safetensors.tmp$dead.0 ] && ok || bad "stale temporaries: $(ls)"

# ---- Numbers ------------------------------------------------------------------------
# Leading zeros are decimal, on the command line and in a config file.
run --devices cpu --batch 0256 --steps 010 --log-every 100 >out 2>&1
grep -q 'batch 256, 10 steps' out && ok || bad "--batch 0256 --steps 010: $(head -2 out)"
printf 'batch = 0256\nsteps = 010\nlog_every = 100\n' >zeros.toml
run --devices cpu --config zeros.toml >out 2>&1
grep -q 'batch 256, 10 steps' out && ok || bad "leading zeros in a config file: $(head -2 out)"
refuse "--batch: '0x10' is not a whole decimal number" "${cpu[@]}" --batch 0x10
refuse "--batch: '1e3' is not a whole decimal number" "${cpu[@]}" --batch 1e3
# Out of range is an error, never wrapped or clamped.
refuse "--steps: '99999999999999999999' is out of range" --devices cpu --steps 99999999999999999999
refuse "--seed: '-1' is out of range" "${cpu[@]}" --seed -1
refuse "--seed: '18446744073709551616' is out of range" "${cpu[@]}" --seed 18446744073709551616
refuse "--grad-accum: '2147483648' is out of range" "${cpu[@]}" --grad-accum 2147483648
refuse "--cpus: '99999999999' is out of range" --cpus 99999999999
refuse "--epochs times --samples is more samples than fit in 64 bits" --devices cpu --epochs 99999999999 --samples 99999999999 --batch 1
refuse "--steps times --batch is more samples than fit in 64 bits" --devices cpu --steps 9223372036854775807 --batch 2
refuse "--bucket-mb must be in (0, 1048576] MiB, got inf" "${cpu[@]}" --bucket-mb inf
refuse "--bucket-mb must be in (0, 1048576] MiB, got 1e+300" "${cpu[@]}" --bucket-mb 1e300
refuse "--bucket-mb must be in (0, 1048576] MiB, got nan" "${cpu[@]}" --bucket-mb nan
refuse "--first-bucket-mb must be in (0, 1048576] MiB, got inf" "${cpu[@]}" --first-bucket-mb inf
refuse "--comm-ctas must be in [0, 64] (0: NCCL's choice), got -1" "${cpu[@]}" --comm-ctas -1
refuse "--comm-ctas: '4294967296' is out of range" "${cpu[@]}" --comm-ctas 4294967296
refuse "--comm-ctas limits NCCL's thread blocks; CPU devices reduce without NCCL" "${cpu[@]}" --comm-ctas 8
refuse "--tune-buckets changes the buckets between eager steps" "${cpu[@]}" --tune-buckets --zero 2
# Hyper-parameters are validated before training, each with its range.
refuse "--momentum must be in [0, 1), got nan" "${cpu[@]}" --momentum nan
refuse "--momentum must be in [0, 1), got 1" "${cpu[@]}" --momentum 1
refuse "--weight-decay must be a finite number >= 0, got nan" "${cpu[@]}" --weight-decay nan
refuse "--weight-decay must be a finite number >= 0, got inf" "${cpu[@]}" --weight-decay inf
refuse "--beta1 must be in [0, 1), got nan" "${cpu[@]}" --optimizer adamw --beta1 nan
refuse "--beta1 must be in [0, 1), got 2" "${cpu[@]}" --optimizer adamw --beta1 2
refuse "--beta2 must be in [0, 1), got -1" "${cpu[@]}" --optimizer adamw --beta2 -1
refuse "--clip must be a finite number >= 0 (0: off), got nan" "${cpu[@]}" --clip nan
refuse "--clip must be a finite number >= 0 (0: off), got inf" "${cpu[@]}" --clip inf
refuse "--lr must be a positive number, got nan" "${cpu[@]}" --lr nan
refuse "--lr must be a positive number, got inf" "${cpu[@]}" --lr inf
refuse "--lr must be a positive number, got 0" "${cpu[@]}" --lr 0
refuse "--comm-timeout must be a number of seconds in [0.1, 1e9], got inf" "${cpu[@]}" --comm-timeout inf
refuse "--comm-timeout must be a number of seconds in [0.1, 1e9], got 1e-09" "${cpu[@]}" --comm-timeout 1e-9
# Options of the other optimizer are refused, not ignored.
refuse "--nesterov is an option of --optimizer sgd, and this run trains with adamw" "${cpu[@]}" --optimizer adamw --nesterov
refuse "--momentum is an option of --optimizer sgd, and this run trains with adamw" "${cpu[@]}" --optimizer adamw --momentum 0.5
refuse "--beta1 is an option of --optimizer adamw, and this run trains with sgd" "${cpu[@]}" --beta1 0.8
# The config file is TOML, read strictly (CLI11's reader took each of these). A key given
# twice, apart, adjacent or in both spellings, is refused (the first counted, silently).
printf 'batch = 8\nsteps = 2\nbatch = 16\n' >twice.toml
refuse "--config line 3: 'batch' given twice (first on line 1)" --devices cpu --config twice.toml
# A number of the flag's kind, its line named (CLI11's conversion named none, and took the
# file's value unread where the command line gave the flag).
printf 'batch = 8\nsteps = 4.0\n' >whole.toml
refuse "--config line 2: steps takes a whole number, not 4.0" --devices cpu --config whole.toml --steps 2
printf 'lr = 0.1e\n' >float.toml
refuse "--config line 1: lr takes a number, not 0.1e" --devices cpu --config float.toml
printf 'log-every = 1\nlog_every = 2\n' >twice.toml
refuse "--config line 2: 'log-every' given twice (first on line 1)" "${cpu[@]}" --config twice.toml
printf 'steps = 2\nsteps = 3\n' >twice.toml
refuse "--config line 2: 'steps' given twice" "${cpu[@]}" --config twice.toml
# Each value has its flag's type: a number, true or false, or a quoted string.
config_refused() { # MESSAGE FILE-TEXT
  printf '%s\n' "$2" >strict.toml
  refuse "$1" --devices cpu --config strict.toml
}
config_refused "--config line 1: steps takes a number (no quotes), not \"2\"" 'steps = "2"'
config_refused "--config line 1: lr takes a number (no quotes), not \"0.1\"" "lr = '0.1'"
config_refused "--config line 1: steps: arrays and tables are not read; give one value" 'steps = [2]'
config_refused "--config line 2: 'nesterov' has no value (nesterov = ...)" $'# SGD\nnesterov'
config_refused "--config line 1: nesterov takes true or false (no quotes), not 1" 'nesterov = 1'
config_refused "--config line 1: cuda-graph takes true or false (no quotes), not \"true\"" 'cuda_graph = "true"'
config_refused "--config line 1: model = seed: text must be quoted (model = \"seed\")" 'model = seed'
config_refused "--config line 1: model takes a quoted string, not 1000" 'model = 1000'
config_refused "--config line 1: sections ([...]) are not read" $'[train]\nsteps = 2'
config_refused "--config line 1: unexpected text after the value of steps: '3'" 'steps = 2 3'
config_refused "--config line 1: model: the string has no closing \"" 'model = "seed'
config_refused "--config line 1: 'bogus' names no flag" 'bogus = 1'
config_refused "--config line 1: 'config' cannot be given in a config file" 'config = "strict.toml"'
config_refused "--config line 1: data: the escape '\\q' is not read" 'data = "a\q.npy"'
config_refused "--config line 1: save: \\u needs 4 hex digits of a Unicode scalar value other than 0 (a value ends at a NUL), got 'D800'" 'save = "a\uD800"'
config_refused "--config line 1: save: \\U needs 8 hex digits of a Unicode scalar value other than 0 (a value ends at a NUL), got '12\"'" 'save = "\U12"'
config_refused "--config line 1: save: \\u needs 4 hex digits of a Unicode scalar value other than 0 (a value ends at a NUL), got '0000'" 'save = "a\u0000b"'
# TOML's Unicode escapes are the character's UTF-8.
printf 'save = "caf\\u00e9-\\U0001F600.ckpt"\n' >unicode.toml
run "${cpu[@]}" --config unicode.toml >out 2>&1 && [ -s "café-😀.ckpt" ] && ok ||
  bad "\\u and \\U escapes were not read as UTF-8: $(tail -1 out)"
# Comments, blank lines, both kinds of string and a '#' inside one are read as TOML reads them.
printf '# a run\n\nsteps = 2   # two\nlog_every = 1\nmodel = "16-8-4"\nsave = '"'"'a#b.ckpt'"'"'\nnesterov = false\n' >strict.toml
run --devices cpu --config strict.toml >out 2>&1 && grep -q "^step 2/2 " out && [ -s 'a#b.ckpt' ] && ok ||
  bad "a strict TOML file was not read as written: $(tail -1 out)"
printf 'optimizer = "adamw"\nmomentum = 0.5\n' >mixed.toml
refuse "--momentum is an option of --optimizer sgd" "${cpu[@]}" --config mixed.toml
# A switch set to false is off, not given: no clash with the option it would contradict.
printf 'optimizer = "adamw"\nnesterov = false\nauto_resume = false\n' >off.toml
run "${cpu[@]}" --config off.toml --save off.safetensors >out 2>&1 &&
  run --devices cpu --steps 3 --config off.toml --resume off.safetensors >out 2>&1 && ok ||
  bad "switches set to false clashed: $(tail -1 out)"
# Each optimizer has its own default learning rate, and the header says which is used.
run "${cpu[@]}" --optimizer adamw >out 2>&1
grep -q 'AdamW(lr=0.001,' out && ok || bad "AdamW's default lr: $(sed -n 2p out)"
run "${cpu[@]}" --lr 1e30 --on-nonfinite skip-step >out 2>&1
grep -q 'SGD(lr=1e+30,' out && ok || bad "lr 1e30 is not printed as 1e+30: $(sed -n 2p out)"
# More micro-batches than a replica has samples: refused at once, before any allocation.
refuse "--grad-accum must be <= 10, the most samples a replica gets of a batch of 10" --devices cpu --grad-accum 100000000 --batch 10
refuse "--zero must be 0, 1 or 2, got 3" --cpus 2 --zero 3
refuse "--zero must be 0, 1 or 2, got -1" --cpus 2 --zero -1
refuse "--zero shards the optimizer state over replicas that each update; the p2p reduction updates on the master alone (use nccl on GPUs, host on CPU devices)" --cpus 2 --zero 1 --reduce p2p
refuse "unknown --grad-comm 'fp16': expected fp32 or bf16" --cpus 2 --grad-comm fp16
refuse "--grad-accum must be <= 4" --cpus 3 --grad-accum 5 --batch 10
refuse "--grad-accum must be <= 10" --devices cpu --grad-accum 2000000000 --batch 10

# ---- Checkpoints ----------------------------------------------------------------------
run --devices cpu --steps 4 --optimizer adamw --save good.safetensors >/dev/null 2>&1 || bad "no checkpoint to edit"
# edit.py IN OUT KEY VALUE: metadata KEY set to VALUE; "dtype NAME D": tensor NAME's dtype
# written as D; "nan NAME I" / "inf NAME I": element I of tensor NAME made non-finite;
# "flip NAME B MASK": byte B of tensor NAME XORed with MASK (behind its checksum's back);
# "del KEY": metadata KEY taken out; "rename KEY NEW": metadata KEY named NEW.
cat >edit.py <<'PY'
import json, struct, sys
sys.path.insert(0, sys.argv.pop(1))
from xxh64 import xxh64
src, dst, what = sys.argv[1], sys.argv[2], sys.argv[3:]
data = open(src, "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header, body = json.loads(data[8:8 + n]), bytearray(data[8 + n:])
if what[0] == "dtype":
    header[what[1]]["dtype"] = what[2]
elif what[0] in ("nan", "inf"):
    begin = header[what[1]]["data_offsets"][0] + 4 * int(what[2])
    body[begin:begin + 4] = struct.pack("<f", float(what[0]))
    # Its checksum follows (a file saved with the value): the value itself is what is checked.
    lo, hi = header[what[1]]["data_offsets"]
    header["__metadata__"]["checksum:" + what[1]] = "xxh64:%016x" % xxh64(bytes(body[lo:hi]))
elif what[0] == "flip":
    body[header[what[1]]["data_offsets"][0] + int(what[2])] ^= int(what[3], 0)
elif what[0] == "del":
    del header["__metadata__"][what[1]]
elif what[0] == "rename":
    header["__metadata__"][what[2]] = header["__metadata__"].pop(what[1])
else:
    header["__metadata__"][what[0]] = what[1]
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(dst, "wb").write(struct.pack("<Q", len(text)) + text + bytes(body))
PY
resume_bad() {  # resume_bad "EXPECTED" EDIT...
  local want=$1
  shift
  python3 edit.py "$src/tests" good.safetensors bad.safetensors "$@"
  refuse "$want" --devices cpu --steps 8 --optimizer adamw --resume bad.safetensors
}
resume_bad "metadata 'step' must be a whole number in [0, 9223372036854775807], got 'abc'" step abc
resume_bad "metadata 'step' must be a whole number" step ""
resume_bad "metadata 'step' must be a whole number" step 99999999999999999999
resume_bad "metadata 'step' must be a whole number" step 12abc
resume_bad "metadata 'step' must be a whole number" step " 3"
resume_bad "metadata 'optimizer_steps' must be a whole number in [0, 4], got '-1'" optimizer_steps -1
resume_bad "metadata 'optimizer_steps' must be a whole number in [0, 4], got '5'" optimizer_steps 5
resume_bad "is at step 9, past --steps 8" step 9
resume_bad "tensor '0.weight' is I32, the model needs F32" dtype 0.weight I32
resume_bad "tensor '0.weight' holds nan at index 5; weights and optimizer state must be finite" nan 0.weight 5
resume_bad "tensor 'optimizer.exp_avg_sq' holds inf at index 0" inf optimizer.exp_avg_sq 0
resume_bad "tensor '2.bias' holds nan at index 3" nan 2.bias 3
resume_bad "'bad.safetensors'" step abc  # the file is named
# A corrupted checkpoint is refused on every load, naming the file and the tensor: one
# exponent bit of 0.weight[50] (0.27 -> 9.2e37, which predict took silently), one byte
# of the optimizer state (which training resumed from).
python3 edit.py "$src/tests" good.safetensors flip.safetensors flip 0.weight 203 0x40
refuse "checkpoint 'flip.safetensors': tensor '0.weight' does not match its checksum (" \
  --devices cpu --steps 8 --optimizer adamw --resume flip.safetensors
python3 -c 'import numpy as np; np.save("rows.npy", np.ones((6, 16), np.float32))'
refuse "checkpoint 'flip.safetensors': tensor '0.weight' does not match its checksum (" \
  predict --resume flip.safetensors --data rows.npy --out pred.npy
[ ! -e pred.npy ] && ok || bad "predict wrote outputs from a corrupted checkpoint"
python3 edit.py "$src/tests" good.safetensors flip.safetensors flip optimizer.exp_avg 1 0x01
refuse "tensor 'optimizer.exp_avg' does not match its checksum" --devices cpu --steps 8 --optimizer adamw --resume flip.safetensors
# The metadata holds the keys dptrain writes, no other and none less.
resume_bad "has an unknown key 'Rng' in its metadata" rename rng Rng
resume_bad "has an unknown key 'comment' in its metadata" comment "hand-edited"
resume_bad "has no 'rng' in its metadata" del rng
resume_bad "tensor '2.bias' has no checksum" del checksum:2.bias
# A checkpoint written before checksums were kept (by dptrain as it was) still loads, with
# a note; the next save adds them.
legacy="$src/tests/fixtures/dptrain-1-no-checksums.safetensors"
old=(--devices cpu --model 4-8-2 --batch 16)
run "${old[@]}" --steps 5 --resume "$legacy" --save renewed.safetensors >out 2>err && grep -q "resumed from .* at step 3" out &&
  [ "$(cat err)" = "dptrain: note: checkpoint '$legacy' carries no checksums (it was written before dptrain kept them): its tensors cannot be checked for corruption; the next save adds them" ] &&
  grep -q '"checksum:0.weight":"xxh64:' renewed.safetensors && ok || bad "a checkpoint without checksums: $(cat out err)"
python3 -c 'import numpy as np; np.save("rows4.npy", np.ones((3, 4), np.float32))'
run predict --resume "$legacy" --data rows4.npy --out legacy.npy >out 2>err && grep -q "carries no checksums" err &&
  ok || bad "predict from a checkpoint without checksums: $(cat out err)"

# ---- Runs, logs and long jobs ---------------------------------------------------------
# --metrics continues on resume: the records of steps after the checkpoint's (written by
# a run killed after it) are dropped, the new ones appended.
run --devices cpu --steps 10 --log-every 5 --save m.safetensors --metrics m.jsonl >/dev/null 2>&1
echo '{"step": 15, "loss": 1, "lr": 0.05, "samples_per_s": 1, "step_ms": 1, "elapsed_s": 1}' >>m.jsonl
run --devices cpu --steps 20 --log-every 5 --resume m.safetensors --metrics m.jsonl >out 2>&1
python3 - m.jsonl <<'PY' && ok || bad "--metrics on resume: $(cat m.jsonl)"
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1])]
assert steps == [1, 5, 10, 11, 15, 20], steps
PY
grep -q "resumed from 'm.safetensors' at step 10" out && ok || bad "the header does not say it resumed: $(head -3 out)"
# A record cut short at the end (a kill or a full disk mid-line) is dropped, not joined by
# the next record; a file that is no metrics file of ours is refused before training and
# left as it was.
run --devices cpu --steps 10 --log-every 5 --save m.safetensors --metrics m.jsonl >/dev/null 2>&1
printf '{"step": 7, "loss": 0.9' >>m.jsonl
run --devices cpu --steps 15 --log-every 5 --resume m.safetensors --metrics m.jsonl >out 2>&1
python3 - m.jsonl <<'PY' && ok || bad "--metrics on resume after a cut record: $(cat m.jsonl)"
import json, sys
steps = [json.loads(l)["step"] for l in open(sys.argv[1])]
assert steps == [1, 5, 10, 11, 15], steps
PY
printf 'my notes\n' >notes.txt
refuse "--metrics 'notes.txt': line 1 is no record ({\"step\": N, ...}): not a metrics file of dptrain's" \
  --devices cpu --steps 15 --resume m.safetensors --metrics notes.txt
[ "$(cat notes.txt)" = "my notes" ] && ok || bad "a refused metrics file was changed: $(cat notes.txt)"
printf 'my notes' >notes.txt  # one line, without its newline: no record cut short either
refuse "--metrics 'notes.txt': line 1 is no record" --devices cpu --steps 15 --resume m.safetensors --metrics notes.txt
[ "$(cat notes.txt)" = "my notes" ] && ok || bad "a refused metrics file was changed: $(cat notes.txt)"
# A fresh run replaces only its own kinds of file (it replaced notes.txt, which a resumed
# run refuses): an empty file, a metrics file, a dptrain checkpoint, a plot of dptrain's;
# anything else is refused before the first step and left as it was, unless --overwrite.
printf 'my notes\n' >notes.txt
refuse "--metrics 'notes.txt': line 1 is no record ({\"step\": N, ...}): not a metrics file of dptrain's, which a fresh run would replace (name another file, or give --overwrite)" \
  "${cpu[@]}" --metrics notes.txt
refuse "--save 'notes.txt' is not a dptrain checkpoint, which a run would replace (name another file, or give --overwrite)" \
  "${cpu[@]}" --save notes.txt
refuse "--plot 'notes.txt' is not a plot of dptrain's" "${cpu[@]}" --plot notes.txt
[ "$(cat notes.txt)" = "my notes" ] && ok || bad "a refused output was changed: $(cat notes.txt)"
: >empty.jsonl
run "${cpu[@]}" --metrics empty.jsonl --save ours.safetensors --plot ours.svg >/dev/null 2>&1 &&
  run "${cpu[@]}" --metrics empty.jsonl --save ours.safetensors --plot ours.svg >out 2>&1 && ok ||
  bad "a fresh run over its own kinds of file: $(cat out)"
run "${cpu[@]}" --metrics notes.txt --overwrite >/dev/null 2>&1 && grep -q '^{"step": 1, ' notes.txt && ok ||
  bad "--overwrite did not replace the metrics file: $(cat notes.txt)"
run --devices cpu --steps 20 --log-every 5 --resume m.safetensors --lr 0.01 --schedule cosine >out 2>&1
grep -q "changed: lr 0.05 -> 0.01, schedule constant -> cosine" out && ok || bad "changed settings: $(sed -n 3p out)"
# --auto-resume: a fresh start, then a continuation, then nothing left to do (exit 0).
run --devices cpu --steps 6 --auto-resume --save auto.safetensors >out 2>&1 && ! grep -q resumed out && ok ||
  bad "--auto-resume without a checkpoint: $(cat out)"
run --devices cpu --steps 12 --auto-resume --save auto.safetensors >out 2>&1 &&
  grep -q "resumed from 'auto.safetensors' at step 6" out && ok || bad "--auto-resume: $(cat out)"
run --devices cpu --steps 12 --auto-resume --save auto.safetensors >out 2>&1 &&
  grep -q "done: nothing to train, the run was complete at step 12 of 12" out && ok || bad "--auto-resume, done: $(cat out)"
# The finished run is not rewritten (the same bytes, the same time), in a folder it may
# not write into either; and the metrics' elapsed_s goes on across the resume.
cp -p auto.safetensors auto.before
run --devices cpu --steps 12 --auto-resume --save auto.safetensors >out 2>&1 && cmp -s auto.safetensors auto.before &&
  [ "$(stat -c %y auto.safetensors)" = "$(stat -c %y auto.before)" ] && ok ||
  bad "--auto-resume on a finished run rewrote its checkpoint: $(cat out)"
if [ "$(id -u)" -ne 0 ] || [ ${#as_other[@]} -gt 0 ]; then
  mkdir finished && cp auto.safetensors finished/ && chmod 555 finished
  "${as_other[@]}" timeout 60 "$exe" --devices cpu --steps 12 --auto-resume --save finished/auto.safetensors >out 2>&1
  rc=$?
  [ $rc -eq 0 ] && grep -q "done: nothing to train" out && cmp -s finished/auto.safetensors auto.safetensors && ok ||
    bad "--auto-resume on a finished run in a read-only folder (rc $rc): $(cat out)"
  "${as_other[@]}" timeout 60 "$exe" --devices cpu --steps 14 --auto-resume --save finished/auto.safetensors >out 2>&1
  rc=$?  # a run with steps left is still refused up front there
  [ $rc -eq 2 ] && grep -q "cannot create a file in its folder 'finished'" out && ok ||
    bad "--auto-resume with steps left in a read-only folder (rc $rc): $(cat out)"
fi
rm -f el.safetensors el.jsonl
run --devices cpu --steps 6 --log-every 3 --auto-resume --save el.safetensors --metrics el.jsonl >/dev/null 2>&1
cp el.safetensors el.first
run --devices cpu --steps 12 --log-every 3 --auto-resume --save el.safetensors --metrics el.jsonl >/dev/null 2>&1
python3 - el.jsonl el.first <<'PY' && ok || bad "elapsed_s across a resume: $(cat el.jsonl)"
import json, struct, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["step"] for r in rows] == [1, 3, 6, 7, 9, 12], rows
t = [r["elapsed_s"] for r in rows]
data = open(sys.argv[2], "rb").read()
saved = float(json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])["__metadata__"]["elapsed_s"])
# The checkpoint keeps the run's time, and the resumed run goes on from it, not from 0.
assert t[2] <= saved <= t[3] and t == sorted(t), (t, saved)
PY
refuse "--auto-resume needs --save" "${cpu[@]}" --auto-resume
refuse "--resume excludes --auto-resume" "${cpu[@]}" --auto-resume --save x.safetensors --resume x.safetensors
# Off a terminal the progress is plain lines, with the ETA; no carriage returns.
run --devices cpu --steps 5 >out 2>&1
! grep -q $'\r' out && grep -q '^step 5/5 loss .* ETA ' out && ok || bad "plain progress lines: $(cat -A out | head -5)"
# A stopped run ends with 'stopped:' on a line of its own and the loss it got to; a run
# that will take hours on a CPU device warns once, early. A short run says nothing.
# (Into a new file: a 'step 1/' left in `out` by an earlier run would send the signal
# before dptrain even started.)
rm -f out
"$exe" --devices cpu --steps 100000000 --log-every 100000 --batch 8 >out 2>err &
pid=$!
(sleep 60 && kill -9 $pid 2>/dev/null) &
watchdog=$!
# After its first step: its handler is in place (before it, under load, a background job
# ignores SIGINT and would run until the watchdog); and after the warning, which is paced
# from the steps after the first.
for ((i = 0; i < 600; ++i)); do grep -q '^step 1/' out 2>/dev/null && grep -q 'warning' err && break; sleep 0.1; done
kill -INT $pid
wait $pid
rc=$?
kill $watchdog 2>/dev/null
[ $rc -eq 130 ] && grep -q '^stopped: [0-9]* steps in .*; loss [0-9.e+-]* -> [0-9.e+-]* ' out && ! grep -q '^done:' out &&
  ok || bad "stop summary (rc $rc): $(cat out)"
grep -q '^dptrain: warning: at .* s a step.*, the .* steps left will take about .* hours on the CPU; a GPU (--devices cuda:0)' err &&
  [ "$(wc -l <err)" -eq 1 ] && ok || bad "no warning before hours of CPU work: $(cat err)"
# The warning comes right after the first step (it came after the fourth: a first CPU step
# of minutes, on a large model, made the user wait for two); 10^12 steps are hours at any
# pace, so the floor the first step gives (an eighth of it) already tells.
rm -f out
"$exe" --devices cpu --steps 1000000000000 --log-every 1 --batch 8 >out 2>&1 &
pid=$!
for ((i = 0; i < 600; ++i)); do grep -q '^step 3/' out 2>/dev/null && break; sleep 0.1; done
kill -INT $pid
wait $pid
warned=$(grep -n '^dptrain: warning: at least .* s a step (an eighth of the first' out | cut -d: -f1)
second=$(grep -n '^step 2/' out | cut -d: -f1)
[ -n "$warned" ] && [ -n "$second" ] && [ "$warned" -lt "$second" ] && ok ||
  bad "the CPU warning after the first step: $(head -8 out)"
run "${cpu[@]}" >out 2>err && [ ! -s err ] && ok || bad "a short run wrote on stderr: $(cat err)"
# ---- Signals never lose the checkpoint -----------------------------------------------
# However many SIGTERM/SIGINT arrive, the run stops after its step and writes its
# checkpoint: GNU timeout sends two (to the child, then to its process group), a burst
# stands for a user or a scheduler that insists. Each waits for the first step (bounded),
# then signals; the outcome is the same on any machine.
wait_for() {  # wait_for PATTERN FILE: up to 60 s for a line in FILE
  local i
  for ((i = 0; i < 600; ++i)); do grep -q "$1" "$2" 2>/dev/null && return 0; sleep 0.1; done
  return 1
}
stopped_with_checkpoint() {  # NAME RC WANT FILE: the status, the stop line, a checkpoint that loads
  [ "$2" -eq "$3" ] && grep -q '^stopped by SIGTERM after step' "$4.out" && [ -s "$4.safetensors" ] &&
    run --devices cpu --batch 8 --steps 1 --resume "$4.safetensors" 2>&1 | grep -q 'past --steps' && ok ||
    bad "$1: status $2, want $3; $(tail -1 "$4.out"); checkpoint: $(ls "$4.safetensors" 2>&1)"
}
long=(--devices cpu --steps 100000000 --log-every 1000 --batch 8)
rm -f tmo.out tmo.safetensors
timeout --preserve-status 600 "$exe" "${long[@]}" --save tmo.safetensors >tmo.out 2>&1 &
pid=$!
wait_for '^step 1/' tmo.out
kill -ALRM $pid  # timeout's own alarm: it times out now
wait $pid
stopped_with_checkpoint "under timeout" $? 143 tmo
rm -f burst.out burst.safetensors
"$exe" "${long[@]}" --save burst.safetensors >burst.out 2>&1 &
pid=$!
wait_for '^step 1/' burst.out
for ((i = 0; i < 20; ++i)); do kill -TERM $pid; done
wait $pid
stopped_with_checkpoint "20 SIGTERMs" $? 143 burst
# A signal during start-up (here while the model of 50 MB is made, after the warning the
# trainer gives before it) ends the run with its line and status, not a death by signal.
rm -f start.out start.err
"$exe" --devices cpu --model 2048-2048x3-2048 --batch 1 --steps 3 --schedule warmup --warmup 5 \
  --save start.safetensors >start.out 2>start.err &
pid=$!
for ((i = 0; i < 6000; ++i)); do grep -q 'warning' start.err 2>/dev/null && break; sleep 0.01; done
kill -TERM $pid
wait $pid
rc=$?
[ $rc -eq 143 ] && grep -q '^stopped' start.out && ok || bad "a signal during start-up: status $rc: $(cat start.out)"
# dpbench on CPU devices with no workload given measures one that takes seconds, row by row.
timeout 120 "$bench" --cpus 2 --out bench >out 2>err && grep -q 'CPU devices: the default workload is 16-128x2-4' out &&
  [ "$(grep -cE '^(weak|strong) ' out)" -eq 4 ] && ok || bad "dpbench's CPU default: $(cat out err)"
# Classification reports the logged batch's accuracy: progress line, summary, metrics.
run --devices cpu --task classification --model 16-32-4 --steps 10 --log-every 5 --metrics acc.jsonl >out 2>&1
grep -q '^step 5/10 loss [0-9.]* accuracy [0-9.]*%' out && grep -q '^accuracy: [0-9.]*% of the last logged batch' out &&
  ok || bad "accuracy in the output: $(cat out)"
python3 - acc.jsonl <<'PY' && ok || bad "accuracy in --metrics: $(cat acc.jsonl)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 3 and all(0 <= r["accuracy"] <= 1 for r in rows), rows
PY
run "${cpu[@]}" --metrics reg.jsonl >/dev/null 2>&1
! grep -q accuracy reg.jsonl && grep -q '"lr": 0.05,' reg.jsonl && ok || bad "regression metrics: $(cat reg.jsonl)"

# ---- Small things a new user meets ------------------------------------------------------
run --devices cpu --config "$src/examples/run.toml" --steps 20 >out 2>&1 && grep -q 'AdamW(lr=0.003' out && ok ||
  bad "examples/run.toml: $(cat out)"
"$exe" --help >out
grep -q -- '--no-overlap  ' out && ! grep -q '{false}' out && grep -q -- '--config FILE' out && ok ||
  bad "--help: $(grep -E 'overlap|config' out)"
grep -q -- 'Hidden activation: relu, gelu, tanh, gelu_tanh, or none' out && ok || bad "--act none is not documented"
run "${cpu[@]}" --act none >out 2>&1 && grep -q 'Linear(16, 128),' out && ok || bad "--act none: $(head -1 out)"
run "${cpu[@]}" >out 2>&1
grep -q 'SGD(lr=0.05, momentum=0.9, weight_decay=0)' out && grep -q '^step 1/2 loss .* lr 0.05 ' out && ok ||
  bad "floats as a person writes them: $(head -3 out)"

# ---- Found by a second hostile pass ---------------------------------------------------
# Sizes past 2^63 bytes are out of memory (exit 3, one line), never a wrapped size.
outofmem() {
  timeout 20 "$exe" "$@" >out 2>err
  local rc=$?
  [ $rc -eq 3 ] && [ "$(wc -l <err)" -eq 1 ] && grep -q '^dptrain: error: out of memory on ' err && ok ||
    bad "dptrain $*: rc $rc, not 3: $(cat err)"
}
outofmem --devices cpu --steps 1 --batch 288230376151711744
outofmem --devices cpu --steps 1 --batch 288230376151711744 --samples 1
outofmem --devices cpu --steps 1 --batch 4398046511104 --model 1048576-4
outofmem --devices cpu --epochs 9223372036854775807 --samples 1 --batch 9223372036854775807
# (a third pass) A device list repeating a device 20000 times (3.4 GB of host memory and
# 16 s before the first step), --cpus past the CPU devices there are.
refuse "invalid device list: more than 1024 devices" --devices "$(printf 'cpu:0,%.0s' {1..1100})cpu:0" --steps 1
refuse "--cpus must be in [1, 1024], got 100000" --cpus 100000 --steps 1
# An output name longer than the file system allows: refused up front (it trained the whole
# run, then failed at the rename, with no checkpoint).
long=$(printf 'a%.0s' {1..300}).x
refuse "its name is 302 bytes long, and its folder's file system allows" "${cpu[@]}" --save "$long"
refuse "its name is 302 bytes long, and its folder's file system allows" "${cpu[@]}" --plot "$long"
# The metrics file cannot grow (a file size limit here, a full disk elsewhere): a warning
# with the reason, and the run goes on to its checkpoint (it ended with exit 1 and none).
rm -f big.jsonl big.safetensors
(trap '' XFSZ; ulimit -f 64; timeout 60 "$exe" --devices cpu --model 4-8-2 --batch 8 --steps 2000 --log-every 1 \
  --metrics big.jsonl --save big.safetensors >/dev/null 2>err)
rc=$?
[ $rc -eq 0 ] && [ -s big.safetensors ] && [ "$(wc -l <err)" -eq 1 ] &&
  grep -q "^dptrain: warning: writing the metrics file 'big.jsonl' failed at step [0-9]* (File too large)" err && ok ||
  bad "a metrics file that cannot grow (rc $rc): $(cat err)"
# A periodic save that fails (a full disk: a file size limit here) is a warning, once, and
# the run goes on (it ended with exit 1 at the first); only the final save's failure is
# exit 1, naming what the file still holds, which is left as it was.
big=(--devices cpu --model 64-256-64 --batch 8)  # a checkpoint of 260 KB, over the limit
run --devices cpu --model 4-8-2 --batch 8 --steps 3 --save full.safetensors >/dev/null 2>&1
cp full.safetensors full.orig
(trap '' XFSZ; ulimit -f 64; timeout 60 "$exe" "${big[@]}" --steps 12 --save-every 5 --log-every 4 --save full.safetensors \
  >out 2>err)
rc=$?
[ $rc -eq 1 ] && grep -q '^step 12/12' out && [ "$(wc -l <err)" -eq 2 ] &&
  grep -q "^dptrain: warning: saving the checkpoint at step 5 failed (checkpoint 'full.safetensors': .*File too large.*); training goes on and tries again every 5 steps (--save-every)" err &&
  grep -q "^dptrain: error: checkpoint 'full.safetensors': .*File too large; any previous checkpoint there is unchanged: it holds a checkpoint of an earlier run" err &&
  cmp -s full.safetensors full.orig && ok || bad "periodic saves on a full disk (rc $rc): $(cat err; tail -1 out)"
# Once the disk has room again, the next period saves, and the end says what failed.
rm -f room.safetensors
(trap '' XFSZ; ulimit -S -f 64; exec "$exe" "${big[@]}" --steps 100000000 --save-every 50 --log-every 100000 \
  --save room.safetensors >room.out 2>room.err) &
pid=$!
wait_for 'warning: saving the checkpoint at step 50 failed' room.err
prlimit --pid $pid --fsize=unlimited:
for ((i = 0; i < 600; ++i)); do [ -s room.safetensors ] && break; sleep 0.1; done
kill -TERM $pid
wait $pid
rc=$?
[ $rc -eq 143 ] && [ "$(grep -c 'warning: saving the checkpoint' room.err)" -eq 1 ] &&
  grep -q "^dptrain: warning: [0-9]* periodic save(s) failed, the first at step 50 (.*File too large.*); the final one, of step [0-9]*, was written" room.err &&
  ok || bad "a periodic save after a failed one (rc $rc): $(cat room.err)"
# The ETA of a run of 2^63 steps (it wrapped to -2147483648h); a run of one step reports
# that step's speed (it said 0.0 samples/s, 0.0000 ms/step).
timeout 10 "$exe" --devices cpu --steps 9223372036854775807 --batch 1 --samples 1 --model 2-2 --log-every 1000 \
  2>/dev/null | grep -m1 ETA >out
grep -q 'ETA over 10^6 h' out && ! grep -q 'ETA -' out && ok || bad "the ETA of 2^63 steps: $(cat out)"
run --devices cpu --steps 1 >out 2>&1
grep -E '^done: 1 steps' out | grep -qvE ' 0\.0 samples/s| 0\.0000 ms/step' && ok || bad "a run of one step: $(grep done out)"
# A warm-up that does nothing (constant has none) is refused; one as long as the run warns.
refuse "--warmup has no effect with --schedule constant: use --schedule warmup" "${cpu[@]}" --warmup 100
run --devices cpu --steps 5 --warmup 9223372036854775807 --schedule cosine >out 2>err
[ "$(wc -l <err)" -eq 1 ] && grep -q "^dptrain: warning: --warmup of 9223372036854775807 steps is not shorter than the run's 5" err &&
  ok || bad "a warm-up longer than the run: $(cat err)"
# .npy files of zeros, written without numpy: 50 rows of 4 and their labels; 20000 of 64.
python3 - <<'PY'
def npy(path, descr, shape, nbytes):
    h = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)
    h += " " * (63 - (10 + len(h)) % 64) + "\n"
    open(path, "wb").write(b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h.encode() + bytes(nbytes))
npy("hx.npy", "<f4", "(50, 4)", 50 * 4 * 4)
npy("hy.npy", "<i8", "(50,)", 50 * 8)
npy("cut.npy", "<f4", "(20000, 64)", 20000 * 64 * 4)
npy("cut_y.npy", "<i8", "(20000,)", 20000 * 8)
PY
# A data file cut short while the run reads it (it is mapped into memory): one line and
# exit 1, not a bus error.
timeout 60 "$exe" --devices cpu --epochs 100000 --batch 64 --model 64-8-3 --data cut.npy --targets cut_y.npy \
  --log-every 100000 >out 2>err &
for i in $(seq 100); do grep -q '^step 1/' out && break; sleep 0.1; done  # training, the file mapped
python3 -c "open('cut.npy', 'r+b').truncate(1000)"
wait $!
rc=$?
[ $rc -eq 1 ] && [ "$(grep -c . err)" -le 2 ] && grep -q '^dptrain: error: a data file was cut short or rewritten' err &&
  ok || bad "a data file cut short mid-run (rc $rc): $(cat err)"
# A billion micro-batches: refused, on every machine (a step keeps a loss per micro-batch:
# 32 GB of them failed on a 24 GiB host and ran until the timeout on a 128 GiB one);
# a batch of file data past the address space.
run --devices cpu --steps 1 --batch 1000000000 --grad-accum 1000000000 >out 2>err
rc=$?
[ $rc -eq 2 ] && [ "$(cat err)" = "dptrain: error: --grad-accum must be <= 65536 micro-batches a step, got 1000000000" ] &&
  ok || bad "a billion micro-batches: rc $rc: $(cat err)"
outofmem --devices cpu --model 4-8-3 --data hx.npy --targets hy.npy --epochs 1 --batch 4611686018427387904
# SGD's momentum changed on resume, as the README allows optimizer settings to: to 0 drops
# the buffer (it was refused: "a tensor that this model and optimizer do not have"), and
# back from 0 starts one at zero.
run --devices cpu --steps 4 --save m9.safetensors >/dev/null 2>&1
run --devices cpu --steps 6 --momentum 0 --resume m9.safetensors --save m0.safetensors >out 2>&1 &&
  grep -q 'changed: momentum 0.9 -> 0, its momentum buffer dropped' out && ok || bad "momentum to 0 on resume: $(cat out)"
run --devices cpu --steps 8 --resume m0.safetensors >out 2>&1 && grep -q 'changed: momentum 0 -> 0.9$' out && ok ||
  bad "momentum from 0 on resume: $(cat out)"
# Messages that said what was not so: a file of the magic alone "does not start with" it;
# a checkpoint of the endless stream "was made with --samples 0", a value no flag takes.
printf '\x93NUMPY' >six.npy
refuse "a .npy file cut short: it ends before its format version" --devices cpu --data six.npy --targets hy.npy
run --devices cpu --steps 2 --save endless.safetensors >/dev/null 2>&1
refuse "was made with an endless stream of samples, this run has 100" --devices cpu --steps 4 --samples 100 \
  --resume endless.safetensors
timeout 20 "$bench" --cpus 1 --batch 1152921504606846976 --steps 1 --warmup 1 --out bench >out 2>err
[ $? -eq 3 ] && [ "$(wc -l <err)" -eq 1 ] && ok || bad "dpbench, a batch of 2^60: $(cat err)"
# Two outputs in one file, or an output over an input, are refused up front; --save may
# replace the --resume checkpoint.
refuse "--save and --plot name the same file 'x.out'" "${cpu[@]}" --save x.out --plot x.out
refuse "--save and --metrics name the same file" "${cpu[@]}" --save x.out --metrics x.out
refuse "--plot and --metrics name the same file" "${cpu[@]}" --plot x.out --metrics ./x.out
ln -sf good.safetensors alias.svg
refuse "--plot and --resume name the same file 'good.safetensors'" --devices cpu --steps 8 --optimizer adamw --resume good.safetensors --plot alias.svg
refuse "--metrics and --resume name the same file" --devices cpu --steps 8 --optimizer adamw --resume good.safetensors --metrics good.safetensors
printf 'steps = 3\n' >own.toml
refuse "--save and --config name the same file 'own.toml'" --devices cpu --config own.toml --save own.toml
ln -f own.toml own-link.jsonl  # a hard link: the same file under another name
refuse "--metrics and --config name the same file 'own.toml'" --devices cpu --config own.toml --metrics own-link.jsonl
ln -f good.safetensors good-link.jsonl
refuse "--metrics and --resume name the same file" --devices cpu --steps 8 --optimizer adamw --resume good.safetensors \
  --metrics good-link.jsonl
cp good.safetensors again.safetensors
run --devices cpu --steps 6 --optimizer adamw --resume again.safetensors --save again.safetensors >/dev/null 2>&1 && ok ||
  bad "--save over the --resume checkpoint is refused"
# A closed pipe stops the run like SIGTERM: the checkpoint is written.
rm -f pipe.safetensors
"$exe" --devices cpu --steps 100000 --log-every 1 --batch 8 --save pipe.safetensors 2>/dev/null | head -1 >/dev/null
[ -s pipe.safetensors ] && ok || bad "a closed stdout killed the run without its checkpoint"
# Control characters in a value stay inside the one error line.
refuse "'8\\n'" "${cpu[@]}" --batch $'8\n'
refuse "invalid model spec" "${cpu[@]}" --model $'16-8\n-4'
refuse "does not exist" "${cpu[@]}" --save $'no\nsuch/x.safetensors'
# A run that fails before its first step leaves an existing metrics file as it was.
echo old >old.jsonl
timeout 20 "$exe" --devices cpu --steps 2 --batch 17179869184 --metrics old.jsonl >/dev/null 2>&1
[ "$(cat old.jsonl)" = old ] && ok || bad "a failed run emptied the metrics file"
# A huge or foreign metrics file on resume: cut without reading it into memory, or refused.
run --devices cpu --steps 4 --log-every 2 --save big.safetensors --metrics big.jsonl >/dev/null 2>&1
truncate -s 2G big.jsonl
refuse "line 4 is over 64 KiB: not a metrics file" --devices cpu --steps 6 --log-every 2 --resume big.safetensors --metrics big.jsonl
# Floats that a float cannot hold are refused naming the value given.
refuse "--clip: '1e-50' is too small for a float" "${cpu[@]}" --clip 1e-50
refuse "--lr: '1e308' is out of range" "${cpu[@]}" --lr 1e308
# Given values mean what they say: --epochs 0 or --samples 0 is no data set, --epochs
# replaces --steps, an empty path is no path, a switch is true or false.
refuse "--epochs must be >= 1, got 0" --devices cpu --epochs 0 --samples 10 --batch 4
refuse "--samples must be >= 1" --devices cpu --samples 0 --steps 3
refuse "--steps excludes --epochs" --devices cpu --epochs 2 --samples 10 --batch 4 --steps 7
refuse "--lr-final is where the cosine schedule ends; add --schedule cosine" "${cpu[@]}" --lr-final 0
refuse "--resume: an empty path" "${cpu[@]}" --resume ''
refuse "--save: an empty path" "${cpu[@]}" --save ''
refuse "--nesterov: '2' is not true or false" "${cpu[@]}" --nesterov=2
refuse "--nesterov= has no value after the '='" "${cpu[@]}" --nesterov=
printf 'nesterov = 99\n' >bool.toml
refuse "nesterov takes true or false (no quotes), not 99" "${cpu[@]}" --config bool.toml
run "${cpu[@]}" --nesterov=false >/dev/null 2>&1 && ok || bad "--nesterov=false is refused"
# --ddp: --reduce has no meaning; one process over several devices says what it uses.
refuse "--reduce chooses how one process's replicas reduce" --devices cpu --steps 2 --ddp --reduce host
# The command line wins over the config file, for the device flags too.
printf 'cpus = 2\n' >cpus.toml
run --config cpus.toml --devices cpu --steps 2 >out 2>&1 && grep -q 'on cpu:0 (host)' out && ok ||
  bad "--devices on the command line does not win over the config's cpus: $(cat out)"
refuse "--devices excludes --cpus" --devices cpu --cpus 2 --steps 2
# So do flags that exclude each other (--steps in the file and --epochs given were refused
# as if both were given; the file's key is not read); both in the file are refused.
printf 'steps = 4\n' >pair.toml
run --config pair.toml --devices cpu --epochs 1 --samples 16 --batch 8 >out 2>&1 && grep -q 'batch 8, 2 steps' out &&
  ok || bad "--epochs on the command line does not win over the config's steps: $(cat out)"
printf 'shuffle = true\n' >pair.toml
run --config pair.toml --devices cpu --steps 2 --model 4-8-3 --data hx.npy --targets hy.npy --no-shuffle >out 2>&1 &&
  grep -q 'in file order' out && ok || bad "--no-shuffle does not win over the config's shuffle: $(cat out)"
printf 'steps = 4\nepochs = 1\nsamples = 16\n' >both.toml
refuse "--steps excludes --epochs (both in the config file)" --devices cpu --config both.toml
printf 'resume = "none.safetensors"\nschedule = "cosine"\nlr-final = 0\n' >over.toml
run --config over.toml "${cpu[@]}" --auto-resume --save over.safetensors --schedule constant >out 2>&1 &&
  [ -s over.safetensors ] && ok || bad "--auto-resume and --schedule do not win over the config's resume and lr-final: $(cat out)"
# A file name of 250 bytes (legal) still has temporaries.
long=$(printf 'b%.0s' $(seq 1 250))
run "${cpu[@]}" --metrics "$long" --save "$long.st" >/dev/null 2>err && [ -s "$long.st" ] && ok ||
  bad "a 250-byte file name: $(cat err)"
# Checkpoint metadata a resumed run may change is checked too; tensors no one takes are refused.
resume_bad "metadata 'data_position' must be a whole number in [0, 9223372036854775807], got '-1'" data_position -1
resume_bad "metadata 'data_position' 33 is not step 4 times batch 256" data_position 33
resume_bad "metadata 'lr' must be a number in (0, inf), got 'nan'" lr nan
resume_bad "metadata 'momentum' must be a number in [0, 1), got '5'" momentum 5
resume_bad "metadata 'beta2' must be a number in [0, 1), got '0,999'" beta2 0,999
resume_bad "metadata 'warmup' must be a whole number" warmup -1
resume_bad "metadata 'clip' must be a number in [0, inf), got '-1'" clip -1
resume_bad "metadata 'grad_accum' must be a whole number in [1, 2147483647], got '0'" grad_accum 0
resume_bad "metadata 'precision' 'fp64' is no precision" precision fp64
# A changed precision, clipping or accumulation is resumed and said in the header.
run --devices cpu --steps 8 --optimizer adamw --resume good.safetensors --precision bf16 --clip 1 --grad-accum 2 \
  >out 2>&1 && grep -q 'changed: clip 0 -> 1, grad_accum 1 -> 2, precision fp32 -> bf16' out && ok ||
  bad "a changed precision, clip and accumulation on resume: $(grep -E 'resumed|error' out)"
python3 - good.safetensors extra.safetensors <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header, body = json.loads(data[8:8 + n]), data[8 + n:]
end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
header["9.weight"] = {"dtype": "F32", "shape": [1], "data_offsets": [end, end + 4]}
header["__metadata__"]["checksum:9.weight"] = "xxh64:3aefa6fd5cf2deb4"  # of its 4 zero bytes
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(text)) + text + body + b"\0\0\0\0")
PY
refuse "has a tensor '9.weight' that this model and optimizer do not have" --devices cpu --steps 8 --optimizer adamw --resume extra.safetensors
# dpbench checks its outputs and sizes before measuring.
mkdir -p bo && rm -f bo/dpbench.csv && mkfifo bo/dpbench.csv
timeout 20 "$bench" --cpus 1 --steps 2 --warmup 1 --out bo >out 2>err
[ $? -eq 2 ] && ! grep -q '^weak' out && grep -q "is a FIFO" err && ok || bad "dpbench --out with a FIFO: $(cat err)"
timeout 20 "$bench" --cpus 3 --batch 6148914691236517206 --scaling strong --steps 2 --warmup 1 --out bench >out 2>err
[ $? -eq 2 ] && grep -q "more samples than fit in 64 bits" err && ok || bad "dpbench batch x devices: $(cat err)"
timeout 20 "$bench" --cpus 1 --steps 9223372036854775807 --warmup 1 --out bench >out 2>err
[ $? -eq 2 ] && grep -q "must be at most 1000000000" err && ok || bad "dpbench --steps huge: $(cat err)"
timeout 20 "$bench" --cpus 1 --reduce nccl --out bench >out 2>err
[ $? -eq 2 ] && grep -q "^dpbench: error: --reduce nccl" err && ok || bad "dpbench names library fields: $(cat err)"

# ---- Messages a person can read (issue 50) ---------------------------------------------
# A value echoed in an error is cut to about 200 characters with its length named, and its
# NUL and other unprintable bytes escaped; an overflow names the values that overflow.
printf 'steps = 5\0\n' >nul.toml
refuse "--config line 1: steps takes a whole number, not 5\\x00" --devices cpu --config nul.toml
python3 -c "print('model = \"' + 'x' * 900000 + '\"')" >huge.toml
refuse "(cut: 900000 bytes in all)" --devices cpu --config huge.toml
[ "$(wc -c <err)" -lt 1000 ] && ok || bad "a 900 KB config value echoed whole: $(wc -c <err) bytes"
refuse "(cut: 100004 bytes in all)" --devices "cpu:$(head -c 100000 /dev/zero | tr '\0' 9)" --steps 1
[ "$(wc -c <err)" -lt 1000 ] && ok || bad "a 100 KB device list echoed whole: $(wc -c <err) bytes"
refuse "--epochs times --samples is more samples than fit in 64 bits: 2 x 9223372036854775807" \
  --devices cpu --epochs 2 --samples 9223372036854775807
# A flag given twice and an unknown flag, in dptrain's words (the nearest flag named).
refuse "unknown flag '--stpes': did you mean --steps?" "${cpu[@]}" --stpes 5
refuse "unknown flag '--resme': did you mean --resume?" predict --resme x.safetensors
refuse "--batch is given twice on the command line; give it once" "${cpu[@]}" --batch 4 --batch 8
# --task that agrees with the data's targets is accepted; one that contradicts them is
# refused, with the hint that class labels are integers.
npy_of() {  # npy_of PATH DESCR SHAPE BYTES: a .npy file of zeros
  python3 -c "import sys; p, d, s, n = sys.argv[1:]; h = \"{'descr': '%s', 'fortran_order': False, 'shape': %s, }\" % (d, s)
h += ' ' * (63 - (10 + len(h)) % 64) + '\n'
open(p, 'wb').write(b'\x93NUMPY\x01\x00' + len(h).to_bytes(2, 'little') + h.encode() + bytes(int(n)))" "$@"
}
npy_of tx.npy '<f4' '(20, 4)' 320
npy_of tlabels.npy '<i8' '(20,)' 160
npy_of tfloat.npy '<f4' '(20,)' 80
run --devices cpu --model 4-8-3 --data tx.npy --targets tlabels.npy --task classification --steps 2 >out 2>&1 &&
  grep -q '^  classification' out && ok || bad "--task classification with integer labels: $(tail -1 out)"
refuse "--task: the task of --data follows from its targets: float rows (regression), not --task classification; class labels are integers" \
  --devices cpu --model 4-8-1 --data tx.npy --targets tfloat.npy --task classification --steps 2
refuse "the model gives [3] (class labels are integers: an integer .npy, int32 or int64, trains a classifier)" \
  --devices cpu --model 4-8-3 --data tx.npy --targets tfloat.npy --steps 2
# --eval-every 0 is documented (validation at each epoch's end).
"$exe" --help | grep -q -- '--eval-every INT .*0, the default: at the end of each epoch' && ok ||
  bad "--eval-every 0 is not documented in --help"

finish
