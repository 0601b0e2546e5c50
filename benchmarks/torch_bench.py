#!/usr/bin/env python3
"""The PyTorch twin of step_bench and dpbench: the same workload (an MLP with ReLU and
MSE, or a CNN of dptrain's spec grammar with cross-entropy on random labels; SGD lr 0.01;
PyTorch's default initialisation, which dptrain copies: uniform in +-1/sqrt(fan in)) on a
fixed random batch, timed the same way (warm-up, then the median over
timed blocks of steps, each block bracketed by CUDA events on the master GPU).

Modes:
  eager  one GPU, the plain training step
  graph  one GPU, the whole step (forward, loss, backward, SGD) captured once in a CUDA
         graph and replayed, as in PyTorch's "whole network capture" recipe
  dp     torch.nn.DataParallel over the first --gpus GPUs (the batch lives on cuda:0)
  ddp    DistributedDataParallel, one process per GPU started here (NCCL), each rank
         taking its contiguous shard of the batch

--batch is the global batch in every mode. Prints one line per run:
  torch <model> batch <B> <prec> <impl>: <ms> ms/step, <n> samples/s, peak <MiB> MiB, loss <a> -> <b>
with impl eager, graph, dp:<gpus> or ddp:<gpus>; peak is cuda:0's, and the multi-GPU
modes add every GPU's peak at the end ("per-GPU MiB a b ...").

A GPT (--model gpt2, gpt2-medium or gpt:SPEC) is torch_gpt_bench.py's: the arguments go to
it (its modes are eager and compile)."""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

# NVLink multicast can take a shared host's GPUs down (GPU.md). Set at import time, so
# that it holds in this process and in every one that the ddp mode spawns (a spawned
# process imports this file again) before NCCL starts.
os.environ["NCCL_NVLS_ENABLE"] = "0"

SEED = 1
LR = 0.01


CNN_PRESETS = {"cnn-small": "cnn:3x16x16-c16k3-p2-c32k3-p2-f10",
               "cnn": "cnn:3x32x32-c64k3-bn-p2-c128k3-bn-p2-c256k3-bn-p2-g-f10"}


def is_cnn(spec):
    return spec.startswith("cnn")


def cnn_layers(spec):
    """The torch twin of a dptrain CNN spec (README, "Convolutional networks"): returns
    (layers, input shape [C, H, W], classes). cNkK[sS][pP][dD] is Conv2d with padding
    D*(K-1)//2 by default, then BatchNorm2d when `bn` follows, then ReLU; pK / aK pool
    with stride K by default; g is global average pooling; fN is Linear (a Flatten before
    the first), ReLU after every one but the last."""
    import re
    toks = CNN_PRESETS.get(spec, spec)[len("cnn:"):].split("-")
    c, h, w = (int(v) for v in toks[0].split("x"))
    layers, flat = [], None
    i = 1
    while i < len(toks):
        t = toks[i]
        m = re.fullmatch(r"c(\d+)k(\d+)(?:s(\d+))?(?:p(\d+))?(?:d(\d+))?", t)
        if m:
            n, k, st, pd, dl = (int(v) if v else None for v in m.groups())
            st, dl = st or 1, dl or 1
            pd = dl * (k - 1) // 2 if pd is None else pd
            layers.append(torch.nn.Conv2d(c, n, k, stride=st, padding=pd, dilation=dl))
            c, h, w = n, (h + 2 * pd - dl * (k - 1) - 1) // st + 1, (w + 2 * pd - dl * (k - 1) - 1) // st + 1
            if i + 1 < len(toks) and toks[i + 1] == "bn":
                layers.append(torch.nn.BatchNorm2d(c))
                i += 1
            layers.append(torch.nn.ReLU())
        elif t == "bn":
            layers.append(torch.nn.BatchNorm2d(c))
        elif re.fullmatch(r"[pa]\d+(?:s\d+)?(?:p\d+)?", t):
            k, st, pd = (int(v) if v else None for v in re.fullmatch(r"[pa](\d+)(?:s(\d+))?(?:p(\d+))?", t).groups())
            st, pd = st or k, pd or 0
            pool = torch.nn.MaxPool2d if t[0] == "p" else torch.nn.AvgPool2d
            layers.append(pool(k, stride=st, padding=pd))
            h, w = (h + 2 * pd - k) // st + 1, (w + 2 * pd - k) // st + 1
        elif t == "g":
            layers.append(torch.nn.AdaptiveAvgPool2d(1))
            h = w = 1
        elif t.startswith("f"):
            if flat is None:
                layers.append(torch.nn.Flatten())
                flat = c * h * w
            layers.append(torch.nn.Linear(flat, int(t[1:])))
            flat = int(t[1:])
            if i + 1 < len(toks):
                layers.append(torch.nn.ReLU())
        else:
            raise SystemExit(f"torch_bench: CNN layer '{t}' not understood")
        i += 1
    return layers, toks[0], flat


