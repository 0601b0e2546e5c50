#!/usr/bin/env bash
# dpbench on virtual CPU devices: a small weak- and strong-scaling run whose table, CSV,
# JSON and SVG are checked, then bad input, which must give exactly one line on stderr
# and exit status 2 before any run.
# shellcheck disable=SC2015  # `check && ok || bad`: ok never fails
set -u
exe=$1
# shellcheck source=cli_lib.sh
source "$(cd "$(dirname "$0")" && pwd)/cli_lib.sh"
make_tmp

small=(--model 16-32-4 --batch 8 --steps 3 --warmup 1)
if "$exe" --cpus 3 "${small[@]}" --out "$tmp/out" >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --cpus 3 failed: $(cat "$tmp/stderr")"; fi
[ -s "$tmp/stderr" ] && bad "a good run wrote on stderr: $(cat "$tmp/stderr")"
grep -q '^scaling *reduce *prec *dev' "$tmp/stdout" && ok || bad "no table header: $(cat "$tmp/stdout")"
[ "$(grep -cE '^(weak|strong) +host +fp32 +[123] ' "$tmp/stdout")" -eq 6 ] && ok ||
  bad "expected 6 table rows: $(cat "$tmp/stdout")"

python3 - "$tmp/out" <<'PY' && ok || bad "dpbench.csv, dpbench.json or speedup.svg is not what was asked for"
import csv, json, math, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
rows = list(csv.DictReader(open(f"{out}/dpbench.csv")))
got = sorted((r["scaling"], int(r["devices"]), int(r["global_batch"])) for r in rows)
assert got == sorted([("weak", 1, 8), ("weak", 2, 16), ("weak", 3, 24),
                      ("strong", 1, 24), ("strong", 2, 24), ("strong", 3, 24)]), got
for r in rows:
    n = int(r["devices"])
    assert r["reduce"] == "host" and r["precision"] == "fp32", r
    assert r["device_list"] == ";".join(f"cpu:{i}" for i in range(n)), r
    assert len(r["peak_mib"].split(";")) == n, r  # one figure per distinct device
    step = float(r["step_ms"])
    assert step > 0 and math.isclose(float(r["samples_per_s"]), 1e3 * int(r["global_batch"]) / step, rel_tol=1e-4), r
    assert math.isclose(float(r["efficiency"]), float(r["speedup"]) / n, rel_tol=1e-4), r
    if n == 1:
        assert float(r["speedup"]) == 1.0, r
    parts = [float(r[k]) for k in ("compute_ms", "reduce_ms", "update_ms", "idle_ms")]
    assert min(parts) >= 0, r
    assert float(r["loss_last"]) < float(r["loss_first"]), r  # it trains
# Strong scaling runs one batch on any number of devices: the same losses (N == 1).
strong = [r for r in rows if r["scaling"] == "strong"]
for r in strong:
    assert math.isclose(float(r["loss_first"]), float(strong[0]["loss_first"]), rel_tol=1e-5), strong
    assert math.isclose(float(r["loss_last"]), float(strong[0]["loss_last"]), rel_tol=1e-4), strong
doc = json.load(open(f"{out}/dpbench.json"))
assert doc["model"] == "16-32-4" and doc["devices"] == ["cpu:0", "cpu:1", "cpu:2"], doc
assert len(doc["runs"]) == 6 and all(len(r["peak_bytes"]) == r["devices"] for r in doc["runs"]), doc
svg = ET.parse(f"{out}/speedup.svg").getroot()
ns = "{http://www.w3.org/2000/svg}"
assert svg.tag == f"{ns}svg", svg.tag
assert len(svg.findall(f".//{ns}polyline")) == 3  # ideal, weak, strong
texts = {t.text for t in svg.iter(f"{ns}text")}
assert {"ideal", "weak, host, fp32", "strong, host, fp32", "devices"} <= texts, texts
PY

# Logical replicas on one device share its allocator (one memory figure); repeated
# list entries and `auto` meaning `host` make one series, not two.
if "$exe" --devices cpu:0,cpu:0 "${small[@]}" --precision fp32,fp32 --reduce auto,host --scaling strong \
  --out "$tmp/shared" >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --devices cpu:0,cpu:0 failed: $(cat "$tmp/stderr")"; fi
