#!/usr/bin/env python3
"""The PyTorch twin of `step_bench --model gpt2`: nanoGPT's GPT (pre-LayerNorm blocks,
F.scaled_dot_product_attention with is_causal, tanh-GELU, the output projection tied to the
token embedding, GPT-2's initialization) trained on a fixed batch of random tokens with
fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings only) and
bf16 autocast (fp32 master weights), eager or torch.compile; timed as torch_bench.py times:
a warm-up, then the median over blocks of steps bracketed by CUDA events.

--gpus N (N > 1) trains with DistributedDataParallel over the first N GPUs, one process
each (torch.multiprocessing, NCCL; gradient_as_bucket_view, DDP's default 25 MiB buckets,
reduced during backward): weak scaling, --batch sequences a GPU (as dpbench's --batch and
llm.c's -b), rank r's the rows r*B .. r*B+B-1 of one draw of random tokens (rank 0's are
the one-GPU run's). Gradients travel in fp32 (DDP's default: autocast leaves the master
gradients in fp32) or, with --grad-comm bf16, through DDP's bf16_compress_hook; a comma
list runs each in turn in the same processes. Times and the loss are rank 0's (the loss
averaged over the ranks).

Prints one line a run:
  torch gpt2 B <B> T <T> <impl>: <ms> ms/step, <n> tokens/s, MFU <p>% of <peak> TFLOPS, peak <MiB> MiB, loss <a> -> <b>
and with --gpus N one line per --grad-comm, tokens/s those of every GPU together, MFU a GPU,
peak rank 0's, then every rank's:
  torch gpt2 B <B> T <T> ddp:<N> <impl> grad-comm <fp32|bf16>: <the same fields>, per-GPU MiB <a> <b> ...
MFU counts 6N + 6LCT flops a token (N the parameters, the padded vocabulary's rows included,
without the position embedding: llm.c's count less that lookup, 0.6% fewer flops at GPT-2
124M) against --peak-tflops, the GPU's dense bf16 peak (989 for an H100 or H200 SXM).
Out of memory ends it with status 3 and one line on stderr:
  torch gpt2 B <B> T <T> <impl>: out of memory (peak <MiB> MiB before it): <PyTorch's message>
(with --gpus N: "... ddp:<N> <impl> grad-comm <g> on rank <r>: out of memory ...", the other ranks ended)."""
import argparse
import gc
import math
import os
import sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from torch_bench import free_port, timed  # torch_bench also turns NVLink multicast off for NCCL

PRESETS = {"gpt2": (12, 12, 768, 1024, 50257), "gpt2-medium": (24, 16, 1024, 1024, 50257)}


