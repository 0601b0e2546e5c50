#!/usr/bin/env python3
"""The PyTorch twin of step_bench: the same workload (model, batch, MSE, SGD lr 0.01,
a fixed random batch), timed the same way (warm-up, then the median over timed blocks
of steps, each block bracketed by CUDA events). Prints one line per run in the format
step_bench uses, so gpu_check.sh can put both side by side."""
import argparse

import torch


def widths(spec):
    spec = {"seed": "1000-1000", "mlp": "1024-4096x3-1024"}.get(spec, spec)
    out = []
    for tok in spec.split("-"):
        w, _, r = tok.partition("x")
        out += [int(w)] * (int(r) if r else 1)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="seed")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    dev = torch.device("cuda:0")
    w = widths(a.model)
    layers = []
    for i in range(len(w) - 1):
        layers.append(torch.nn.Linear(w[i], w[i + 1]))
        if i + 2 < len(w):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(a.batch, w[0], device=dev)
    y = torch.randn(a.batch, w[-1], device=dev)
    loss_fn = torch.nn.MSELoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            out = model(x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        opt.step()
        return loss

    first = step().item()
    for _ in range(a.warmup - 1):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.blocks):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(a.steps):
            loss = step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / a.steps)
    times.sort()
    med = times[len(times) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(f"torch {a.model} batch {a.batch} {a.precision} eager: {med:.4f} ms/step, "
          f"{1e3 * a.batch / med:.4g} samples/s, peak {peak:.1f} MiB, loss {first:.5g} -> {loss.item():.5g}")


if __name__ == "__main__":
    main()
