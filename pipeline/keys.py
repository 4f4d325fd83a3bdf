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
