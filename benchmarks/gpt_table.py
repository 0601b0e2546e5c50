#!/usr/bin/env python3
"""compare.sh gpt's table (gpt_compare.sh writes the log): from the lines of step_bench
--model gpt2, torch_gpt_bench.py and dptrain's loop ("dptrain-loop gpt2 B <B> <mode>: <ms>
ms/step, peak <amount> <unit>"), one row a run and batch: ms/step, tokens/s, MFU (the loop's
from the step's flops a token), peak MiB, the speed against torch.compile and the loop's
ratio to the bare step's mean.

Usage: gpt_table.py LOG [--peak-tflops P]"""
import argparse
import re

STEP = re.compile(r"dptrain gpt2 B (\d+) T (\d+) \S+ \S+?(-graph)?(-fast-attention)?: ([\d.]+) ms/step, (\d+) tokens/s, MFU ([\d.]+)% "
                  r"of \S+ TFLOPS, peak ([\d.]+) MiB, loss \S+ -> [^;]+; mean ([\d.]+) ms/step")
TORCH = re.compile(r"torch gpt2 B (\d+) T (\d+) (eager|compile): ([\d.]+) ms/step, ([\d,]+) tokens/s, MFU ([\d.]+)% "
                   r"of \S+ TFLOPS, peak ([\d.]+) MiB")
LOOP = re.compile(r"dptrain-loop gpt2 B (\d+) (\S+): ([\d.]+) ms/step, peak ([\d.]+) ([KMGT]?i?B)")
UNIT = {"B": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20}  # to MiB
ORDER = ["dptrain step eager", "dptrain step graph", "dptrain loop eager", "dptrain loop graph", "torch eager",
         "torch compile"]
# With FAST_ATTENTION=1 (--attention-backward fast): printed where the log has any of them.
FAST = ["dptrain step eager fast", "dptrain step graph fast", "dptrain loop eager fast", "dptrain loop graph fast"]


def parse(log, peak):
    """(rows, flops): rows[(batch, run)] = dict(ms, tokens, mib[, mfu, mean]); flops[batch] = a
    token's flops, as the step's line counts them (MFU x peak / tokens/s)."""
    rows, flops, seq = {}, {}, {}
    loops = []
    for line in open(log):
        if m := STEP.match(line):
            b, t, graph, fast, ms, tok, mfu, mib, mean = m.groups()
            run = "dptrain step " + ("graph" if graph else "eager") + (" fast" if fast else "")
            rows[(int(b), run)] = dict(ms=float(ms), tokens=float(tok), mfu=float(mfu), mib=float(mib),
                                       mean=float(mean))
            flops[int(b)], seq[int(b)] = float(mfu) / 100 * peak * 1e12 / float(tok), int(t)
        elif m := TORCH.match(line):
            b, t, mode, ms, tok, mfu, mib = m.groups()
            rows[(int(b), "torch " + mode)] = dict(ms=float(ms), tokens=float(tok.replace(",", "")), mfu=float(mfu),
                                                  mib=float(mib))
            seq[int(b)] = int(t)
        elif m := LOOP.match(line):
            loops.append(m.groups())
    for b, mode, ms, amount, unit in loops:  # the loop trains on the model's context, as the step
        b, ms = int(b), float(ms)
        run = "dptrain loop " + ("graph" if mode.startswith("--cuda-graph") else "eager")
        rows[(b, run + (" fast" if mode.endswith("-fast") else ""))] = dict(
            ms=ms, tokens=b * seq.get(b, 1024) * 1e3 / ms, mib=float(amount) * UNIT[unit])
    return rows, flops


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    a = ap.parse_args()
    peak = a.peak_tflops
    rows, flops = parse(a.log, peak)
    print(f"MFU: 6N + 6LCT flops a token against {peak:g} TFLOPS; vs compile: torch.compile's ms / this row's "
          "(above 1: faster); loop/step: the loop's ms over the bare step's mean (the same mode)")
    print(f"{'run':<25}{'B':>4}{'ms/step':>10}{'tokens/s':>11}{'MFU':>7}{'peak MiB':>10}{'vs compile':>12}"
          f"{'loop/step':>11}")
    runs = ORDER + (FAST if any(run in FAST for _, run in rows) else [])
    for b in sorted({b for b, _ in rows}):
        compiled = rows.get((b, "torch compile"))
        for run in runs:
            r = rows.get((b, run))
            if not r:
                print(f"{run:<25}{b:>4}{'-':>10}")
                continue
            mfu = r.get("mfu")
            if mfu is None and b in flops:
                mfu = 100 * flops[b] * r["tokens"] / (peak * 1e12)
            step = rows.get((b, run.replace("loop", "step"))) if "loop" in run else None
            mfu_text = f"{mfu:.1f}%" if mfu else "-"
            vs_compile = f"{compiled['ms'] / r['ms']:.2f}x" if compiled else "-"
            loop_step = f"{r['ms'] / step['mean']:.3f}" if step else "-"
            print(f"{run:<25}{b:>4}{r['ms']:>10.2f}{r['tokens']:>11,.0f}{mfu_text:>7}{r['mib']:>10.0f}"
                  f"{vs_compile:>12}{loop_step:>11}")


if __name__ == "__main__":
    main()