def widths(spec):
    spec = {"seed": "1000-1000", "mlp": "1024-4096x3-1024"}.get(spec, spec)
    out = []
    for tok in spec.split("-"):
        w, _, r = tok.partition("x")
        out += [int(w)] * (int(r) if r else 1)
    return out


def split(batch, n):
    """Shard sizes as dptrain's DataParallel::split makes them: contiguous, differing by
    at most one, the first ones larger."""
    return [batch // n + (1 if i < batch % n else 0) for i in range(n)]


def configure(a):
    torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
    torch.backends.cudnn.allow_tf32 = a.precision == "tf32"


def build(a, dev):
    torch.manual_seed(SEED)  # every rank starts from the same weights
    if is_cnn(a.model):
        return torch.nn.Sequential(*cnn_layers(a.model)[0]).to(dev)
    w = widths(a.model)
    layers = []
    for i in range(len(w) - 1):
        layers.append(torch.nn.Linear(w[i], w[i + 1]))
        if i + 2 < len(w):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).to(dev)


def fixed_batch(a, first, count, dev):
    """Rows [first, first + count) of the global batch, made once from SEED on the host,
    so that every mode and every rank sees the same data."""
    g = torch.Generator().manual_seed(SEED)
    if is_cnn(a.model):  # random images, random labels
        _, shape, classes = cnn_layers(a.model)
        x = torch.randn(a.batch, *(int(v) for v in shape.split("x")), generator=g)
        y = torch.randint(classes, (a.batch,), generator=g)
    else:
        w = widths(a.model)
        x = torch.randn(a.batch, w[0], generator=g)
        y = torch.randn(a.batch, w[-1], generator=g)
    return x[first:first + count].to(dev), y[first:first + count].to(dev)


def make_step(a, model, opt, x, y, cache_casts=True):
    loss_fn = torch.nn.CrossEntropyLoss() if is_cnn(a.model) else torch.nn.MSELoss()

    def step():
        opt.zero_grad(set_to_none=True)
        # bf16: GEMMs on bf16 tensor cores, fp32 master weights (autocast).
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16",
                            cache_enabled=cache_casts):
            out = model(x)
        loss = loss_fn(out.float(), y)
        loss.backward()
        opt.step()
        return loss

    return step


def make_graph_step(a, model, opt, x, y):
    """Captures one whole step in a CUDA graph. Returns (replay, first loss, steps done).
    Three eager steps run on a side stream before the capture, as PyTorch's
    documentation asks (lazy initialisation, cuBLAS workspaces and autograd's stream
    use then happen outside the graph); the rest of --warmup are replays. Autocast's
    cast cache is off because cached casts made during capture would be freed behind
    the graph's back."""
    eager = make_step(a, model, opt, x, y, cache_casts=False)
    warm = 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first = eager().item()
        for _ in range(warm - 1):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # Gradients set to None before the capture: the captured backward then writes them
    # (into the graph's memory pool) instead of accumulating.
    opt.zero_grad(set_to_none=True)
    loss_fn = torch.nn.CrossEntropyLoss() if is_cnn(a.model) else torch.nn.MSELoss()
    with torch.cuda.graph(graph):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16", cache_enabled=False):
            out = model(x)
        static_loss = loss_fn(out.float(), y)
        static_loss.backward()
        opt.step()

    def replay():
        graph.replay()
        return static_loss

    return replay, first, warm


