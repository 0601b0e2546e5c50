#!/usr/bin/env python3
"""gpt_scaling.sh's table: from the runs in OUT (dpbench's dpbench_*/dpbench.json, the logs
of `mpirun -np N dptrain --ddp` named ddp_<label>_np<N>.log, and torch.log's lines of
torch_gpt_bench.py), one row a mode and device count: ms/step, tokens/s, tokens/s a
device, weak-scaling efficiency (tokens/s a device against the same mode's on one device;
PyTorch's one-GPU run is its plain step, without DDP, as dpbench's one device reduces
nothing), the reduction's time after backward (exposed; the master's, or rank 0's last
logged step), and the peak memory allocated (the most of any device where every device's
is known, else rank 0's). Then what overlapping the reduction with backward gains, and the
issue's targets for ZeRO-1 with bf16 gradients (>= 98% at 2 devices, >= 95% at 8). Writes
the rows to OUT/gpt_scaling.csv too.

Usage: gpt_scaling_table.py OUT --batch B --seq T"""
import argparse
import csv
import glob
import json
import os
import re

TARGETS = {2: 0.98, 8: 0.95}
UNIT = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20}  # to MiB
STEP = re.compile(r"^step (\d+)/\d+ .* step_ms ([\d.]+)")
MEMORY = re.compile(r"^memory \S+: peak ([\d.]+) (\S+) allocated")
PHASES = re.compile(r"^step time .* reduce ([\d.]+) ms")
TORCH_ONE = re.compile(r"^torch \S+ B \d+ T \d+ (eager|compile): ([\d.]+) ms/step, ([\d,]+) tokens/s, "
                       r".*peak ([\d.]+) MiB")
TORCH_DDP = re.compile(r"^torch \S+ B \d+ T \d+ ddp:(\d+) (eager|compile) grad-comm (\w+): ([\d.]+) ms/step, "
                       r"([\d,]+) tokens/s, .*per-GPU MiB ([\d. ]+)$")


def row(mode, n, ms, tokens, reduce_ms=None, peak=None, efficiency=None, zero1_bf16=False):
    return dict(mode=mode, n=n, ms=ms, tokens=tokens, reduce_ms=reduce_ms, peak=peak, efficiency=efficiency,
                zero1_bf16=zero1_bf16)


DPBENCH_ROW = re.compile(r"^weak\s+\S+\s+\S+\s+(\d+)\s+\d+\s+([\d.]+)\s+\S+\s+\S+\s+(\d+)%\s+\S+\s+([\d.]+)"
                         r"\s+\S+\s+\S+\s+([\d.]+)\s+([\d.]+|-)")


def dpbench_mode(zero, wire, overlap):
    return f"dptrain 1 process, ZeRO-{zero}, {wire} grads" + ("" if overlap else ", no overlap")


def dpbench_log_rows(path, batch, seq):
    """A series whose JSON was never written (killed, or failed at a larger count): its log's
    rows (dpbench prints and flushes each count's as it ends), named from the log's file name
    (dpbench_zero<Z>_<wire>[_noovl].log); none, one failed row."""
    m = re.fullmatch(r"dpbench_zero(\d)_(\w+?)(_noovl)?\.log", os.path.basename(path))
    if not m:
        return []
    zero, wire, overlap = int(m.group(1)), m.group(2), not m.group(3)
    mode, rows = dpbench_mode(zero, wire, overlap), []
    for line in open(path, errors="replace"):
        if r := DPBENCH_ROW.match(line):
            n, ms, eff, reduce_ms, master, others = r.groups()
            peak = max(float(master), float(others) if others != "-" else 0.0)
            rows.append(row(mode, int(n), float(ms), batch * int(n) * seq * 1e3 / float(ms), float(reduce_ms), peak,
                            int(eff) / 100, zero == 1 and wire == "bf16" and overlap))
    return rows or [row(mode, 0, None, None)]


def dpbench_rows(out, batch, seq):
    rows, docs = [], []
    for log in sorted(glob.glob(os.path.join(out, "dpbench_*.log"))):
        doc = os.path.join(log[:-len(".log")], "dpbench.json")
        if os.path.exists(doc):
            docs.append(json.load(open(doc)))
        else:
            rows += dpbench_log_rows(log, batch, seq)
    # ZeRO-1 overlapped first (the issue's figure), then without overlap, then the others.
    docs.sort(key=lambda d: (d["optimizer"]["zero"] != 1, not d.get("overlap", True), d["optimizer"]["zero"],
                             d["grad_comm"]))
    for doc in docs:
        zero, wire, overlap = doc["optimizer"]["zero"], doc["grad_comm"], doc.get("overlap", True)
        for r in doc["runs"]:
            rows.append(row(dpbench_mode(zero, wire, overlap), r["devices"], r["step_ms"], r["tokens_per_s"],
                            r["reduce_ms"], max(r["peak_bytes"].values()) / 2**20, r["efficiency"],
                            zero == 1 and wire == "bf16" and overlap))
    return rows


