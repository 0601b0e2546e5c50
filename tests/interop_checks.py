"""What the interop scripts (npy_interop.py, safetensors_interop.py) share: each failed
check printed and counted, and the summary line and exit status at the end."""
import sys

failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
        print(f"FAIL: {what}")


def finish(name, agreed):
    """Prints "NAME: AGREED" (or "NAME: FAIL") and exits 1 on any failure, else 0."""
    print(f"{name}: {'FAIL' if failures else agreed}")
    sys.exit(1 if failures else 0)
