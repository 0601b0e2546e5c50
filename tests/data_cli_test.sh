#!/usr/bin/env bash
# dptrain on the user's own data, as README's worked example does it: arrays written with
# NumPy, a classifier trained with validation, predictions on new rows read back; then
# hostile data files, each one line on stderr and exit status 2 at once. Needs numpy
# (skipped, exit 77, without it).
# Usage: data_cli_test.sh DPTRAIN
# shellcheck disable=SC2015  # `check && ok || bad`: ok never fails
set -u
exe=$1
python3 -c 'import numpy' 2>/dev/null || { echo "no numpy here: the file-data CLI test is skipped"; exit 77; }
# shellcheck source=cli_lib.sh
source "$(cd "$(dirname "$0")" && pwd)/cli_lib.sh"
make_tmp
cd "$tmp" || exit 1
run() { timeout 120 "$exe" "$@"; }

# ---- README's worked example ----------------------------------------------------------
python3 - <<'PY'
import numpy as np
rng = np.random.default_rng(0)
x = rng.standard_normal((6000, 20)).astype(np.float32)
w = rng.standard_normal((20, 3))
np.save("x.npy", x)
np.save("y.npy", (x @ w).argmax(1))            # int64 class labels 0..2
np.save("new.npy", rng.standard_normal((500, 20)).astype(np.float32))
PY
run --devices cpu --data x.npy --targets y.npy --model 20-64-3 --epochs 5 --batch 128 --val-fraction 0.1 \
  --save model.safetensors --metrics run.jsonl --plot run.svg >train.out 2>train.err || bad "training failed: $(cat train.err)"
grep -q "data: data file 'x.npy': x, 5400 rows, shuffled every epoch; validation: 600 rows" train.out && ok ||
  bad "the header does not describe the data: $(head -4 train.out)"
grep -q '^validation: loss [0-9.]*, accuracy [0-9.]*% over 600 rows' train.out && ok ||
  bad "no validation summary: $(tail -8 train.out)"
python3 - run.jsonl <<'PY' && ok || bad "val_loss / val_accuracy in --metrics: $(tail -2 run.jsonl)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
val = [r for r in rows if "val_loss" in r]
assert [r["step"] for r in val] == [43, 85, 127, 169, 211], [r["step"] for r in val]  # at each epoch's end
assert val[-1]["val_accuracy"] > 0.9 and val[-1]["val_loss"] < val[0]["val_loss"], val
PY
grep -q 'validation loss' run.svg && ok || bad "--plot has no validation curve"
run eval --resume model.safetensors --data x.npy --targets y.npy --devices cpu >eval.out 2>&1 &&
  grep -q '^eval: 20-64-3 on data file .x.npy.: x: loss [0-9.]*, accuracy [0-9.]*% over 6000 rows' eval.out && ok ||
  bad "eval: $(cat eval.out)"
run predict --resume model.safetensors --data new.npy --out pred.npy --probabilities prob.npy --cpus 3 >pred.out 2>&1 ||
  bad "predict: $(cat pred.out)"
python3 - <<'PY' && ok || bad "the predictions are not what the model says"
import numpy as np
pred, prob = np.load("pred.npy"), np.load("prob.npy")
assert pred.shape == (500,) and pred.dtype == np.int32 and prob.shape == (500, 3), (pred.shape, prob.shape)
assert np.allclose(prob.sum(1), 1, atol=1e-5) and (prob.argmax(1) == pred).all()
PY
# A resumed run goes on from the checkpoint on the same file; another file is refused.
run --devices cpu --data x.npy --targets y.npy --model 20-64-3 --epochs 6 --batch 128 --val-fraction 0.1 \
  --resume model.safetensors --save model.safetensors >out 2>&1 && grep -q "resumed from 'model.safetensors' at step 211" out &&
  ok || bad "resume on file data: $(cat out)"
python3 -c 'import numpy as np; np.save("x2.npy", np.load("x.npy")[:5999]); np.save("y2.npy", np.load("y.npy")[:5999])'
refuse "was made on other data" --devices cpu --data x2.npy --targets y2.npy --model 20-64-3 --epochs 7 --batch 128 \
  --val-fraction 0.1 --resume model.safetensors

