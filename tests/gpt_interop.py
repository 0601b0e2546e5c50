#!/usr/bin/env python3
"""dptrain's GPT against Hugging Face transformers' GPT2LMHeadModel, fp32 on the CPU:
the same weights (a small random GPT-2 saved by transformers, loaded by dptrain) give the
same logits, loss and gradients; and a GPT initialized by dptrain and exported as a
Hugging Face folder loads with from_pretrained and gives the logits dptrain gives.
Usage: gpt_interop.py GPT_TOOL. Exits 77 (skipped) without torch and transformers."""
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import load_file
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

TOOL = sys.argv[1]
# Small, with a vocabulary that is not a multiple of 64 (dptrain pads it) and T short of the context.
L, H, C, CTX, V = 2, 2, 32, 16, 100
SPEC = f"gpt:L{L}-H{H}-C{C}-T{CTX}-V{V}"
B, T = 3, 11
TOL = 1e-5


def hf_config():
    return transformers.GPT2Config(vocab_size=V, n_positions=CTX, n_embd=C, n_layer=L, n_head=H,
                                   activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                                   bos_token_id=V - 1, eos_token_id=V - 1)


def close(name, ours, theirs, tol=TOL):
    err = (ours - theirs).abs().max().item()
    scale = max(1.0, theirs.abs().max().item())
    if not err <= tol * scale:
        sys.exit(f"FAIL {name}: largest difference {err:.3g} (scale {scale:.3g}, tolerance {tol:g})")
    print(f"ok {name}: largest difference {err:.2g}")


def run_tool(weights, tokens, targets, out):
    tokens.astype(np.int32).tofile(out + ".tokens")
    targets.astype(np.int32).tofile(out + ".targets")
    r = subprocess.run([TOOL, "forward", SPEC, weights, out + ".tokens", out + ".targets", str(B), str(T), out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL gpt_tool forward: {r.stderr.strip()}")
    logits = torch.from_numpy(np.fromfile(out + ".logits", dtype=np.float32).reshape(B, T, V))
    return logits, float(r.stdout), load_file(out + ".grads/model.safetensors")


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, V, size=(B, T + 1))
    tokens, targets = seq[:, :-1], seq[:, 1:]
    with tempfile.TemporaryDirectory() as tmp:
        # transformers' weights into dptrain.
        model = transformers.GPT2LMHeadModel(hf_config()).float().eval()
        model.save_pretrained(os.path.join(tmp, "hf"), safe_serialization=True)
        logits, loss, grads = run_tool(os.path.join(tmp, "hf", "model.safetensors"), tokens, targets,
                                       os.path.join(tmp, "ours"))
        out = model(torch.from_numpy(tokens), labels=None)
        ref_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), torch.from_numpy(targets).reshape(-1))
        ref_loss.backward()
        close("logits", logits, out.logits.detach())
        close("loss", torch.tensor(loss), ref_loss.detach())
        named = dict(model.named_parameters())
        for name, g in grads.items():
            ref = named[name].grad
            close(f"gradient of {name}", g, ref, tol=1e-4)
        if len(grads) != len(named) - (1 if "lm_head.weight" in named else 0):
            sys.exit(f"FAIL gradients: {len(grads)} from dptrain, {len(named)} parameters in transformers")

        # dptrain's initialization out to transformers.
        export = os.path.join(tmp, "export")
        r = subprocess.run([TOOL, "export", SPEC, "7", export], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"FAIL gpt_tool export: {r.stderr.strip()}")
        loaded = transformers.GPT2LMHeadModel.from_pretrained(export).float().eval()
        logits2, loss2, _ = run_tool(os.path.join(export, "model.safetensors"), tokens, targets,
                                     os.path.join(tmp, "ours2"))
        with torch.no_grad():
            close("exported model's logits", logits2, loaded(torch.from_numpy(tokens)).logits)
        std = loaded.transformer.h[0].attn.c_attn.weight.std().item()
        if not 0.015 < std < 0.025:
            sys.exit(f"FAIL initialization: c_attn's std {std:.4f}, GPT-2's is 0.02")
        print(f"ok GPT-2 initialization: c_attn std {std:.4f}")


if __name__ == "__main__":
    main()
