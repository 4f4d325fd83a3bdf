"""Where a document goes in a store: split, shard and position, from a keyed hash of its key.

Placement depends only on (seed, document key), never on reading order, bundle order or worker
count, so the local and Beam runners write byte-identical stores, and `--seed` reshuffles.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.keys import keyed_hash

TRAIN, EVAL = "train", "eval"


@dataclass(frozen=True, order=True)
class Placement:
    split: str
    shard: int
    order: int  # documents of a shard are sorted by (order, key)


def place(key: str, seed: int, num_shards: int, eval_fraction: float) -> Placement:
    held_out = keyed_hash(seed, "eval", key) < int(eval_fraction * 2**64)
    return Placement(
        split=EVAL if held_out else TRAIN,
        shard=keyed_hash(seed, "shard", key) % num_shards,
        order=keyed_hash(seed, "order", key),
    )
