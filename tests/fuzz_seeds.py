#!/usr/bin/env python3
"""Writes the seed corpus of the checkpoint fuzzer (tests/fuzz_corpus/): a few tiny valid
safetensors files that between them reach every part of the header grammar (metadata,
each dtype, scalars, empty tensors, keys out of offset order, whitespace, escapes).
Usage: fuzz_seeds.py DIR"""
import struct
import sys
from pathlib import Path


def safetensors(header: str, data: bytes = b"", pad: bool = True) -> bytes:
    raw = header.encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


SEEDS = {
    "empty.safetensors": safetensors("{}"),
    "metadata.safetensors": safetensors('{"__metadata__":{"step":"10","model":"16-128x2-4"}}'),
    "dtypes.safetensors": safetensors(
        '{"__metadata__":{"step":"1"},'
        '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
        '"b":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]},'
        '"t":{"dtype":"I32","shape":[],"data_offsets":[20,24]},'
        '"e":{"dtype":"F32","shape":[0,3],"data_offsets":[24,24]}}',
        struct.pack("<4f", 1.0, -2.0, 0.5, 3.0) + bytes([0x80, 0x3F, 0x00, 0xC0]) + struct.pack("<i", 7)),
    "reordered.safetensors": safetensors(
        '{ "b" : {"shape":[1],"dtype":"I32","data_offsets":[4,8]},\n'
        '\t"a\\u00e9\\ud83d\\ude00":{"data_offsets":[0,4],"dtype":"F32","shape":[1]},'
        '"__metadata__":{"k\\n":"\\"\\\\\\/\\b\\f\\r\\t"}}\n',
        bytes(8), pad=False),
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, content in SEEDS.items():
        (out / name).write_bytes(content)
