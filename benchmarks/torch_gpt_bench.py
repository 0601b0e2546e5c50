#!/usr/bin/env python3
"""The PyTorch twin of `step_bench --model gpt2`: nanoGPT's GPT (pre-LayerNorm blocks,
F.scaled_dot_product_attention with is_causal, tanh-GELU, the output projection tied to the
token embedding, GPT-2's initialization) trained on a fixed batch of random tokens with
fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings only) and
bf16 autocast (fp32 master weights), eager or torch.compile; timed as torch_bench.py times:
a warm-up, then the median over blocks of steps bracketed by CUDA events.

Prints one line a run:
  torch gpt2 B <B> T <T> <impl>: <ms> ms/step, <n> tokens/s, MFU <p>% of <peak> TFLOPS, peak <MiB> MiB, loss <a> -> <b>
MFU counts 6N + 6LCT flops a token (N the parameters without the position embedding, as
llm.c counts) against --peak-tflops, the GPU's dense bf16 peak (989 for an H100 or H200 SXM).
Out of memory ends it with status 3 and one line on stderr:
  torch gpt2 B <B> T <T> <impl>: out of memory (peak <MiB> MiB before it): <PyTorch's message>"""
import argparse
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_bench import timed

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
    a = ap.parse_args()
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


def run(a):
    torch.manual_seed(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    L, H, C, ctx, V = parse_spec(a.model)
    dev = torch.device("cuda:0")
    model = GPT(L, H, C, ctx, V).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if a.mode == "compile" else model
    g = torch.Generator(device="cpu").manual_seed(2)
    seq = torch.randint(0, V, (a.batch, a.seq + 1), generator=g).to(dev)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first, ms, loss = timed(a, step, [dev])
    tokens = a.batch * a.seq
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    flops = (6 * n + 6 * L * C * a.seq) * tokens
    mfu = flops / (ms / 1e3) / (a.peak_tflops * 1e12) * 100
    peak = torch.cuda.max_memory_allocated(dev) / 2**20
    print(f"torch {a.model} B {a.batch} T {a.seq} {a.mode}: {ms:.2f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s, "
          f"MFU {mfu:.1f}% of {a.peak_tflops:g} TFLOPS, peak {peak:.0f} MiB, loss {first:.4f} -> {loss.item():.4f}")


if __name__ == "__main__":
    sys.exit(main())