python3 - "$tmp/shared/dpbench.csv" <<'PY' && ok || bad "shared-device CSV: $(cat "$tmp/shared/dpbench.csv")"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [(r["scaling"], r["reduce"], r["devices"]) for r in rows] == [("strong", "host", "1"), ("strong", "host", "2")]
assert rows[1]["device_list"] == "cpu:0;cpu:0" and rows[1]["peak_mib"].count("=") == 1, rows
PY

"$exe" --version | grep -q '^dpbench [0-9]' && ok || bad "--version"
"$exe" --help | grep -q -- '--scaling' && ok || bad "--help"

# A CNN workload: both strong-scaling runs see the same images and labels, so their
# first losses agree.
if "$exe" --cpus 2 --model cnn-small --batch 4 --steps 2 --warmup 1 --scaling strong --out "$tmp/cnn" \
  >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --model cnn-small failed: $(cat "$tmp/stderr")"; fi
python3 - "$tmp/cnn/dpbench.csv" <<'PY' && ok || bad "CNN CSV: $(cat "$tmp/cnn/dpbench.csv")"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [r["devices"] for r in rows] == ["1", "2"], rows
assert abs(float(rows[0]["loss_first"]) - float(rows[1]["loss_first"])) < 1e-4 * abs(float(rows[0]["loss_first"])), rows
PY

# AdamW with ZeRO stage 1: each device's optimizer state is its share (2 moments of its
# shard of the 768-float flat buffer: 6 KiB on 1 device, 3 KiB on 2), in the CSV and JSON.
if "$exe" --cpus 2 --model 16-32-4 --batch 8 --steps 2 --warmup 1 --scaling weak --optimizer adamw --zero 1 \
  --out "$tmp/zero" >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --optimizer adamw --zero 1 failed: $(cat "$tmp/stderr")"; fi
grep -q 'AdamW lr 0.001' "$tmp/stdout" && grep -q 'ZeRO stage 1' "$tmp/stdout" && ok || bad "no AdamW/ZeRO header"
python3 - "$tmp/zero" <<'PY' && ok || bad "ZeRO CSV/JSON: $(cat "$tmp/zero/dpbench.csv")"
import csv, json, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/dpbench.csv")))
assert [r["state_mib"] for r in rows] == ["cpu:0=0.006", "cpu:0=0.003;cpu:1=0.003"], rows
j = json.load(open(f"{sys.argv[1]}/dpbench.json"))
assert j["optimizer"] == {"name": "adamw", "lr": 0.001, "zero": 1}, j["optimizer"]
assert [r["optimizer_state_bytes"] for r in j["runs"]] == [[6144], [3072, 3072]], j["runs"]
PY

# bf16 gradients on the wire: said in the header and the JSON.
if "$exe" --cpus 2 --model 16-32-4 --batch 8 --steps 2 --warmup 1 --scaling weak --grad-comm bf16 \
  --out "$tmp/gc" >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --grad-comm bf16 failed: $(cat "$tmp/stderr")"; fi
grep -q 'gradients travel in bf16' "$tmp/stdout" && ok || bad "no bf16 wire in the header: $(head -3 "$tmp/stdout")"
python3 -c 'import json, sys; assert json.load(open(sys.argv[1]))["grad_comm"] == "bf16"' "$tmp/gc/dpbench.json" && ok ||
  bad "grad_comm not in the JSON"

# --no-overlap: the reduction after backward, said in the header and the JSON.
if "$exe" --cpus 2 --model 16-32-4 --batch 8 --steps 2 --warmup 1 --scaling weak --no-overlap \
  --out "$tmp/noov" >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --no-overlap failed: $(cat "$tmp/stderr")"; fi
grep -q 'reduced only after backward (no overlap)' "$tmp/stdout" && ok || bad "no overlap in the header: $(head -3 "$tmp/stdout")"
python3 -c 'import json, sys; assert json.load(open(sys.argv[1]))["overlap"] is False' "$tmp/noov/dpbench.json" && ok ||
  bad "overlap not in the JSON"
python3 -c 'import json, sys; assert json.load(open(sys.argv[1]))["overlap"] is True' "$tmp/gc/dpbench.json" && ok ||
  bad "the default overlap not in the JSON"

