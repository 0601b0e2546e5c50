#!/usr/bin/env python3
"""PyTorch's loop over the same .npy files dptrain trains on (--data): the files opened
with np.load(mmap_mode="r"), a DataLoader with worker processes and pinned memory
gathering each batch's rows (shuffled every epoch, or in file order), the batch copied to
the GPU without blocking, and the MLP of dptrain's spec (ReLU, MSE, SGD lr 0.01, bf16 by
autocast) trained on it. The loss is read every --log-every steps, as dptrain reads it.
Prints one line:
  torch-file <model> batch <B> <prec>: <ms> ms/step, <n> samples/s (steps after the warm-up)"""
import argparse
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from torch_bench import widths as spec_widths  # dptrain's MLP spec grammar


class Rows(Dataset):
    """Rows of two memory-mapped arrays; a batch of indices is gathered at once."""

    def __init__(self, x_path, y_path):
        self.x = np.load(x_path, mmap_mode="r")
        self.y = np.load(y_path, mmap_mode="r")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.__getitems__([i])

    def __getitems__(self, indices):
        idx = np.sort(np.asarray(indices))  # a sorted gather reads the mapping in order
        return torch.from_numpy(np.take(self.x, idx, axis=0)), torch.from_numpy(np.take(self.y, idx, axis=0))


def mlp(spec):
    widths = spec_widths(spec)
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--x", required=True)
    ap.add_argument("--y", required=True)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--log-every", type=int, default=1000)
    ap.add_argument("--no-shuffle", action="store_true")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
    dev = torch.device("cuda:0")
    torch.manual_seed(1)
    model = mlp(a.model).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Rows(a.x, a.y), batch_size=a.batch, shuffle=not a.no_shuffle, num_workers=a.workers,
                        pin_memory=True, collate_fn=lambda b: b, persistent_workers=a.workers > 0,
                        prefetch_factor=4 if a.workers > 0 else None, drop_last=True)
    batches = iter(loader)

    def next_batch():
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:  # the next epoch
            batches = iter(loader)
            return next(batches)

    def step(i):
        xb, yb = next_batch()
        xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = torch.nn.functional.mse_loss(model(xb).float(), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (i + 1) % a.log_every == 0:
            loss.item()

    for i in range(a.warmup):
        step(i)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(a.steps):
        step(a.warmup + i)
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / a.steps
    print(f"torch-file {a.model} batch {a.batch} {a.precision}: {ms:.4f} ms/step, "
          f"{a.batch / ms * 1e3:.4g} samples/s")


if __name__ == "__main__":
    main()
