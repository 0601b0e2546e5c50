#!/usr/bin/env python3
"""Writes the seed corpus of a fuzzer. For the checkpoint fuzzer (tests/fuzz_corpus/): a
few tiny valid safetensors files that between them reach every part of the header grammar
(metadata, each dtype, scalars, empty tensors, keys out of offset order, whitespace,
escapes). For the .npy fuzzer (tests/fuzz_corpus_npy/): tiny valid .npy files of every
version and dtype, in numpy's layout and in the other forms the reader accepts (16-byte
alignment, keys in any order, double quotes, Python 2's long integers).
Usage: fuzz_seeds.py DIR [checkpoint|npy]"""
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

def npy(dict_text: str, data: bytes, major: int = 1, align: int = 64) -> bytes:
    prefix = 10 if major == 1 else 12
    header = dict_text.encode()
    header += b" " * (-(prefix + len(header) + 1) % align) + b"\n"
    length = struct.pack("<H" if major == 1 else "<I", len(header))
    return b"\x93NUMPY" + bytes([major, 0]) + length + header + data


def npy_dict(descr: str, shape: str) -> str:
    return "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (descr, shape)


NPY_SEEDS = {
    "f4_v1.npy": npy(npy_dict("<f4", "(2, 3)"), struct.pack("<6f", 1, -2, 0.5, 3, 0, 7)),
    "f8_v2.npy": npy(npy_dict("<f8", "(2,)"), struct.pack("<2d", 1.5, -0.25), major=2),
    "f2_v3.npy": npy(npy_dict("<f2", "(1, 1, 1, 2)"), bytes([0x00, 0x3C, 0x00, 0xC0]), major=3),
    "u1_scalar.npy": npy(npy_dict("|u1", "()"), bytes([200])),
    "i4_empty.npy": npy(npy_dict("<i4", "(0, 5)"), b""),
    "i8_old.npy": npy("{'descr': '<i8', 'fortran_order': False, 'shape': (2L,), }", struct.pack("<2q", -1, 9), align=16),
    "reordered.npy": npy('{"shape": (1,), "descr": "<f4", "fortran_order": False}', struct.pack("<f", 2)),
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    kind = sys.argv[2] if len(sys.argv) > 2 else "checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    for name, content in (NPY_SEEDS if kind == "npy" else SEEDS).items():
        (out / name).write_bytes(content)
