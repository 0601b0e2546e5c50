#!/usr/bin/env python3
"""compare.sh maxbatch's judge and table (gpt_max_batch.sh runs the tries): what a try of
dptrain or torch_gpt_bench.py at one batch came to, the batch torch's peaks at two batches
predict, and the table of the largest batch that fit.

  verdict dptrain|torch STATUS FILE   one line: "fit <peak MiB> <ms/step>", "oom", "timeout"
                                      or "error <the output's last line>"
  predict --total-mib M --headroom-mib H --resolution R B:MiB B:MiB
                                      "<B> <MiB a sequence>": the largest multiple of R whose
                                      peak, on the line through the two, stays under M - H
  table LOG                           one row a run (dptrain none, dptrain gelu+ln, torch
                                      compile, ...): the largest B that fit, its peak and
                                      ms/step, the first B out of memory, and what stopped it

LOG holds the tries, each a line "== try <side> <mode> B <B>: status <S>" followed by the
program's own output (stdout and stderr), and the script's notes: "== gpu: <name>, <MiB>
MiB, <date>", "== predict torch <mode>: B <B> ..." and "== stop <side> <mode>: <why>".
Out of memory is dptrain's exit status 3 with its "out of memory on cuda" line, or the
bench's status 3 with its "out of memory" line (a torch.OutOfMemoryError's traceback is
taken as one too); any other failure is an error, and stops that run's search."""
import argparse
import re
import sys

SEQ = 1024  # GPT-2's context: every try trains on sequences of it
UNIT = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20}  # to MiB
DONE = re.compile(r"^done: .*; ([\d.]+) ms/step$")
MEMORY = re.compile(r"^memory \S+: peak ([\d.]+) ([KMGT]?i?B) allocated, ([\d.]+) ([KMGT]?i?B) reserved")
DPTRAIN_OOM = re.compile(r"^dptrain: error: .*out of memory on cuda")
TORCH = re.compile(r"^torch \S+ B \d+ T \d+ \S+: ([\d.]+) ms/step, .*, peak ([\d.]+) MiB")
TORCH_OOM = re.compile(r"^torch \S+ B \d+ T \d+ \S+: out of memory")
TORCH_OOM_TRACE = re.compile(r"OutOfMemoryError|CUDA out of memory")
TRY = re.compile(r"^== try (\S+) (\S+) B (\d+): status (-?\d+)$")
TIMED_OUT = (124, 137)  # timeout's status, and its KILL's after --kill-after


def verdict(side, status, lines):
    """(word, fields): ("fit", {mib, ms[, reserved]}), ("oom", {}), ("timeout", {}) or
    ("error", {line})."""
    lines = [line.rstrip("\n") for line in lines]
    if status in TIMED_OUT:
        return "timeout", {}
    if side == "dptrain":
        done = [float(m.group(1)) for line in lines if (m := DONE.match(line))]
        memory = [m.groups() for line in lines if (m := MEMORY.match(line))]
        if status == 0 and done and memory:
            amount, unit, reserved, reserved_unit = memory[0]
            return "fit", dict(ms=done[-1], mib=float(amount) * UNIT[unit],
                               reserved=float(reserved) * UNIT[reserved_unit])
        if status == 3 and any(DPTRAIN_OOM.match(line) for line in lines):
            return "oom", {}
    else:
        runs = [m.groups() for line in lines if (m := TORCH.match(line))]
        if status == 0 and runs:
            return "fit", dict(ms=float(runs[-1][0]), mib=float(runs[-1][1]))
        if status != 0 and (status == 3 and any(TORCH_OOM.match(line) for line in lines) or
                            any(TORCH_OOM_TRACE.search(line) for line in lines)):
            return "oom", {}
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return "error", dict(line=f"status {status}: {last}" if status else f"no result line: {last}")


def predict(total_mib, headroom_mib, resolution, points):
    """(B, MiB a sequence) from two (B, peak MiB) points, or raises ValueError."""
    (b1, p1), (b2, p2) = sorted(points)
    if b1 == b2:
        raise ValueError(f"two peaks at one batch ({b1})")
    slope = (p2 - p1) / (b2 - b1)
    if slope <= 0:
        raise ValueError(f"the peak does not grow with the batch ({p1:g} MiB at B {b1}, {p2:g} at B {b2})")
    fixed = p1 - slope * b1
    batch = int((total_mib - headroom_mib - fixed) / slope) // resolution * resolution
    if batch < resolution:
        raise ValueError(f"{total_mib - headroom_mib:g} MiB fits less than {resolution} sequences")
    return batch, slope


