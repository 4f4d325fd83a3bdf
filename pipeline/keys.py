"""Named derivations of the root seed. Randomness is keyed, never ambient.

Each derived value depends on the whole tuple of parts, so (seed, epoch) pairs never collide the
way `seed + epoch` does.
"""

from __future__ import annotations

import hashlib


def keyed_hash(seed: int, purpose: str, *parts: object, bits: int = 64) -> int:
    """A `bits`-bit value unique to (seed, purpose, parts)."""
    message = "\0".join([str(seed), purpose, *map(str, parts)]).encode()
    digest = hashlib.blake2b(message, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


def keyed_hashes(seed: int, purpose: str, *parts: object, count: int) -> list[int]:
    """`keyed_hash(seed, purpose, *parts, i)` (64 bits) for i in range(count): the same
    values, the parts before i hashed once (a permutation's round keys are computed at every
    epoch of every source: a hash of the common prefix, copied, costs ~1/3 of six whole ones)."""
    prefix = "\0".join([str(seed), purpose, *map(str, parts), ""]).encode()
    common = hashlib.blake2b(prefix, digest_size=8)
    out = []
    for i in range(count):
        digest = common.copy()
        digest.update(str(i).encode())
        out.append(int.from_bytes(digest.digest(), "little"))
    return out
