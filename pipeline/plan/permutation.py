"""A keyed bijection on [0, n): the shuffle behind every shard order and window order.

The data order is part of what a ledger records, so the shuffle is ours and fixed here, not a
dependency's: NumPy does not promise that `Generator.permutation` streams stay the same across
versions (NEP 19), and Grain's `index_shuffle` is an unversioned internal. Changing anything in
this module changes the data order: bump `pipeline.plan.ledger.ORDER_VERSION` with it.

The algorithm (order version 2), for n >= 1 and round keys k_0 .. k_5 (64-bit integers):

* m = max(`MIN_BITS` = 6, bit length of n - 1). An m-bit x is split into a high part of
  h = ceil(m / 2) bits and a low part of l = floor(m / 2) bits.
* One Feistel round with key k: with L = x >> l and R = x mod 2^l,
  x' = R * 2^h + ((L xor F(R xor k)) mod 2^h), then h and l swap for the next round.
  F is the SplitMix64 finalizer on 64-bit words:
  z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31.
* E(x) is `ROUNDS` = 6 rounds with keys k_0 .. k_5 in order: a bijection on [0, 2^m).
* perm(i) for i < n is E(i), then E again while the value is >= n (cycle walking: the first
  value of i's cycle that is inside [0, n), so perm is a bijection on [0, n); for n > 32,
  2^m < 2n, so fewer than two evaluations of E are expected per index).
* `round_keys(seed, purpose, *parts)` are k_r = keyed_hash(seed, purpose, *parts, r)
  (`pipeline.keys`: BLAKE2b of the parts joined by NUL bytes).

Why the floor of 6 bits: a Feistel network makes only even permutations of its 2^m values and
is far from uniform when its halves have 1 or 2 bits, which showed as biased orders of a few
items; walking on at least 64 values makes the orders of small n uniform (tests/
test_permutation.py counts them), at the cost of ~64 / n evaluations of E per index for small n.

Every index walks its own cycle, so `permute` gives a few draws at any step in O(draws) (in
plain Python integers for up to `FEW` of them, in NumPy for more), and `permutation` an epoch's
whole order in one pass of E over the 2^m values; the three give the same values
(tests/test_permutation.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import cache

import numpy as np

from pipeline.keys import keyed_digests

ROUNDS = 6  # Luby-Rackoff: 4 rounds of a pseudorandom F make a strong pseudorandom permutation
MIN_BITS = 6
MAX_N = 1 << 62
JUMP_VALUES = 1 << 16  # `_walked` jumps pointers on tables of up to this many values in all
FEW = 64  # up to this many indices, `permute` walks them in plain integers (measured crossover)

_MASK64 = (1 << 64) - 1
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's finalizer multipliers
_M1, _M2 = np.uint64(_C1), np.uint64(_C2)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def round_keys(seed: int, purpose: str, *parts: object) -> np.ndarray:
    """The `ROUNDS` 64-bit round keys of the permutation named by (seed, purpose, parts)."""
    return many_round_keys([(seed, purpose, *parts)])[0]


def many_round_keys(names: Iterable[Sequence[object]]) -> np.ndarray:
    """[G, ROUNDS]: `round_keys(*name)` of each of G names (seed, purpose, *parts), from one
    buffer of their hashes (`keys.keyed_digests`)."""
    digests = np.frombuffer(keyed_digests(names, ROUNDS), dtype="<u8")
    return digests.astype(np.uint64).reshape(-1, ROUNDS)


def permute(index: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """perm(index) on [0, n) under `keys`: [ROUNDS] for all, or index.shape + [ROUNDS] each.

    Costs O(len(index)) whatever n is: each index walks its own cycle.
    """
    index = np.asarray(index, dtype=np.int64)
    keys = np.asarray(keys, dtype=np.uint64)
    bits = _bits(n)
    if index.size and (index.min() < 0 or index.max() >= n):
        raise ValueError(f"indices must be in [0, {n})")
    if keys.shape not in ((ROUNDS,), (*index.shape, ROUNDS)):
        raise ValueError(f"keys must have shape ({ROUNDS},) or {(*index.shape, ROUNDS)}")
    if index.size <= FEW:  # plain integers: cheaper than ~90 NumPy calls per walk step
        flat = keys.reshape(-1, ROUNDS).tolist()
        each = flat * index.size if keys.ndim == 1 else flat
        out = [_walk_one(i, n, k, bits) for i, k in zip(index.ravel().tolist(), each)]
        return np.array(out, dtype=np.int64).reshape(index.shape)
    x = index.astype(np.uint64).ravel()
    keys = keys if keys.ndim == 1 else keys.reshape(-1, ROUNDS)
    todo = np.arange(x.size) if n > 1 else np.empty(0, np.int64)
    while todo.size:  # cycle walking: encrypt again what fell outside [0, n)
        x[todo] = _encrypt(x[todo], keys if keys.ndim == 1 else keys[todo], bits)
        todo = todo[x[todo] >= n]
    return x.astype(np.int64).reshape(index.shape)


def permutation(n: int, keys: np.ndarray) -> np.ndarray:
    """The whole order, position p holding perm(p): the same values as `permute(arange(n))`.

    E is computed once for all 2^m < max(64, 2n) values and the walks follow that table, so a
    small order costs one pass of E instead of one per step of its longest walk.
    """
    keys = np.asarray(keys, dtype=np.uint64)
    if keys.shape != (ROUNDS,):
        raise ValueError(f"keys must have shape ({ROUNDS},)")
    return permutations(n, keys[None])[0]


def permutations(n: int, keys: np.ndarray) -> np.ndarray:
    """[G, n]: `permutation(n, keys[g])` of each of G sets of round keys ([G, ROUNDS]), in one
    pass of E over G tables: a small order's cost is its ~60 numpy calls, not its values, so
    G small orders together cost about what one does (`layout.keyed_order` computes the next
    epochs' orders with the one it needs)."""
    keys = np.asarray(keys, dtype=np.uint64)
    bits = _bits(n)
    if keys.ndim != 2 or keys.shape[1] != ROUNDS:
        raise ValueError(f"keys must have shape (G, {ROUNDS})")
    return _walked(np.full(len(keys), n, dtype=np.int64), keys, bits).reshape(len(keys), n)


def orders(ns: list[int], keys: np.ndarray) -> list[np.ndarray]:
    """`permutation(ns[g], keys[g])` of each g ([G, ROUNDS] keys), the orders of one width m
    computed in one pass of E over their tables and walked together: a restore's first steps
    need the orders of dozens of sources at once, ~60 numpy calls each on its own. The orders
    of one width are read-only views of one array."""
    keys = np.asarray(keys, dtype=np.uint64)
    if keys.shape != (len(ns), ROUNDS):
        raise ValueError(f"keys must have shape ({len(ns)}, {ROUNDS})")
    out: list[np.ndarray] = [np.empty(0, np.int64)] * len(ns)
    widths: dict[int, list[int]] = {}
    bits = {n: _bits(n) for n in set(ns)}  # a restore's orders have a few sizes
    for g, n in enumerate(ns):
        widths.setdefault(bits[n], []).append(g)
    for width, members in widths.items():
        n = [ns[g] for g in members]
        walked, ends = _walked(np.array(n, dtype=np.int64), keys[members], width), [0]
        walked.flags.writeable = False  # and so are its views
        for size in n:
            ends.append(ends[-1] + size)
        for g, lo, hi in zip(members, ends, ends[1:]):
            out[g] = walked[lo:hi]
    return out


def _walked(n: np.ndarray, keys: np.ndarray, bits: int) -> np.ndarray:
    """The orders of G tables of width `bits` (n[g] values of table g, under keys[g]) end to
    end: E of every value of each table (`_tables`), then every walk at once.

    Small tables' walks jump pointers: `jump[v]` is v itself for a value v inside its [0, n)
    (where a walk stops) and E(v) for one outside; each pass squares `jump` (`jump[jump]`), so
    pass t carries a walk 2^t steps on or to its end, and the longest of hundreds of walks
    (~40 steps of E for n = 8 on 64 values) takes ~6 passes of one gather, not ~6 numpy calls
    a step. Above `JUMP_VALUES` values, where a pass over the tables costs more than its
    calls, the unfinished walks step on together, fewer each step."""
    size = 1 << bits
    if not n.size:
        return np.empty(0, np.int64)
    table = _tables(keys, bits)
    inside = np.arange(size) < n[:, None]  # [G, 2^m]: where a walk stops
    after = table + np.arange(0, table.size, size, dtype=np.int64)[:, None]  # laid end to end
    first = after[inside]  # each order's first step from its [0, n)
    inside, after = inside.reshape(-1), after.reshape(-1)
    if after.size > JUMP_VALUES:
        todo = np.flatnonzero(~inside[first])
        for _ in range(size):  # a walk is shorter than the 2^m values of its table
            if not todo.size:
                break
            first[todo] = after[first[todo]]
            todo = todo[~inside[first[todo]]]
        return first & (size - 1)
    jump = np.where(inside, np.arange(after.size), after)
    for _ in range((size // int(n.min())).bit_length() - 1):  # ~2^m / n steps: not checked
        jump = jump[jump]
    for _ in range(bits + 1):  # a walk is shorter than the 2^m values of its table
        walked = jump[first]
        if inside[walked].all():
            break
        jump = jump[jump]
    return walked & (size - 1)


def _tables(keys: np.ndarray, bits: int) -> np.ndarray:
    """[G, 2^bits]: E of every `bits`-bit value under each of G sets of round keys.

    A round's F reads only the 2^l values of its low half R, and the new high half keeps the
    low h bits of F: x' = R * 2^h + (L xor F(R)) mod 2^h = T(R) xor L with T(R) = R * 2^h +
    F(R xor k) mod 2^h, so T is computed once per (keys, round) for the ~2^(m/2) values of R
    and every value's round is a lookup of it: the SplitMix64 products on a few values instead
    of all 2^m, and 5 numpy calls a round instead of 15 (the same numbers as `_encrypt`)."""
    count, size = len(keys), 1 << bits
    halves, right, masks, parts = _rounds(bits)
    z = keys.T[:, :, None] ^ right  # [ROUNDS, G, 2^h]: F's input (past 2^l: never looked up)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    z &= masks
    z |= parts
    t = z.astype(np.int64).reshape(ROUNDS, -1)  # each round's T of (G, R), laid end to end
    rows = np.repeat(np.arange(0, t.shape[1], right.size, dtype=np.int64), size)  # G's first T
    x = np.arange(count * size, dtype=np.int64) & (size - 1)  # every value of each table
    for r, (_, lo) in enumerate(halves):
        at = x & ((1 << lo) - 1)
        if count > 1:
            at += rows
        x >>= lo
        x ^= t[r].take(at)
    return x.reshape(count, size)


@cache
def _rounds(bits: int) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray]:
    """What `_tables` needs of a width: each round's (h, l), the values of R (of the wider
    half), each round's mask of F (mod 2^h) and R * 2^h of each R (read-only arrays)."""
    high, low = (bits + 1) // 2, bits // 2
    halves = [(high, low) if r % 2 == 0 else (low, high) for r in range(ROUNDS)]
    right = np.arange(1 << high, dtype=np.uint64)
    shifts = np.array([h for h, _ in halves], dtype=np.uint64)[:, None, None]
    masks = (np.uint64(1) << shifts) - np.uint64(1)
    parts = right << shifts
    for array in (right, masks, parts):
        array.flags.writeable = False
    return halves, right, masks, parts


def _bits(n: int) -> int:
    """m: the width E works on for a permutation of [0, n)."""
    if not 1 <= n <= MAX_N:
        raise ValueError(f"a permutation needs 1 <= n <= 2**62, got n={n}")
    return max(MIN_BITS, (n - 1).bit_length())


def _walk_one(i: int, n: int, keys: list[int], bits: int) -> int:
    """perm(i) in plain integers, walked like `permute` walks arrays."""
    if n == 1:
        return 0
    x = _encrypt_one(i, keys, bits)
    while x >= n:
        x = _encrypt_one(x, keys, bits)
    return x


def _encrypt_one(x: int, keys: list[int], bits: int) -> int:
    """`_encrypt` on one plain integer (Python integers do not wrap: mask the products)."""
    high, low = (bits + 1) // 2, bits // 2
    high_mask, low_mask = (1 << high) - 1, (1 << low) - 1
    c1, c2, mask64 = _C1, _C2, _MASK64  # locals: this loop is the per-draw hot path
    for k in keys:
        right = x & low_mask
        z = right ^ k
        z ^= z >> 30
        z = z * c1 & mask64
        z ^= z >> 27
        z = z * c2 & mask64
        z ^= z >> 31
        x = (right << high) | (((x >> low) ^ z) & high_mask)
        high, low, high_mask, low_mask = low, high, low_mask, high_mask
    return x


def _encrypt(x: np.ndarray, keys: np.ndarray, bits: int) -> np.ndarray:
    """E: `ROUNDS` alternating Feistel rounds on `bits`-bit values (in place where it can)."""
    high, low = (bits + 1) // 2, bits // 2
    for r in range(ROUNDS):
        right = x & np.uint64((1 << low) - 1)
        z = right ^ keys[..., r]  # F, the SplitMix64 finalizer, with wrapping products:
        z ^= z >> _S30
        z *= _M1
        z ^= z >> _S27
        z *= _M2
        z ^= z >> _S31
        x = x >> np.uint64(low)
        x ^= z
        x &= np.uint64((1 << high) - 1)
        right <<= np.uint64(high)
        x |= right
        high, low = low, high
    return x
