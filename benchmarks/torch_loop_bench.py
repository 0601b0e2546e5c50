#!/usr/bin/env python3
"""PyTorch's twin of dptrain's training loop, end to end: what a user's script does, not
only the bare step. Like `dptrain --model M --batch B` on synthetic data, every step makes
its batch on the GPU (standard normal inputs, regression targets from a fixed random
teacher, tanh(x W1^T) W2^T plus noise of 0.05, as data/synthetic.cpp), trains the MLP of
dptrain's spec (ReLU, MSE, SGD lr 0.01 without momentum, bf16 by autocast) and reads the loss on the host every
--log-every steps, as dptrain logs it.

Modes:
  eager  the loop as written
  graph  the step, batch making included, captured once with torch.cuda.graph and
         replayed (PyTorch's whole-network capture; the generator is graph-safe)

Timed by wall clock from after the warm-up to the end of the last step (the GPU
synchronized at both ends), as dptrain's summary times its steps. Prints one line:
  torch-loop <model> batch <B> <prec> <mode>: <ms> ms/step, <n> samples/s"""
import argparse
import time

import torch

from torch_bench import widths  # dptrain's MLP spec grammar


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="seed, mlp, default (dptrain's default job) or a spec")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--mode", default="eager", choices=["eager", "graph"])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--teacher-hidden", type=int, default=64)
    a = ap.parse_args()
    w = widths({"default": "16-128x2-4"}.get(a.model, a.model))
    torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
    dev = torch.device("cuda:0")
    torch.manual_seed(1)
    layers = []
    for i in range(len(w) - 1):
        layers.append(torch.nn.Linear(w[i], w[i + 1]))
        if i + 2 < len(w):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    w1 = torch.randn(a.teacher_hidden, w[0], device=dev) / w[0] ** 0.5
    w2 = 1.6 * torch.randn(w[-1], a.teacher_hidden, device=dev) / a.teacher_hidden ** 0.5
    x = torch.empty(a.batch, w[0], device=dev)

    def step():
        with torch.no_grad():  # the batch, made on the GPU
            x.normal_()
            y = torch.tanh(x @ w1.T) @ w2.T
            y += 0.05 * torch.randn_like(y)
        opt.zero_grad(set_to_none=a.mode == "eager")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16",
                            cache_enabled=a.mode == "eager"):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        return loss

    run = step
    if a.mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=False)
        with torch.cuda.graph(graph):
            static_loss = step()

        def run():
            graph.replay()
            return static_loss

    for _ in range(a.warmup):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(a.steps):
        loss = run()
        if (i + 1) % a.log_every == 0:
            loss.item()  # the host reads the loss, as a log line does
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / a.steps
    print(f"torch-loop {a.model} batch {a.batch} {a.precision} {a.mode}: {ms:.4f} ms/step, "
          f"{a.batch / ms * 1e3:.4g} samples/s", flush=True)


if __name__ == "__main__":
    main()