def ddp_rows(out, batch, seq):
    """The ddp logs: ms/step the mean of the logged steps after the 10th (warm-up)."""
    rows, base = [], {}
    logs = []
    for path in glob.glob(os.path.join(out, "ddp_*_np*.log")):
        m = re.fullmatch(r"ddp_(.+)_np(\d+)\.log", os.path.basename(path))
        if m:
            logs.append((m.group(1), int(m.group(2)), path))
    for label, n, path in sorted(logs, key=lambda x: (x[0], x[1])):
        zero, wire, *rest = label.split("_")
        mode = f"dptrain mpirun --ddp, ZeRO-{zero[len('zero'):]}, {wire} grads" + (", no overlap" if rest else "")
        steps, peak, reduce_ms = [], None, None
        for line in open(path, errors="replace"):
            if m := STEP.match(line):
                if int(m.group(1)) > 10:
                    steps.append(float(m.group(2)))
            elif m := MEMORY.match(line):
                peak = float(m.group(1)) * UNIT.get(m.group(2), float("nan"))
            elif m := PHASES.match(line):
                reduce_ms = float(m.group(1))
        if not steps:
            rows.append(row(mode, n, None, None))
            continue
        ms = sum(steps) / len(steps)
        r = row(mode, n, ms, batch * n * seq * 1e3 / ms, reduce_ms, peak,
                zero1_bf16=zero == "zero1" and wire == "bf16" and not rest)
        if n == 1:
            base[label] = r["tokens"]
        # --no-overlap on one rank is the same run (nothing to overlap): its base is the plain one's.
        one = base.get(label, base.get(label.replace("_noovl", "")))
        r["efficiency"] = r["tokens"] / n / one if one else None
        rows.append(r)
    return rows


def torch_rows(out):
    path = os.path.join(out, "torch.log")
    if not os.path.exists(path):
        return []
    one, ddp = {}, []
    for line in open(path, errors="replace"):
        if m := TORCH_ONE.match(line):
            mode, ms, tokens, peak = m.groups()
            one[mode] = (float(ms), float(tokens.replace(",", "")), float(peak))
        elif m := TORCH_DDP.match(line):
            n, mode, wire, ms, tokens, peaks = m.groups()
            ddp.append((mode, wire, int(n), float(ms), float(tokens.replace(",", "")),
                        max(float(p) for p in peaks.split())))
    rows = []
    series = {(d[0], d[1]) for d in ddp} | {(m, "fp32") for m in one}
    for mode, wire in sorted(series, key=lambda k: (k[0], k[1] != "fp32")):  # fp32, DDP's default, first
        name = f"PyTorch DDP {mode}, {wire} grads"
        if mode in one:  # the plain step on one GPU, the base of every wire
            ms, tokens, peak = one[mode]
            rows.append(row(name + " (1 GPU: no DDP)", 1, ms, tokens, peak=peak, efficiency=1.0))
        for m, w, n, ms, tokens, peak in sorted(d for d in ddp if d[:2] == (mode, wire)):
            eff = tokens / n / one[mode][1] if mode in one else None
            rows.append(row(name, n, ms, tokens, peak=peak, efficiency=eff))
    return rows


def fmt(v, spec, missing="-"):
    return missing if v is None else format(v, spec)


def print_table(rows):
    print(f"{'mode':<54}{'GPUs':>5}{'ms/step':>10}{'tokens/s':>12}{'tokens/s/GPU':>14}{'weak eff':>10}"
          f"{'reduce ms':>11}{'peak MiB':>10}")
    for r in rows:
        if r["ms"] is None:
            print(f"{r['mode']:<54}{r['n']:>5}  failed")
            continue
        eff = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%"
        print(f"{r['mode']:<54}{r['n']:>5}{r['ms']:>10.2f}{r['tokens']:>12,.0f}{r['tokens'] / r['n']:>14,.0f}"
              f"{eff:>10}{fmt(r['reduce_ms'], '.2f'):>11}"
              f"{fmt(r['peak'], '.0f'):>10}")
    print("weak eff: tokens/s a GPU against the same mode's on 1 GPU; reduce ms: the reduction's time after backward "
          "(exposed; the last logged step's for --ddp); peak: allocated, the most of any GPU (--ddp: rank 0's)")


def print_overlap(rows):
    by = {(r["mode"], r["n"]): r for r in rows if r["ms"] is not None}
    lines = []
    for (mode, n), off in sorted(by.items()):
        on = by.get((mode.replace(", no overlap", ""), n))
        if mode.endswith(", no overlap") and on and n > 1:
            lines.append(f"  {mode[:-len(', no overlap')]}, {n} GPUs: {on['ms']:.2f} ms/step with it, "
                         f"{off['ms']:.2f} without ({off['ms'] - on['ms']:+.2f} ms); reduction after backward "
                         f"{fmt(on['reduce_ms'], '.2f')} ms against {fmt(off['reduce_ms'], '.2f')}")
    if lines:
        print("\nThe reduction overlapped with backward, against it after backward (--no-overlap):")
        print("\n".join(lines))


def print_targets(rows):
    print("\nIssue 52's targets, ZeRO-1 with bf16 gradients, overlapped:")
    most = max((r["n"] for r in rows), default=0)
    for n, target in TARGETS.items():
        hits = [r for r in rows if r["zero1_bf16"] and r["n"] == n and r["efficiency"] is not None]
        if not hits:
            print(f"  {n} GPUs (>= {100 * target:.0f}%): not run ({most} here)")
        for r in hits:
            verdict = "met" if r["efficiency"] >= target else "MISSED"
            print(f"  {n} GPUs (>= {100 * target:.0f}%): {r['mode']}: {100 * r['efficiency']:.1f}% {verdict}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=16, help="sequences a device")
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    rows = dpbench_rows(a.out, a.batch, a.seq) + ddp_rows(a.out, a.batch, a.seq) + torch_rows(a.out)
    print_table(rows)
    print_overlap(rows)
    print_targets(rows)
    with open(os.path.join(a.out, "gpt_scaling.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["mode", "n", "ms", "tokens", "efficiency", "reduce_ms", "peak"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
