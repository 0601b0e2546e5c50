#!/usr/bin/env python3
"""A step's timeline from kernel_trace.cpp's records (CUPTI, nothing serialized).

Steps are cut at a marker kernel that runs once a step (the optimizer's update by
default). Over the steady steps (the middle of the run) it prints the step's period, the
GPU's busy time, and for each kernel of the commonest step its mean duration, the mean gap
before it (the time the GPU had nothing of the step's to run) and how far its end moves
the step's end (its share of the period). With runtime calls
recorded (DPT_TRACE_API=1) it adds the host's calls a step.

Usage: kernel_trace.py TRACE.csv [--marker REGEX] [--label TEXT]
"""
import argparse
import collections
import csv
import re
import statistics


def short(name):
    name = name.replace("dpt::cuda::", "").replace("(anonymous namespace)::", "")
    name = re.sub(r"\(.*$", "", name)  # parameters
    name = re.sub(r"^void ", "", name)
    return name[:70]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--marker", default=r"sgd_step_kernel|adamw_step_kernel|checked_update_kernel|alternating_update_kernel")
    ap.add_argument("--label", default="")
    ap.add_argument("--by-kernel", action="store_true",
                    help="sum the step's records by kernel name (a transformer runs each kernel many times a step)")
    a = ap.parse_args()
    gpu, api = [], []
    with open(a.trace) as f:
        for r in csv.DictReader(f):
            rec = (int(r["start_ns"]), int(r["end_ns"]), short(r["name"]), r["kind"], r["where"])
            (api if r["kind"] == "R" else gpu).append(rec)
    gpu.sort()
    api.sort()
    marker = re.compile(a.marker)
    marks = [g for g in gpu if g[3] == "K" and marker.search(g[2])]
    print(f"== {a.label or a.trace}: {len(gpu)} GPU records, {len(api)} runtime calls, {len(marks)} steps")
    if len(marks) < 8:
        print("  too few steps to cut")
        return
    lo, hi = len(marks) // 4, len(marks) - max(2, len(marks) // 10)
    steps = []
    j = 0
    for i in range(lo, hi):
        t0, t1 = marks[i][1], marks[i + 1][1]  # from the end of one update to the end of the next
        while j < len(gpu) and gpu[j][0] < t0:
            j += 1
        k = j
        recs = []
        while k < len(gpu) and gpu[k][0] < t1:
            recs.append(gpu[k])
            k += 1
        steps.append((t0, t1, recs))
    shapes = collections.Counter(tuple(r[2] for r in s[2]) for s in steps)
    common, count = shapes.most_common(1)[0]
    periods = [(t1 - t0) / 1e3 for t0, t1, _ in steps]
    busy = []
    for t0, t1, recs in steps:
        total, reach = 0, t0
        for s, e, *_ in recs:
            s, e = max(s, reach), min(e, t1)
            if e > s:
                total += e - s
                reach = e
        busy.append(total / 1e3)
    print(f"  steps {len(steps)} (the commonest shape in {count}): period median {statistics.median(periods):.2f} us, "
          f"GPU busy {statistics.median(busy):.2f} us ({100 * statistics.median(busy) / statistics.median(periods):.0f}%)")
    durs = [[] for _ in common]
    gaps = [[] for _ in common]
    adds = [[] for _ in common]  # how far each record moves the step's end: its share of the period
    for t0, t1, recs in steps:
        if tuple(r[2] for r in recs) != common:
            continue
        reach = t0
        for p, (s, e, *_rest) in enumerate(recs):
            durs[p].append((e - s) / 1e3)
            gaps[p].append(max(0, s - reach) / 1e3)
            adds[p].append(max(0, e - reach) / 1e3)
            reach = max(reach, e)
    # time: start to end (a dependent launch starts early and waits inside); adds: how far
    # its end moves the step on past every earlier end (gap included)
    if a.by_kernel:
        by = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for p, name in enumerate(common):
            by[name][0] += 1
            by[name][1] += statistics.mean(durs[p])
            by[name][2] += statistics.mean(adds[p])
        print(f"  {'calls':>6} {'time us':>9} {'adds us':>9}  kernel")
        for name, (c, t, add) in sorted(by.items(), key=lambda kv: -kv[1][2]):
            print(f"  {c:6d} {t:9.1f} {add:9.1f}  {name}")
    print(f"  {'gap us':>8} {'time us':>8} {'adds us':>8}  kernel")
    for p, name in ([] if a.by_kernel else enumerate(common)):
        print(f"  {statistics.mean(gaps[p]):8.2f} {statistics.mean(durs[p]):8.2f} {statistics.mean(adds[p]):8.2f}  {name}")
    print(f"  {sum(statistics.mean(g) for g in gaps):8.2f} {sum(statistics.mean(d) for d in durs):8.2f} "
          f"{sum(statistics.mean(a) for a in adds):8.2f}  total")
    if api:
        calls = collections.defaultdict(lambda: [0, 0.0])
        n = len(steps)
        t_first, t_last = steps[0][0], steps[-1][1]
        for s, e, name, _, _ in api:
            if t_first <= s < t_last:
                calls[name][0] += 1
                calls[name][1] += (e - s) / 1e3
        print(f"  host calls a step (GPU steps {n}):")
        for name, (c, t) in sorted(calls.items(), key=lambda kv: -kv[1][1]):
            print(f"  {c / n:8.2f} calls {t / n:8.2f} us  {name}")


if __name__ == "__main__":
    main()
