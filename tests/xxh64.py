"""xxHash's XXH64 (seed 0) in Python: the checksum dptrain keeps of each tensor of a
checkpoint ("checksum:NAME": "xxh64:" and 16 hex digits), for the tests that write or
check checkpoints without dptrain."""
M, P1, P2, P3, P4, P5 = (1 << 64) - 1, 11400714785074694791, 14029467366897019727, 1609587929392839161, \
    9650029242287828579, 2870177450012600261
def xxh64(b):
    rotl = lambda x, r: ((x << r) | (x >> (64 - r))) & M
    rnd = lambda acc, v: rotl((acc + v * P2) & M, 31) * P1 & M
    word = lambda i, n: int.from_bytes(b[i:i + n], "little")
    i, n = 0, len(b)
    if n >= 32:
        v = [(P1 + P2) & M, P2, 0, (-P1) & M]
        while n - i >= 32:
            v = [rnd(v[k], word(i + 8 * k, 8)) for k in range(4)]
            i += 32
        h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & M
        for x in v:
            h = ((h ^ rnd(0, x)) * P1 + P4) & M
    else:
        h = P5
    h = (h + n) & M
    while n - i >= 8:
        h = (rotl(h ^ rnd(0, word(i, 8)), 27) * P1 + P4) & M
        i += 8
    if n - i >= 4:
        h = (rotl(h ^ (word(i, 4) * P1 & M), 23) * P2 + P3) & M
        i += 4
    for c in b[i:]:
        h = rotl(h ^ (c * P5 & M), 11) * P1 & M
    h = (h ^ (h >> 33)) * P2 & M
    h = (h ^ (h >> 29)) * P3 & M
    return h ^ (h >> 32)


assert xxh64(b"Nobody inspects the spammish repetition") == 0xfbcea83c8a378bf1
