#!/usr/bin/env python3
"""compare.sh gpt's table without a GPU: benchmarks/gpt_table.py reads the lines that
step_bench, torch_gpt_bench.py and gpt_compare.sh's loop print (hand-written here in their
formats), one row a run: the MFU of a loop from its step's flops a token, the speed against
torch.compile, the loop over the step's mean; the rows of --attention-backward fast
(FAST_ATTENTION=1) where the log has any, a failed one a dash, none where it has none.
Usage: gpt_table_test.py SOURCE_DIR"""
import importlib.util
import io
import os
import sys
import tempfile
from contextlib import redirect_stdout

STEP = ("dptrain gpt2 B 16 T 1024 bf16 cublas{tag}: {ms} ms/step, {tok} tokens/s, MFU {mfu}% of 989 TFLOPS, "
        "peak 8478.0 MiB, loss 10.99 -> 9.51; mean {mean} ms/step")
LOG = [
    STEP.format(tag="", ms="29.78", tok="550166", mfu="44.4", mean="29.91"),
    STEP.format(tag="-graph", ms="29.26", tok="559944", mfu="45.2", mean="29.44"),
    "torch gpt2 B 16 T 1024 compile: 37.10 ms/step, 441,617 tokens/s, MFU 35.7% of 989 TFLOPS, peak 8640.0 MiB",
    "dptrain-loop gpt2 B 16 eager: 29.90 ms/step, peak 8.28 GiB",
    "dptrain-loop gpt2 B 16 --cuda-graph: 29.64 ms/step, peak 8.28 GiB",
]
FAST = [
    STEP.format(tag="-graph-fast-attention", ms="28.70", tok="570868", mfu="46.1", mean="28.80"),
    "dptrain gpt2 B 16 eager fast: failed",
    "dptrain-loop gpt2 B 16 eager-fast: 29.30 ms/step, peak 8.28 GiB",
    "dptrain-loop gpt2 B 16 --cuda-graph-fast: 28.90 ms/step, peak 8.28 GiB",
]


def table(module, lines):
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    out = io.StringIO()
    sys.argv = ["gpt_table.py", f.name]
    with redirect_stdout(out):
        module.main()
    os.unlink(f.name)
    return {line[:25].strip(): line[25:].split() for line in out.getvalue().splitlines()[2:]}


def main():
    src = sys.argv[1]
    spec = importlib.util.spec_from_file_location("gpt_table", os.path.join(src, "benchmarks", "gpt_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    rows = table(module, LOG)
    assert rows["dptrain step graph"][:2] == ["16", "29.26"], rows
    loop = rows["dptrain loop graph"]  # B, ms, tokens/s, MFU, MiB, vs compile, loop/step
    assert loop[1:] == ["29.64", "552,767", "44.6%", "8479", "1.25x", "1.007"], loop
    assert rows["torch eager"] == ["16", "-"], rows
    assert not any("fast" in run for run in rows), rows

    rows = table(module, LOG + FAST)
    assert rows["dptrain step eager fast"] == ["16", "-"], rows  # it failed: a dash, not left out
    assert rows["dptrain step graph fast"][1:] == ["28.70", "570,868", "46.1%", "8478", "1.29x", "-"], rows
    assert rows["dptrain loop graph fast"][-1] == "1.003", rows  # over the fast step's mean
    assert rows["dptrain loop eager fast"][-1] == "-", rows  # no fast eager step to compare with
    assert rows["dptrain step graph"][1] == "29.26", rows  # the fast rows take nothing of the others
    print("gpt_table: the rows, the fast ones and a failed one's dash")


if __name__ == "__main__":
    main()