class Run:
    """A run's tries (dptrain none, torch compile, ...) as the table sees them."""

    def __init__(self):
        self.fits, self.ooms, self.notes, self.tries = {}, set(), [], 0
        self.failed = False  # a try that neither fit nor ran out of memory

    def add(self, batch, word, fields):
        self.tries += 1
        if word == "fit":
            self.fits[batch] = fields
        elif word == "oom":
            self.ooms.add(batch)
        else:
            self.failed = True
            line = fields.get("line", "")
            line = line if len(line) <= 160 else line[:157] + "..."
            self.notes.append(f"{'timed out' if word == 'timeout' else 'error'} at B {batch}" +
                              (f" ({line})" if line else ""))

    def row(self):
        largest = max(self.fits, default=None)
        first_oom = min(self.ooms, default=None)
        fit = self.fits.get(largest, {})
        notes = list(self.notes)
        if largest and first_oom and largest > first_oom:
            notes.append(f"B {largest} fit above an out of memory at B {first_oom}")
        if largest and not first_oom and not self.failed:
            notes.append(f"no out of memory up to B {largest}")
        return largest, first_oom, fit, notes


def parse(log):
    """(gpu line, {run name: Run}) in the order the runs first appear."""
    gpu, runs, key, block = None, {}, None, []

    def close():
        if key:
            side, mode, batch, status = key
            runs.setdefault(f"{side} {mode}", Run()).add(batch, *verdict(side, status, block))

    for line in open(log, errors="replace"):
        if m := TRY.match(line):
            close()
            side, mode, batch, status = m.groups()
            key, block = (side, mode, int(batch), int(status)), []
        elif line.startswith("== "):
            close()
            key = None
            if line.startswith("== gpu: "):
                gpu = line[len("== gpu: "):].strip()
            elif m := re.match(r"== (predict|stop) (\S+) (\S+): (.*)", line):
                what, side, mode, text = m.groups()
                runs.setdefault(f"{side} {mode}", Run()).notes.append(
                    f"predicted {text.split(' (')[0]}" if what == "predict" else f"stopped: {text}")
        elif key:
            block.append(line)
    close()
    return gpu, runs


def table(log):
    gpu, runs = parse(log)
    print(f"== the largest batch that fits, GPT-2 124M, bf16, T {SEQ}, AdamW ({gpu or 'GPU unknown'}) ==")
    print("largest B: the largest batch that trained; first OOM: the smallest that ran out of memory; "
          "peak: allocated (reserved: dptrain's allocator's)")
    print(f"{'run':<18}{'largest B':>10}{'peak GiB':>10}{'reserved':>10}{'ms/step':>10}{'tokens/s':>11}"
          f"{'first OOM':>11}{'tries':>7}  notes")
    for name, run in runs.items():
        largest, first_oom, fit, notes = run.row()
        cells = ["-"] * 4
        if fit:
            cells = [f"{fit['mib'] / 1024:.2f}", f"{fit['reserved'] / 1024:.2f}" if "reserved" in fit else "-",
                     f"{fit['ms']:.1f}", f"{largest * SEQ * 1e3 / fit['ms']:,.0f}"]
        print(f"{name:<18}{largest or '-':>10}{cells[0]:>10}{cells[1]:>10}{cells[2]:>10}{cells[3]:>11}"
              f"{first_oom or '-':>11}{run.tries:>7}  {'; '.join(notes)}".rstrip())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verdict")
    v.add_argument("side", choices=["dptrain", "torch"])
    v.add_argument("status", type=int)
    v.add_argument("file")
    p = sub.add_parser("predict")
    p.add_argument("--total-mib", type=float, required=True)
    p.add_argument("--headroom-mib", type=float, required=True)
    p.add_argument("--resolution", type=int, required=True)
    p.add_argument("points", nargs=2, help="B:MiB")
    t = sub.add_parser("table")
    t.add_argument("log")
    a = ap.parse_args()
    if a.command == "verdict":
        word, fields = verdict(a.side, a.status, open(a.file, errors="replace"))
        print(" ".join([word] + ([f"{fields['mib']:.0f}", f"{fields['ms']:g}"] if word == "fit" else []) +
                       ([fields["line"]] if word == "error" else [])))
    elif a.command == "predict":
        try:
            points = [(int(b), float(mib)) for b, mib in (point.split(":") for point in a.points)]
            batch, slope = predict(a.total_mib, a.headroom_mib, a.resolution, points)
        except ValueError as e:
            print(f"gpt_max_batch.py predict: {e}", file=sys.stderr)
            return 1
        print(batch, f"{slope:.1f}")
    else:
        table(a.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