def timed(a, step, devices, first=None, done=0):
    """Warm-up (the steps not `done` yet), then a.blocks blocks of a.steps steps, each
    timed by CUDA events on the current device; returns (first loss, median ms per
    step, last loss). Every device is synchronized after a block, so a block ends only
    when all of its work has."""
    if first is None:
        first = step().item()
        done = 1
    for _ in range(a.warmup - done):
        step()
    for d in devices:
        torch.cuda.synchronize(d)
    times = []
    loss = None
    for _ in range(a.blocks):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.steps):
            loss = step()
        end.record()
        for d in devices:
            torch.cuda.synchronize(d)
        times.append(start.elapsed_time(end) / a.steps)
    times.sort()
    return first, times[len(times) // 2], loss


def report(a, impl, ms, peaks, first, last):
    line = (f"torch {a.model} batch {a.batch} {a.precision} {impl}: {ms:.4f} ms/step, "
            f"{1e3 * a.batch / ms:.4g} samples/s, peak {peaks[0]:.1f} MiB, loss {first:.5g} -> {last:.5g}")
    if impl not in ("eager", "graph"):
        line += ", per-GPU MiB " + " ".join(f"{p:.1f}" for p in peaks)
    print(line, flush=True)


def peak_mib(dev):
    return torch.cuda.max_memory_allocated(dev) / 2**20


def run_single(a):
    dev = torch.device("cuda:0")
    model = build(a, dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch(a, 0, a.batch, dev)
    if a.mode == "graph":
        replay, first, done = make_graph_step(a, model, opt, x, y)
        first, ms, loss = timed(a, replay, [dev], first, done)
    else:
        first, ms, loss = timed(a, make_step(a, model, opt, x, y), [dev])
    report(a, a.mode, ms, [peak_mib(dev)], first, loss.item())


def run_dp(a):
    devices = [torch.device(f"cuda:{i}") for i in range(a.gpus)]
    model = build(a, devices[0])
    dp = torch.nn.DataParallel(model, device_ids=list(range(a.gpus)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = fixed_batch(a, 0, a.batch, devices[0])
    first, ms, loss = timed(a, make_step(a, dp, opt, x, y), devices)
    report(a, f"dp:{a.gpus}", ms, [peak_mib(d) for d in devices], first, loss.item())


def ddp_worker(rank, a, port):
    configure(a)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=a.gpus, device_id=dev)
    try:
        sizes = split(a.batch, a.gpus)
        x, y = fixed_batch(a, sum(sizes[:rank]), sizes[rank], dev)
        model = DistributedDataParallel(build(a, dev), device_ids=[rank])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        first, ms, loss = timed(a, make_step(a, model, opt, x, y), [dev])
        # The batch's loss: the shard losses weighted by shard size, as dptrain reports it.
        losses = torch.tensor([first, loss.item()], device=dev) * (sizes[rank] / a.batch)
        dist.all_reduce(losses)
        peaks = [None] * a.gpus
        dist.all_gather_object(peaks, peak_mib(dev))
        if rank == 0:
            report(a, f"ddp:{a.gpus}", ms, peaks, losses[0].item(), losses[1].item())
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--model", default="seed")
    model = peek.parse_known_args()[0].model
    if model in ("gpt2", "gpt2-medium") or model.startswith("gpt:"):
        import torch_gpt_bench  # step_bench's GPT twin
        return torch_gpt_bench.main()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="seed")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--mode", default="eager", choices=["eager", "graph", "dp", "ddp"])
    ap.add_argument("--gpus", type=int, default=1, help="GPUs for dp and ddp")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed block")
    a = ap.parse_args()
    if a.gpus < 1 or a.gpus > torch.cuda.device_count():
        ap.error(f"--gpus must be between 1 and the {torch.cuda.device_count()} GPU(s) here")
    if a.gpus > 1 and a.mode in ("eager", "graph"):
        ap.error(f"--mode {a.mode} runs on one GPU; use --mode dp or ddp for --gpus {a.gpus}")
    if a.batch < a.gpus:
        ap.error(f"--batch {a.batch} is smaller than --gpus {a.gpus}")
    if min(a.warmup, a.blocks, a.steps) < 1:
        ap.error("--warmup, --blocks and --steps must be at least 1")
    configure(a)
    if a.mode == "ddp":
        mp.spawn(ddp_worker, args=(a, free_port()), nprocs=a.gpus, join=True)
    elif a.mode == "dp":
        run_dp(a)
    else:
        run_single(a)


if __name__ == "__main__":
    sys.exit(main())  # a GPT run's status (3: out of memory) is torch_gpt_bench's
