"""Named derivations of the root seed. Randomness is keyed, never ambient.

Each derived value depends on the whole tuple of parts, so (seed, epoch) pairs never collide the
way `seed + epoch` does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

_COUNTERS = [str(i).encode() for i in range(16)]  # the last part of `keyed_hashes`' messages


def keyed_hash(seed: int, purpose: str, *parts: object, bits: int = 64) -> int:
    """A `bits`-bit value unique to (seed, purpose, parts)."""
    message = "\0".join([str(seed), purpose, *map(str, parts)]).encode()
    digest = hashlib.blake2b(message, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - bits)


def keyed_hashes(seed: int, purpose: str, *parts: object, count: int) -> list[int]:
    """`keyed_hash(seed, purpose, *parts, i)` (64 bits) for i in range(count): the same
    values, the parts before i hashed once (a permutation's round keys are computed at every
    epoch of every source: a hash of the common prefix, copied, costs ~1/3 of six whole ones)."""
    digests = keyed_digests([(seed, purpose, *parts)], count)
    return [int.from_bytes(digests[i : i + 8], "little") for i in range(0, len(digests), 8)]


def keyed_digests(keys: Iterable[Sequence[object]], count: int) -> bytes:
    """`keyed_hashes(*key, count=count)` of each key (seed, purpose, *parts), as the 8
    little-endian bytes of each value, joined: one buffer for one `numpy.frombuffer` (a
    restore's first steps hash the round keys of dozens of orders at once, and an array or
    an `int` per value cost more than the hashes)."""
    counters = _COUNTERS[:count] if count <= len(_COUNTERS) else [b"%d" % i for i in range(count)]
    blake2b, out = hashlib.blake2b, []
    append = out.append
    for key in keys:
        # "seed\0purpose\0part\0...\0", as `keyed_hashes` joins it: %s is str() (~2x a join)
        common = blake2b(("%s\0" * len(key) % tuple(key)).encode(), digest_size=8)
        for counter in counters:
            digest = common.copy()
            digest.update(counter)
            append(digest.digest())
    return b"".join(out)