# --comm: the reduction alone, with nccl-tests' bandwidths (busbw = algbw x 2(n-1)/n for an
# all-reduce: x 1 on 2 devices, x 1.5 on 4), each path's rows for 2 and 4 devices.
if "$exe" --cpus 4 --comm --model 64-128-8 --steps 3 --reduce host,p2p --out "$tmp/comm" >"$tmp/stdout" 2>"$tmp/stderr"
then ok
else bad "dpbench --comm failed: $(cat "$tmp/stderr")"; fi
python3 - "$tmp/comm/comm.csv" <<'PY' && ok || bad "comm.csv: $(cat "$tmp/comm/comm.csv")"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
got = [(r["op"], r["path"], r["devices"]) for r in rows]
assert got == [("all-reduce", "host", "2"), ("all-reduce", "p2p", "2"), ("params to all", "p2p", "2"),
               ("all-reduce", "host", "4"), ("all-reduce", "p2p", "4"), ("params to all", "p2p", "4")], got
for r in rows:
    assert r["bytes"] == str(9352 * 4), r  # 64-128-8: 9352 parameters
    ms, alg, bus = float(r["ms"]), float(r["algbw_gbs"]), float(r["busbw_gbs"])
    assert ms > 0 and abs(alg - 9352 * 4 / (ms * 1e-3) / 1e9) <= 1e-3 * alg, r
    want = 1.0 if r["op"] == "params to all" else 2 * (int(r["devices"]) - 1) / int(r["devices"])
    assert abs(bus - alg * want) <= 1e-3 * bus, r
PY
# Stage 2: each device's gradients are its shard and two buckets (768 floats, buckets of
# 196 and 512 floats at --bucket-mb 0.001: 4 x (768/n + 2 x 512) bytes), in the CSV and JSON.
if "$exe" --cpus 2 --model 16-32-4 --batch 8 --steps 2 --warmup 1 --scaling weak --optimizer adamw --zero 2 \
  --bucket-mb 0.001 --out "$tmp/zero2" >"$tmp/stdout" 2>"$tmp/stderr" &&
  grep -q 'ZeRO stage 2: the optimizer state and the gradients sharded' "$tmp/stdout"; then ok
else bad "dpbench --zero 2 failed: $(cat "$tmp/stdout" "$tmp/stderr")"; fi
python3 - "$tmp/zero2" <<'PY' && ok || bad "ZeRO stage 2 CSV/JSON: $(cat "$tmp/zero2/dpbench.csv")"
import csv, json, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/dpbench.csv")))
assert [r["grads_mib"] for r in rows] == ["cpu:0=0.007", "cpu:0=0.005;cpu:1=0.005"], rows
j = json.load(open(f"{sys.argv[1]}/dpbench.json"))
assert [r["gradient_bytes"] for r in j["runs"]] == [[7168], [5632, 5632]], j["runs"]
assert [r["optimizer_state_bytes"] for r in j["runs"]] == [[6144], [3072, 3072]], j["runs"]
PY
if "$exe" --cpus 3 --comm --zero 1 --model 64-128-8 --steps 2 --out "$tmp/comm0" >"$tmp/stdout" 2>"$tmp/stderr" &&
  grep -q '^reduce (ZeRO)' "$tmp/stdout" && grep -q '^gather (ZeRO)' "$tmp/stdout"; then ok
else bad "dpbench --comm --zero 1: $(cat "$tmp/stdout" "$tmp/stderr")"; fi

# A GPT: random tokens, bf16 and AdamW (lr 6e-4) by default; the table's rate in tokens/s and
# its MFU; the CSV and JSON with tokens/s (samples/s x T) and MFU (6N + 6LCT flops a token,
# N = 110336 parameters less the 32 x 64 position embedding, against 0.001 TFLOPS a device);
# strong scaling's two runs see the same tokens, so their first losses agree.
if "$exe" --cpus 2 --model gpt:L2-H2-C64-T32-V128 --batch 2 --seq 16 --steps 2 --warmup 1 --peak-tflops 0.001 \
  --out "$tmp/gpt" >"$tmp/stdout" 2>"$tmp/stderr"; then ok
else bad "dpbench --model gpt:... failed: $(cat "$tmp/stderr")"; fi
grep -qE '^scaling +reduce +prec +dev +batch +ms/step +tokens/s .* +MFU$' "$tmp/stdout" && ok ||
  bad "no GPT table header: $(cat "$tmp/stdout")"
[ "$(grep -cE '^(weak|strong) +host +bf16 +[12] .*%$' "$tmp/stdout")" -eq 4 ] && ok ||
  bad "expected 4 GPT table rows: $(cat "$tmp/stdout")"
