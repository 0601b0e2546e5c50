#!/usr/bin/env python3
""".npy files against NumPy itself: what np.save and np.lib.format.write_array write
(every dtype dptrain reads, format versions 1.0, 2.0 and 3.0) reads in dptrain with the
same header and the same values, converted as the data sets convert them (float32; uint8
/ 255; labels as int32); what dptrain writes loads in numpy (np.load, mmap_mode too) with
the values it wrote; what numpy can write and dptrain does not read (Fortran order,
big-endian, structured, bool, complex, object arrays) is refused with its reason; and,
where the `safetensors` package is installed, a data file it writes reads the same.
Skipped (exit 77) where numpy is not installed.
Usage: npy_interop.py DATA_TOOL"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import numpy as np
except ImportError:
    print("no numpy here: the .npy interop test is skipped")
    sys.exit(77)

from interop_checks import check, finish  # noqa: E402

tool = sys.argv[1]


def run(*args):
    return subprocess.run([tool, *map(str, args)], capture_output=True, text=True)


def as_inputs(a):
    """The float32 values a data set gathers for input array `a`."""
    if a.dtype == np.uint8:
        return a.astype(np.float32) / np.float32(255)
    return a.astype(np.float32)


rng = np.random.default_rng(3)
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    # numpy -> dptrain, every dtype and version.
    arrays = {
        "float32": rng.standard_normal((5, 3)).astype("<f4"),
        "float64": rng.standard_normal((2, 3, 2, 2)) * 1e3,
        "float16": rng.standard_normal((4, 6)).astype("<f2"),
        "uint8": rng.integers(0, 256, (3, 1, 4, 4)).astype(np.uint8),
        "int32": rng.integers(-1000, 1000, (6, 2)).astype("<i4"),
        "int64": rng.integers(-10**6, 10**6, (3, 5)).astype("<i8"),
    }
    for name, a in arrays.items():
        for version in [None, (1, 0), (2, 0), (3, 0)]:
            path = tmp / f"{name}_{version}.npy"
            if version is None:
                np.save(path, a)
            else:
                with open(path, "wb") as f:
                    np.lib.format.write_array(f, a, version=version)
            what = f"{name} written as version {version or 'np.save'}"
            r = run("header", path)
            check(r.returncode == 0, f"{what}: refused: {r.stderr.strip()}")
            if r.returncode != 0:
                continue
            h = json.loads(r.stdout)
            check(h["dtype"] == name and h["shape"] == list(a.shape), f"{what}: header {h}")
            check(version is None or h["version"] == f"{version[0]}.0", f"{what}: version {h['version']}")
            d = json.loads(run("dump", path).stdout)
            got = np.array(d["x"], dtype=np.float32)
            want = as_inputs(a).ravel()
            check(d["rows"] == a.shape[0] and d["input_shape"] == list(a.shape[1:]), f"{what}: shape {d}")
            check(got.tobytes() == want.tobytes(), f"{what}: values {got[:6]} against numpy's {want[:6]}")

    # Labels of every integer type, and regression targets of every float type.
    x = rng.standard_normal((7, 4)).astype(np.float32)
    np.save(tmp / "x.npy", x)
    for dtype in [np.uint8, np.int32, np.int64]:
        y = rng.integers(0, 10, 7).astype(dtype)
        np.save(tmp / "y.npy", y)
        d = json.loads(run("dump", tmp / "x.npy", tmp / "y.npy").stdout)
        check(d["targets"] == "classification" and d["y"] == y.tolist(), f"{dtype.__name__} labels: {d['y']}")
    for dtype in [np.float16, np.float32, np.float64]:
        y = rng.standard_normal((7, 3)).astype(dtype)
        np.save(tmp / "y.npy", y)
        d = json.loads(run("dump", tmp / "x.npy", tmp / "y.npy").stdout)
        got = np.array(d["y"], dtype=np.float32)
        check(d["targets"] == "regression" and d["target_shape"] == [3] and
              got.tobytes() == y.astype(np.float32).ravel().tobytes(), f"{dtype.__name__} targets: {got}")

    # What dptrain refuses, and why.
    refused = {
        "fortran": (np.asfortranarray(rng.standard_normal((3, 4)).astype(np.float32)), "fortran_order is True"),
        "big_endian": (np.arange(6, dtype=">f4").reshape(2, 3), "descr '>f4' is big-endian"),
        "bool": (np.ones((2, 2), dtype=bool), "unsupported dtype '|b1'"),
        "int8": (np.ones((2, 2), dtype=np.int8), "unsupported dtype '|i1'"),
        "complex": (np.ones((2, 2), dtype=np.complex64), "unsupported dtype '<c8'"),
        "structured": (np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")]), "structured arrays are not supported"),
        "object": (np.array([[1, "a"]], dtype=object), "unsupported dtype '|O'"),
    }
    for name, (a, reason) in refused.items():
        path = tmp / f"{name}.npy"
        np.save(path, a, allow_pickle=True)
        r = run("header", path)
        msg = r.stderr.strip()
        check(r.returncode == 2 and msg.startswith(f"data file '{path}': ") and reason in msg and "\n" not in msg,
              f"{name}: expected a refusal naming '{reason}', got exit {r.returncode}: {msg}")
    cut = (tmp / "float32_None.npy").read_bytes()
    (tmp / "cut.npy").write_bytes(cut[:-3])
    r = run("header", tmp / "cut.npy")
    check(r.returncode == 2 and "truncated" in r.stderr, f"a truncated file: {r.stderr.strip()}")

    # dptrain -> numpy.
    out = tmp / "out"
    out.mkdir()
    r = run("write", out)
    check(r.returncode == 0, f"write: {r.stderr.strip()}")
    shapes = {"float32": (4, 6), "float64": (2, 3, 4), "float16": (24,), "uint8": (1, 2, 3, 4), "int32": (24, 1),
              "int64": (3, 8)}
    for name, shape in shapes.items():
        for major in [1, 2, 3]:
            path = out / f"{name}_v{major}.npy"
            for mmap in [None, "r"]:
                a = np.load(path, mmap_mode=mmap)
                check(a.dtype == np.dtype(name) and a.shape == shape and np.array_equal(a.ravel(), np.arange(24)),
                      f"numpy read {path.name} (mmap {mmap}) as {a.dtype} {a.shape}: {a.ravel()[:6]}")
            with open(path, "rb") as f:
                check(np.lib.format.read_magic(f) == (major, 0), f"{path.name}: version")
    s = np.load(out / "scalar.npy")
    check(s.shape == () and s == 5, f"scalar {s!r}")
    e = np.load(out / "empty.npy")
    check(e.shape == (0, 3) and e.dtype == np.float32, f"empty {e!r}")

    # A safetensors data file written by the reference implementation.
    try:
        from safetensors.numpy import save_file
    except ImportError:
        print("no safetensors here: its data-file part is skipped")
    else:
        t = {"x": rng.standard_normal((6, 2)).astype(np.float64), "y": rng.integers(0, 3, 6).astype(np.int64),
             "x_val": rng.integers(0, 256, (2, 2)).astype(np.uint8), "y_val": np.array([2, 0], dtype=np.int32)}
        save_file(t, str(tmp / "data.safetensors"))
        r = run("dump", tmp / "data.safetensors")
        check(r.returncode == 0, f"safetensors data file refused: {r.stderr.strip()}")
        if r.returncode == 0:
            d = json.loads(r.stdout)
            check(np.array(d["train"]["x"], np.float32).tobytes() == as_inputs(t["x"]).ravel().tobytes() and
                  d["train"]["y"] == t["y"].tolist(), f"safetensors train rows {d['train']}")
            check(np.array(d["val"]["x"], np.float32).tobytes() == as_inputs(t["x_val"]).ravel().tobytes() and
                  d["val"]["y"] == t["y_val"].tolist(), f"safetensors val rows {d['val']}")

finish(f"numpy {np.__version__}", "dptrain and numpy agree")
