#!/usr/bin/env python3
"""README.md and docs/*.md say what is true: their links resolve and README's examples run.

1. Links. Every relative link and image in README.md and docs/*.md (outside code) names a
   file or folder that exists, and every #anchor matches a heading of the file it points
   into, slugged as GitHub does (lower case; punctuation but '-' and '_' dropped; spaces
   to '-'; a repeated heading gets -1, -2, ...). Web links are not fetched.
2. README's examples. Every ```sh block of README.md is run with bash (-e, -o pipefail),
   in order, in one temporary folder where build/apps/dptrain is the program under test
   and examples/ the repository's, so that a block may use what an earlier one wrote (the
   model that predict reads). The marking convention, on a block's first line:
     # needs a GPU ...                   skipped here (the test counts them and says so)
     # what tests/package_test.sh does   not run: the package test builds that recipe;
                                         here its text is checked against that script
   Blocks that hold `.ci/deps` are the two commands that build the tree; CI runs them.
   A block that runs `mpirun` is skipped where the build has no MPI (no --mpi flag); one
   that imports numpy is skipped without numpy. Where the Python package `safetensors` is
   missing, a minimal `safetensors.numpy.save_file` (the format's 8-byte header length,
   JSON header, raw little-endian bytes) stands in for it, so that dptrain's side of that
   example still runs. Keep the examples small: all of them take seconds on one core.
Usage: docs_test.py SOURCE_DIR DPTRAIN [--mpi]"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

src = Path(sys.argv[1]).resolve()
dptrain = Path(sys.argv[2]).resolve()
have_mpi = "--mpi" in sys.argv[3:]
failures = []


def fail(what):
    failures.append(what)
    print(f"FAIL: {what}")


# ---- 1. links and anchors --------------------------------------------------------------
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(text, blank_code=True):
    """The lines outside fenced code, with inline code blanked out (unless told)."""
    inside = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line.lstrip()):
            inside = not inside
            continue
        if not inside:
            yield number, re.sub(r"`[^`]*`", "``", line) if blank_code else line


def slug(heading):
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    seen, found = {}, set()
    for _, line in prose_lines(path.read_text(), blank_code=False):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


pages = [src / "README.md"] + sorted((src / "docs").glob("*.md"))
links = 0
for page in pages:
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            links += 1
            where = f"{page.relative_to(src)}:{number}: '{target}'"
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                fail(f"{where}: no such file or folder")
                continue
            if anchor:
                if dest.suffix != ".md":
                    fail(f"{where}: an anchor into a file that is not markdown")
                elif anchor not in anchors(dest):
                    fail(f"{where}: no heading of {dest.relative_to(src)} has the anchor '#{anchor}'")
print(f"links: {links} relative links in {len(pages)} pages checked")

# ---- 2. README's examples --------------------------------------------------------------
readme = (src / "README.md").read_text()
blocks = re.findall(r"^```sh\n(.*?)^```", readme, re.S | re.M)

package_test = (src / "tests" / "package_test.sh").read_text()
cmake_blocks = re.findall(r"^```cmake\n(.*?)^```", readme, re.S | re.M)
for block in cmake_blocks:  # the consuming project's CMakeLists.txt, as package_test writes it
    for line in filter(None, (l.strip() for l in block.split("\n"))):
        if line not in package_test:
            fail(f"README's CMake recipe line '{line}' is not in tests/package_test.sh")

try:
    import numpy  # noqa: F401

    have_numpy = True
except ImportError:
    have_numpy = False
try:
    import safetensors  # noqa: F401

    have_safetensors = True
except ImportError:
    have_safetensors = False

SAFETENSORS_SHIM = '''
import json, struct
import numpy as np
DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int32": "I32", "int64": "I64", "uint8": "U8"}
def save_file(tensors, path):
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": DTYPES[array.dtype.name], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
'''

tmp = Path(tempfile.mkdtemp(prefix="docs_test."))
try:
    (tmp / "build" / "apps").mkdir(parents=True)
    (tmp / "build" / "apps" / "dptrain").symlink_to(dptrain)
    (tmp / "examples").symlink_to(src / "examples")
    env = dict(os.environ)
    # Open MPI refuses root and more ranks than cores unless told; README says how.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    if not have_safetensors:
        shim = tmp / ".shim" / "safetensors"
        shim.mkdir(parents=True)
        (shim / "__init__.py").write_text("")
        (shim / "numpy.py").write_text(SAFETENSORS_SHIM)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp / ".shim"), env.get("PYTHONPATH")]))

    ran, gpu_only, skipped = 0, 0, []
    for index, block in enumerate(blocks, 1):
        first = block.split("\n", 1)[0]
        name = f"README example {index} ('{first.strip()[:60]}')"
        if ".ci/deps" in block:
            continue
        if first.startswith("# needs a GPU"):
            gpu_only += 1
            continue
        if first.startswith("# what tests/package_test.sh does"):
            for needed in ("--install", "-DCMAKE_PREFIX_PATH", "find_package(dptrain REQUIRED)"):
                if needed not in package_test or (needed.startswith("-") and needed not in block):
                    fail(f"{name}: '{needed}' is not in both the recipe and tests/package_test.sh")
            continue
        if "mpirun" in block and not (have_mpi and shutil.which("mpirun")):
            skipped.append(f"{name}: no MPI in this build")
            continue
        if "import numpy" in block and not have_numpy:
            skipped.append(f"{name}: no numpy here")
            continue
        start = time.monotonic()
        try:
            run = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp, env=env,
                                 capture_output=True, text=True, timeout=120)
            rc, output = run.returncode, run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            rc, output = "timeout", str(e.stdout or "") + str(e.stderr or "")
        seconds = time.monotonic() - start
        ran += 1
        if rc != 0:
            fail(f"{name}: exit status {rc} after {seconds:.1f} s\n--- the block:\n{block}--- its output (end):\n"
                 + "\n".join(output.splitlines()[-25:]))
        else:
            print(f"ok: {name} ({seconds:.1f} s)")
    print(f"examples: {ran} of README's examples ran, {gpu_only} marked '# needs a GPU' skipped"
          + (f", {len(skipped)} skipped: " + "; ".join(skipped) if skipped else "")
          + ("" if have_safetensors else " (safetensors' save_file was the test's stand-in)"))
finally:
    shutil.rmtree(tmp, ignore_errors=True)

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("docs: every link resolves and every example that needs no GPU runs")