python3 - "$tmp/gpt" <<'PY' && ok || bad "GPT CSV/JSON: $(cat "$tmp/gpt/dpbench.csv")"
import csv, json, math, sys
rows = list(csv.DictReader(open(f"{sys.argv[1]}/dpbench.csv")))
assert [(r["scaling"], r["devices"], r["precision"]) for r in rows] == [
    ("weak", "1", "bf16"), ("weak", "2", "bf16"), ("strong", "1", "bf16"), ("strong", "2", "bf16")], rows
flops = 6 * (110336 - 32 * 64) + 6 * 2 * 64 * 16
for r in rows:
    tokens = float(r["tokens_per_s"])
    assert math.isclose(tokens, 16 * float(r["samples_per_s"]), rel_tol=1e-4), r
    assert math.isclose(float(r["mfu"]), flops * tokens / (1e9 * int(r["devices"])), rel_tol=1e-4), r
    assert 4.0 < float(r["loss_first"]) < 5.5, r  # ln 128 = 4.85
strong = [r for r in rows if r["scaling"] == "strong"]
assert abs(float(strong[0]["loss_first"]) - float(strong[1]["loss_first"])) < 1e-3, strong
j = json.load(open(f"{sys.argv[1]}/dpbench.json"))
assert j["loss"] == "next_token_cross_entropy" and j["seq"] == 16 and j["peak_tflops"] == 0.001, j
assert j["optimizer"] == {"name": "adamw", "lr": 0.0006, "zero": 0}, j["optimizer"]
assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in j["runs"]), j["runs"]
PY

# bad input: exit 2, one line on stderr, nothing written
refuse() {
  "$exe" "$@" --out "$tmp/refused" >"$tmp/stdout" 2>"$tmp/stderr"
  local rc=$? lines
  lines=$(wc -l <"$tmp/stderr")
  if [ "$rc" -ne 2 ]; then bad "dpbench $* exited $rc, not 2: $(cat "$tmp/stderr")"
  elif [ "$lines" -ne 1 ]; then bad "dpbench $* wrote $lines lines on stderr: $(cat "$tmp/stderr")"
  elif ! grep -q '^dpbench: error: ' "$tmp/stderr"; then bad "dpbench $*: not an error line: $(cat "$tmp/stderr")"
  elif [ -e "$tmp/refused/dpbench.csv" ]; then bad "dpbench $* wrote results"
  else ok; fi

}
refuse --cpus 0
refuse --cpus -1
refuse --cpus 2 --gpus 1
refuse --devices cpu:0 --cpus 2
refuse --devices cpu:0,
refuse --scaling sideways
refuse --precision fp8
refuse --precision fp32,fp8
refuse --cpus 2 --precision , --steps 1
refuse --cpus 2 --precision ''
refuse --cpus 2 --precision fp32,,bf16
refuse --cpus 2 --reduce host,
refuse --cpus 2 --scaling ,weak
refuse --reduce allgather
refuse --cpus 2 --reduce nccl
refuse --cpus 2 --batch 0
refuse --cpus 2 --steps 0
refuse --cpus 2 --warmup 0
refuse --cpus 2 --bucket-mb 0
refuse --cpus 2 --first-bucket-mb 0
refuse --cpus 2 --comm-ctas 65
refuse --cpus 2 --comm-ctas 8
refuse --cpus 2 --update-per-bucket --zero 1
refuse --model 10-
refuse --model cnn:3x4x4-c8k5p0-f2
refuse --model cnn:3x8x8-f1
refuse --bogus
refuse --cpus 1 --cuda-graph
refuse --cpus 2 --optimizer lamb
refuse --cpus 2 --zero 3
refuse --cpus 2 --comm --zero 2
refuse --cpus 2 --comm --no-overlap
refuse --cpus 2 --grad-comm fp16
refuse --cpus 1 --comm
refuse --cpus 2 --model 16-32-4 --seq 8
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --seq 33
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --peak-tflops 0
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --peak-tflops 1e-50
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --peak-tflops inf
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --peak-tflops nan
refuse --cpus 2 --model 16-32-4 --peak-tflops 989
refuse --cpus 2 --model 16-32-4 --attention-backward fast
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --attention-backward slow
refuse --cpus 2 --model gpt:L2-H2-C64-T32-V128 --comm --attention-backward fast
refuse --cpus 2 --bucket-mb ''
refuse --cpus 2 --bucket-mb 0x10
touch "$tmp/file"
refuse --cpus 2 --model 16-32-4 --out "$tmp/file/sub"

finish dpbench