# ---- Hostile data files and flags --------------------------------------------------------
python3 - <<'PY'
import numpy as np
x = np.load("x.npy")
open("truncated.npy", "wb").write(open("x.npy", "rb").read()[:5000])
np.save("complex.npy", x.astype(np.complex64))
np.save("bigendian.npy", x.astype(">f4"))
np.save("fortran.npy", np.asfortranarray(x))
y = np.load("y.npy").copy(); y[17] = 3
np.save("labels_out.npy", y)
y = np.load("y.npy").copy(); y[4] = -1
np.save("labels_neg.npy", y)
xn = x.copy(); xn[9, 2] = np.nan
np.save("nan.npy", xn)
np.save("short.npy", np.load("y.npy")[:100])
np.save("floaty.npy", x[:, :3])
raw = bytearray(open("x.npy", "rb").read())
at = raw.index(b"(6000, 20)")
raw[at:at + 10] = b"(9000, 20)"
open("shape_big.npy", "wb").write(bytes(raw))
PY
mkfifo fifo.npy
m=(--devices cpu --model 20-64-3 --epochs 1 --batch 128)
refuse "data file 'truncated.npy'" "${m[@]}" --data truncated.npy --targets y.npy
refuse "data file 'complex.npy'" "${m[@]}" --data complex.npy --targets y.npy
refuse "big-endian" "${m[@]}" --data bigendian.npy --targets y.npy
refuse "ortran" "${m[@]}" --data fortran.npy --targets y.npy
refuse "data file 'shape_big.npy'" "${m[@]}" --data shape_big.npy --targets y.npy
refuse "y[17] is 3, outside [0, 3)" "${m[@]}" --data x.npy --targets labels_out.npy
refuse "labels_neg.npy" "${m[@]}" --data x.npy --targets labels_neg.npy
refuse "x[9, 2] is nan" --devices cpu --model 20-64-3 --steps 500 --batch 128 --no-shuffle --data nan.npy --targets y.npy
refuse "short.npy" "${m[@]}" --data x.npy --targets short.npy
run "${m[@]}" --data x.npy --targets y.npy --val-data x.npy --val-targets y.npy >/dev/null 2>err
[ "$(cat err)" = "dptrain: warning: --val-data 'x.npy' is in --data too: the validation loss is measured on rows the model trains on" ] &&
  ok || bad "--val-data naming the training file: '$(cat err)'"
# A validation row is read whole at every evaluation: a non-finite one is refused before the
# first step (it ended the run at its first evaluation, after an epoch of steps). A
# training row is checked as it is first gathered: met mid-run, the steps before it are saved.
python3 -c 'import numpy as np; x = np.load("x.npy"); x[5990, 2] = np.inf; np.save("val_inf.npy", x); x[5990, 2] = 0; x[1000, 4] = np.nan; np.save("mid_nan.npy", x)'
refuse "x[5990, 2] is inf" "${m[@]}" --data val_inf.npy --targets y.npy --val-fraction 0.1
grep -q '^step' out && bad "a non-finite validation row was found after training began" || ok
refuse "x[1000, 4] is nan (non-finite inputs are refused); the run stopped at step 8, and 'mid.safetensors' holds step 7" \
  "${m[@]}" --data mid_nan.npy --targets y.npy --no-shuffle --save mid.safetensors
# The saved step is the step before, batch norm's running statistics included: on two
# replicas, or in two micro-batches, the master's forward had moved them before the other
# half's row failed. The data mended (a .npy is known by its header), the run resumes to
# where a straight run ends.
python3 - <<'PY'
import numpy as np
r = np.random.default_rng(1)
x = r.standard_normal((64, 3, 8, 8)).astype(np.float32)
np.save("img.npy", x); np.save("img_y.npy", r.integers(0, 3, 64))
x[38, 1, 2, 3] = np.nan  # step 5 of 8 at batch 8, the second half of its rows
np.save("img_nan.npy", x)
PY
cnn=(--model cnn:3x8x8-c4k3-bn-p2-f3 --batch 8 --steps 8 --log-every 8 --no-shuffle --targets img_y.npy)
splits=("--cpus 2" "--devices cpu --grad-accum 2")
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
  splits+=("--devices cuda:0,cuda:0 --reduce p2p" "--devices cuda:0 --grad-accum 2")
for split in "${splits[@]}"; do
  # shellcheck disable=SC2086  # the words of each setting are separate arguments
  run "${cnn[@]}" $split --data img_nan.npy --save bn.safetensors >/dev/null 2>err
  grep -q "the run stopped at step 5, and 'bn.safetensors' holds step 4$" err && ok || bad "a bad image mid-run ($split): $(cat err)"
  # shellcheck disable=SC2086
  run "${cnn[@]}" $split --data img.npy --resume bn.safetensors >resumed 2>&1
  # shellcheck disable=SC2086
  run "${cnn[@]}" $split --data img.npy >straight 2>&1
  [ -n "$(hash_of straight)" ] && [ "$(hash_of resumed)" = "$(hash_of straight)" ] && ok ||
    bad "resumed after a bad image ($split): $(hash_of resumed) against $(hash_of straight): $(tail -2 resumed)"
