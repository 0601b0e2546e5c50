#!/usr/bin/env python3
"""Checkpoints against the reference safetensors implementation (Python package
`safetensors`, whose parser is the Rust one): a file written by dptrain loads there with
the expected values, and a file written there loads in dptrain with the same values.
Skipped (exit 77) where the `safetensors` and `numpy` packages are not installed.
Usage: safetensors_interop.py CHECKPOINT_TOOL"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_checks import check, finish  # noqa: E402
from xxh64 import xxh64  # noqa: E402

try:
    import numpy as np
    import safetensors
    from safetensors.numpy import load_file, save_file
except ImportError as e:
    print(f"no {e.name} here: the safetensors interop test is skipped")
    sys.exit(77)

tool = sys.argv[1]


def dtype_name(d):  # older releases say "float32", newer "F32"
    return {"float32": "F32", "bfloat16": "BF16", "int32": "I32"}.get(d, d)


with tempfile.TemporaryDirectory() as tmp:
    # dptrain -> safetensors: tests/checkpoint_tool.cpp writes this checkpoint.
    path = Path(tmp) / "dptrain.safetensors"
    subprocess.run([tool, "write", str(path)], check=True)
    expected = {
        "layers.0.weight": ("F32", [2, 3], np.array([-0.5, -0.25, 0.0, 0.25, 0.5, 0.75], "<f4").tobytes()),
        "layers.0.bias": ("BF16", [4], np.array([0x3F80, 0xC000, 0x3F00, 0x4040], "<u2").tobytes()),
        "idx": ("I32", [3], np.array([-1, 0, 2147483647], "<i4").tobytes()),
        "step": ("I32", [], np.array(7, "<i4").tobytes()),
        "empty": ("F32", [0, 4], b""),
    }
    # The reference parser validates the whole file (offsets, coverage, sizes).
    got = {name: (dtype_name(t["dtype"]), list(t["shape"]), bytes(t["data"]))
           for name, t in safetensors.deserialize(path.read_bytes())}
    check(got == expected, f"reference parser read {got}, expected {expected}")
    with safetensors.safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
        sums = {k[len("checksum:"):]: v for k, v in meta.items() if k.startswith("checksum:")}
        check({k: v for k, v in meta.items() if not k.startswith("checksum:")} ==
              {"step": "10", "model": "16-128x2-4", "note": "\u00e9 \"quoted\"\n"}, f"metadata {meta}")
        # Each tensor's checksum, as xxHash computes it.
        check(sums == {name: "xxh64:%016x" % xxh64(data) for name, (_, _, data) in expected.items()},
              f"checksums {sums}")
        w = f.get_tensor("layers.0.weight")
        check(w.dtype == np.float32 and w.shape == (2, 3) and
              np.array_equal(w, np.array([[-0.5, -0.25, 0.0], [0.25, 0.5, 0.75]], np.float32)), f"weight {w}")
        step = f.get_tensor("step")
        check(step.dtype == np.int32 and step.shape == () and int(step) == 7, f"step {step}")

    # safetensors -> dptrain: numpy has no bf16, so F32 and I32 here.
    path = Path(tmp) / "reference.safetensors"
    tensors = {
        "z.last": np.arange(12, dtype=np.float32).reshape(3, 4) / 8,
        "a.first": np.array([[-3, 5]], dtype=np.int32),
        "scalar": np.array(2.5, dtype=np.float32),
        "none": np.zeros((2, 0), dtype=np.float32),
    }
    save_file(tensors, str(path), metadata={"step": "3", "optimizer": "adamw"})
    check(set(load_file(str(path))) == set(tensors), "the reference does not read its own file back")
    out = subprocess.run([tool, "dump", str(path)], check=True, capture_output=True, text=True).stdout
    dumped = json.loads(out)
    check(dumped["metadata"] == {"step": "3", "optimizer": "adamw"}, f"dptrain read metadata {dumped['metadata']}")
    read = {t["name"]: (t["dtype"], t["shape"], bytes.fromhex(t["hex"])) for t in dumped["tensors"]}
    want = {name: ({np.float32: "F32", np.int32: "I32"}[a.dtype.type], list(a.shape), a.astype(a.dtype.newbyteorder("<")).tobytes())
            for name, a in tensors.items()}
    check(read == want, f"dptrain read {read}, expected {want}")

finish(f"safetensors {safetensors.__version__}", "both directions agree")