def parse_spec(spec):
    if spec in PRESETS:
        return PRESETS[spec]
    f = dict((p[0], int(p[1:])) for p in spec[len("gpt:"):].split("-"))
    return f["L"], f["H"], f["C"], f["T"], f["V"]


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L, H, C, ctx, V):
        super().__init__()
        self.V = V
        Vp = (V + 63) // 64 * 64  # padded as llm.c and dptrain pad it
        self.wte, self.wpe = nn.Embedding(Vp, C), nn.Embedding(ctx, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        logits = logits[..., : self.V]
        return F.cross_entropy(logits.float().view(-1, self.V), targets.view(-1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mode", default="eager", choices=["eager", "compile"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps a timed block")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--gpus", type=int, default=1,
                    help="DistributedDataParallel over this many GPUs, --batch sequences each (default 1: no DDP)")
    ap.add_argument("--grad-comm", default="fp32",
                    help="with --gpus N: the gradients' type on the wire, a comma list of fp32 and bf16 "
                         "(bf16: DDP's bf16_compress_hook)")
    a = ap.parse_args()
    a.grad_comm = a.grad_comm.split(",")
    if any(g not in ("fp32", "bf16") for g in a.grad_comm):
        ap.error(f"--grad-comm takes fp32 and bf16, got {','.join(a.grad_comm)}")
    if a.gpus < 1 or (a.gpus > 1 and a.gpus > torch.cuda.device_count()):
        ap.error(f"--gpus must be between 1 and the {torch.cuda.device_count()} GPU(s) here")
    if a.gpus == 1 and a.grad_comm != ["fp32"]:
        ap.error("--grad-comm is for --gpus 2 or more (one GPU communicates nothing)")
    if a.gpus > 1:
        return run_ddp(a)
    try:
        run(a)
    except Exception as e:  # torch.compile's errors keep out of memory as their cause
        oom = out_of_memory(e)
        if oom is None:
            raise
        # One line and status 3, as dptrain ends out of memory, so that gpt_max_batch.sh
        # tells it from a failure; the allocator's advice that follows is left out.
        text = " ".join(str(oom).split()).split(" If reserved but unallocated")[0]
        peak = torch.cuda.max_memory_allocated(torch.device("cuda:0")) / 2**20
        print(f"torch {a.model} B {a.batch} T {a.seq} {a.mode}: out of memory (peak {peak:.0f} MiB before it): {text}",
              file=sys.stderr)
        return 3
    return 0


def out_of_memory(e):
    """CUDA's out of memory: e, or the exception e was raised from or during that is; or None."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, oom) or any(s in str(e) for s in ("CUDA out of memory", "CUDA error: out of memory")):
            return e
        e = e.__cause__ or e.__context__
    return None


def make_step(a, dev, rank=0, world=1, grad_comm=None):
    """The model, fused AdamW and a fixed batch on `dev`; returns (step, model). With
    grad_comm (a DDP rank): the model wrapped in DistributedDataParallel, compiled first as
    nanoGPT compiles it, and rows rank*B .. rank*B+B-1 of a draw of world*B sequences."""
    torch.manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    L, H, C, ctx, V = parse_spec(a.model)
    model = GPT(L, H, C, ctx, V).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if a.mode == "compile" else model
    if grad_comm is not None:
        fwd = DistributedDataParallel(fwd, device_ids=[dev.index], gradient_as_bucket_view=True)
        if grad_comm == "bf16":
            fwd.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    g = torch.Generator(device="cpu").manual_seed(2)
    seq = torch.randint(0, V, (world * a.batch, a.seq + 1), generator=g)[rank * a.batch:(rank + 1) * a.batch].to(dev)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model


def result_line(a, impl, model, ms, peak, first, last, world=1):
    """The line a run prints: tokens/s of every GPU together, MFU a GPU."""
    L, _, C, _, _ = parse_spec(a.model)
    tokens = a.batch * a.seq * world
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    flops = (6 * n + 6 * L * C * a.seq) * tokens / world
    mfu = flops / (ms / 1e3) / (a.peak_tflops * 1e12) * 100
    return (f"torch {a.model} B {a.batch} T {a.seq} {impl}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s, "
            f"MFU {mfu:.1f}% of {a.peak_tflops:g} TFLOPS, peak {peak:.0f} MiB, loss {first:.4f} -> {last:.4f}")


def run(a):
    dev = torch.device("cuda:0")
    step, model = make_step(a, dev)
    first, ms, loss = timed(a, step, [dev])
    peak = torch.cuda.max_memory_allocated(dev) / 2**20
    print(result_line(a, a.mode, model, ms, peak, first, loss.item()))


def ddp_worker(rank, a, port):
    """One DDP rank: every --grad-comm in turn, each with a fresh model, optimizer and peak."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=rank, world_size=a.gpus, device_id=dev)
    impl = f"ddp:{a.gpus} {a.mode}"
    for grad_comm in a.grad_comm:
        try:
            gc.collect()  # the previous wire's DDP and optimizer gone before the peak is reset
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            step, model = make_step(a, dev, rank, a.gpus, grad_comm)
            first, ms, loss = timed(a, step, [dev])
        except Exception as e:
            oom = out_of_memory(e)
            if oom is None:
                raise
            text = " ".join(str(oom).split()).split(" If reserved but unallocated")[0]
            peak = torch.cuda.max_memory_allocated(dev) / 2**20
            print(f"torch {a.model} B {a.batch} T {a.seq} {impl} grad-comm {grad_comm} on rank {rank}: out of memory "
                  f"(peak {peak:.0f} MiB before it): {text}", file=sys.stderr, flush=True)
            os._exit(3)  # no collective waits for the others: spawn ends them
        losses = torch.tensor([first, loss.item()], device=dev) / a.gpus
        dist.all_reduce(losses)
        peaks = [None] * a.gpus
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(dev) / 2**20)
        if rank == 0:
            line = result_line(a, f"{impl} grad-comm {grad_comm}", model, ms, peaks[0], losses[0].item(),
                               losses[1].item(), a.gpus)
            print(line + ", per-GPU MiB " + " ".join(f"{p:.0f}" for p in peaks), flush=True)
        del step, model
    dist.destroy_process_group()


def run_ddp(a):
    try:
        mp.spawn(ddp_worker, args=(a, free_port()), nprocs=a.gpus, join=True)
    except mp.ProcessExitedException as e:
        if e.exit_code == 3:  # a rank ran out of memory and said so
            return 3
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
