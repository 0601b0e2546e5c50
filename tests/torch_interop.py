#!/usr/bin/env python3
"""A dptrain checkpoint loads with Python's safetensors into the equivalent PyTorch
nn.Sequential (strict names and shapes) and gives the same outputs as dptrain's model.
Usage: torch_interop.py DPTRAIN CHECKPOINT_TOOL. Exits 77 (skipped) without torch."""
import os
import subprocess
import sys
import tempfile

try:
    import torch
    from safetensors.torch import load_file
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)


def main():
    dptrain, tool = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        ck, out = os.path.join(tmp, "ck.safetensors"), os.path.join(tmp, "xy.safetensors")
        for act in ("relu", "gelu", "tanh"):
            subprocess.run([dptrain, "--devices", "cpu", "--model", "12-32x2-5", "--act", act, "--steps", "5",
                            "--save", ck], check=True, stdout=subprocess.DEVNULL)
            subprocess.run([tool, "forward", ck, out], check=True)
            state = {k: v for k, v in load_file(ck).items() if not k.startswith("optimizer.")}
            layers = []
            widths = [12, 32, 32, 5]
            for i in range(len(widths) - 1):
                layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
                if i + 2 < len(widths):
                    layers.append({"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU(), "tanh": torch.nn.Tanh()}[act])
            model = torch.nn.Sequential(*layers)
            model.load_state_dict(state, strict=True)  # names and shapes must match exactly
            xy = load_file(out)
            with torch.no_grad():
                y = model(xy["x"])
            err = (torch.linalg.norm(y - xy["y"]) / torch.linalg.norm(xy["y"])).item()
            print(f"{act}: PyTorch vs dptrain outputs, relative error {err:.3g}")
            if not err < 1e-5:
                sys.exit(1)


if __name__ == "__main__":
    main()