done
refuse "the model takes [21]" --devices cpu --model 21-64-3 --epochs 1 --data x.npy --targets y.npy
refuse "not a regular file" "${m[@]}" --data fifo.npy --targets y.npy
refuse "not a regular file" "${m[@]}" --data x.npy --targets /dev/zero
refuse "is neither a .npy nor a .safetensors file" "${m[@]}" --data x.csv --targets y.npy
refuse "--targets is needed with a .npy data file" "${m[@]}" --data x.npy
refuse "--data is needed by --targets" --devices cpu --targets y.npy
refuse "--task: the task of --data follows from its targets" "${m[@]}" --data x.npy --targets y.npy --task regression
refuse "--samples is the data file's own size" "${m[@]}" --data x.npy --targets y.npy --samples 10
refuse "--shuffle and --no-shuffle order the rows of --data" --devices cpu --steps 2 --no-shuffle
# A switch set to false in a config file is off (shuffle = false shuffled all the same).
printf 'shuffle = false\n' >noshuffle.toml
"$exe" "${m[@]}" --data x.npy --targets y.npy --config noshuffle.toml >out 2>&1
grep -q "rows, in file order" out && ok || bad "shuffle = false in a config file: $(grep data: out)"
refuse "--val-fraction must be in [0, 1), got 1" "${m[@]}" --data x.npy --targets y.npy --val-fraction 1
refuse "--eval-every needs validation rows" "${m[@]}" --data x.npy --targets y.npy --eval-every 5
refuse "--metrics and --data name the same file" "${m[@]}" --data x.npy --targets y.npy --metrics x.npy
refuse "--out 'new.npy' is an input of this run" predict --resume model.safetensors --data new.npy --out new.npy
refuse "dptrain: error: --batch must be >= 1, got 0" predict --resume model.safetensors --data new.npy --out p.npy --batch 0
# predict replaces an earlier array and nothing else (a checkpoint named as --out was
# replaced silently), unless --overwrite; its outputs are .npy files by name too.
cp model.safetensors kept.safetensors && echo notes >notes.npy
refuse "dptrain: error: --out 'kept.safetensors': predict writes a .npy array, and the name must say so (.npy)" \
  predict --resume model.safetensors --data new.npy --out kept.safetensors
refuse "dptrain: error: --probabilities 'notes.npy' is not a .npy array (or cannot be read), which predict would replace (name another file, or give --overwrite)" \
  predict --resume model.safetensors --data new.npy --out p.npy --probabilities notes.npy
cmp -s model.safetensors kept.safetensors && [ "$(cat notes.npy)" = notes ] && [ ! -e p.npy ] && ok ||
  bad "a refused predict wrote a file"
run predict --resume model.safetensors --data new.npy --out notes.npy --overwrite >/dev/null &&
  python3 -c 'import numpy as np; assert np.load("notes.npy").shape == (500,)' && ok || bad "predict --overwrite"
# A hard link is the same file: --metrics appends in place, which would overwrite the data.
ln -f x.npy x-link.jsonl
refuse "--metrics and --data name the same file" "${m[@]}" --data x.npy --targets y.npy --metrics x-link.jsonl
ln -f new.npy new-link.npy
refuse "--out 'new-link.npy' is an input of this run" predict --resume model.safetensors --data new.npy --out new-link.npy
run --devices cpu --data x.npy --targets floaty.npy --model 20-16-3 --epochs 1 --save reg.safetensors >/dev/null 2>&1
refuse "--probabilities: the model of 'reg.safetensors' does regression" predict --resume reg.safetensors --data new.npy \
  --out p.npy --probabilities q.npy --devices cpu
refuse "holds class labels (integers), but the task is regression" eval --resume reg.safetensors \
  --data x.npy --targets y.npy --devices cpu
refuse "--steps is a training flag" --steps 3 predict --resume model.safetensors --data new.npy --out p.npy
# Outputs that overflow (inputs of 3e38) are no prediction: exit 4, nothing written
# (eval printed "loss -nan" and predict wrote class 0 with NaN probabilities, both exit 0).
python3 -c "import numpy as np; np.save('huge.npy', np.full((10, 20), 3e38, np.float32)); np.save('hy.npy', np.zeros(10, np.int64))"
timeout 60 "$exe" eval --resume model.safetensors --data huge.npy --targets hy.npy --devices cpu >out 2>err
[ $? -eq 4 ] && grep -q "^dptrain: error: eval: the loss over 10 rows of .* is not finite" err && ok || bad "eval of overflowing outputs: $(cat err)"
timeout 60 "$exe" predict --resume model.safetensors --data huge.npy --out huge-pred.npy --devices cpu >out 2>err
[ $? -eq 4 ] && grep -q "output for row 0 of .* is not finite" err && [ ! -e huge-pred.npy ] && ok ||
  bad "predict of overflowing outputs: $(cat err)"

finish
