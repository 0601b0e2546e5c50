#!/usr/bin/env python3
"""A dptrain checkpoint loads with Python's safetensors into the equivalent PyTorch
nn.Sequential (strict names and shapes) and gives the same outputs as dptrain's model:
MLPs, and CNNs with their batch-norm running statistics (in evaluation mode).
Usage: torch_interop.py DPTRAIN CHECKPOINT_TOOL. Exits 77 (skipped) without torch."""
import math
import os
import re
import subprocess
import sys
import tempfile

try:
    import torch
    from safetensors.torch import load_file
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)


ACTS = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU, "tanh": torch.nn.Tanh}


def torch_cnn(spec, act):
    """The torch.nn.Sequential of a dptrain CNN spec (grammar in include/dptrain/layers/conv.hpp)."""
    tokens = spec[len("cnn:"):].split("-")
    shape = [int(v) for v in tokens[0].split("x")]
    layers, features, prev = [], None, None
    for i, tok in enumerate(tokens[1:]):
        last, nxt = i == len(tokens) - 2, tokens[i + 2] if i < len(tokens) - 2 else None
        pairs = re.findall(r"([a-z]+)(\d*)", tok)
        kind, main, opts = pairs[0][0], pairs[0][1], {k: int(v) for k, v in pairs[1:]}
        if kind == "c":
            k, d, s = opts["k"], opts.get("d", 1), opts.get("s", 1)
            p = opts.get("p", d * (k - 1) // 2)
            layers.append(torch.nn.Conv2d(shape[0], int(main), k, stride=s, padding=p, dilation=d))
            shape = [int(main)] + [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n in shape[1:]]
            if nxt != "bn":
                layers.append(ACTS[act]())
        elif kind == "bn":
            layers.append(torch.nn.BatchNorm2d(shape[0]))
            if prev == "c":
                layers.append(ACTS[act]())
        elif kind in ("p", "a"):
            k = int(main)
            s, p = opts.get("s", k), opts.get("p", 0)
            layers.append(torch.nn.MaxPool2d(k, s, p) if kind == "p" else torch.nn.AvgPool2d(k, s, p))
            shape = [shape[0]] + [(n + 2 * p - k) // s + 1 for n in shape[1:]]
        elif kind == "g":
            layers.append(torch.nn.AdaptiveAvgPool2d(1))
            shape = [shape[0], 1, 1]
        elif kind == "f":
            if features is None:
                layers.append(torch.nn.Flatten())
                features = math.prod(shape)
            layers.append(torch.nn.Linear(features, int(main)))
            features = int(main)
            if not last:
                layers.append(ACTS[act]())
        prev = kind
    return torch.nn.Sequential(*layers)


def check_outputs(dptrain, tool, tmp, what, args, model):
    """dptrain ARGS trained for 5 steps and saved: `model` loads the checkpoint (strict names
    and shapes; batch norm's running statistics too) and, in evaluation mode, gives the
    outputs that tests/checkpoint_tool.cpp's forward writes."""
    ck, out = os.path.join(tmp, "ck.safetensors"), os.path.join(tmp, "xy.safetensors")
    subprocess.run([dptrain, "--devices", "cpu", *args, "--steps", "5", "--save", ck], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run([tool, "forward", ck, out], check=True)
    state = {k: v for k, v in load_file(ck).items() if not k.startswith("optimizer.")}
    model.load_state_dict(state, strict=True)
    model.eval()
    xy = load_file(out)
    with torch.no_grad():
        y = model(xy["x"])
    err = (torch.linalg.norm(y - xy["y"]) / torch.linalg.norm(xy["y"])).item()
    print(f"{what}: PyTorch vs dptrain outputs, relative error {err:.3g}")
    if not err < 1e-5:
        sys.exit(1)


def main():
    dptrain, tool = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        for act in ("relu", "gelu", "tanh"):
            widths = [12, 32, 32, 5]
            layers = []
            for i in range(len(widths) - 1):
                layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
                if i + 2 < len(widths):
                    layers.append(ACTS[act]())
            check_outputs(dptrain, tool, tmp, act, ["--model", "12-32x2-5", "--act", act], torch.nn.Sequential(*layers))
        for spec in ("cnn:3x8x8-c4k3-bn-p2-c6k3s2p0-a2s1p1-g-f5", "cnn:2x9x7-c4k3d2-bn-a3s2p1-f6-f3"):
            check_outputs(dptrain, tool, tmp, f"{spec} (eval mode)", ["--model", spec, "--batch", "16"],
                          torch_cnn(spec, "relu"))


if __name__ == "__main__":
    main()
