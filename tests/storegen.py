"""Synthetic token stores for plan tests: token value = position in the store's natural stream.

With such a store every expectation is arithmetic: a window starting at stream offset `t` holds
t, t+1, ..., and document boundaries are known from the lengths we chose. A test that only
draws (which window of which epoch each row holds) needs no store at all: `synthetic_meta` is
the metadata such a store would have, and a plan computes from metadata alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from pipeline.read.plan import Plan
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore
from pipeline.store.writer import (
    commit,
    staging_dir,
    synthetic_tokenizer,
    write_manifest,
    write_shard,
)

EOD = 2**32 - 1  # never a position, so it never appears in a synthetic stream
TOKENIZER = synthetic_tokenizer(vocab_size=2**32, eod_id=EOD)  # of every synthetic store


def write_synthetic_store(
    path: Path,
    shards: list[list[int]],
    record_tokens: int = 2048,
    first: int = 0,
    flat: bool = True,
    shuffled: int | None = None,
    document_ids: bool = False,
) -> TokenStore:
    """A store whose shard i holds documents of lengths shards[i] (split into records), with
    flat token sidecars unless `flat` is false.

    `first` shifts every token value: a store written with another `first` is a same-size twin
    (same files sizes, other content). `shuffled` (a seed): random text instead, every token a
    distinct random id (so every n-gram is unique, and a token tells its store position).
    `document_ids`: record document ids (`doc_ids`), `s{shard}-d{index}`."""
    staging = staging_dir(Path(path))
    position = first
    infos = []
    total = first + sum(map(sum, shards))
    ids = (
        np.arange(total) if shuffled is None else np.random.default_rng(shuffled).permutation(total)
    )
    for index, lengths in enumerate(shards):
        docs = []
        for length in lengths:
            docs.append(ids[position : position + length].astype(np.uint32))
            position += length
        dtype = np.dtype(np.uint32)
        if document_ids:
            docs = [(doc, f"s{index}-d{number}") for number, doc in enumerate(docs)]
        infos.append(write_shard(staging, index, len(shards), docs, dtype, record_tokens, flat,
                                 ids=document_ids))  # fmt: skip
    write_manifest(staging, infos, TOKENIZER, np.dtype(np.uint32), {"synthetic": True})
    commit(staging, Path(path), overwrite=False)
    return TokenStore(path)


def synthetic_meta(path: Path, shards: list[list[int]]) -> StoreMeta:
    """What `write_synthetic_store(path, shards)` would describe, without writing anything."""
    fingerprint = hashlib.sha256(repr(shards).encode()).hexdigest()[:16]
    tokens = np.array([sum(s) for s in shards], dtype=np.int64)
    return StoreMeta(Path(path), fingerprint, tokens, np.dtype(np.uint32), TOKENIZER)


def arrayrecord_only(plan: Plan) -> Plan:
    """The same plan over stores that ignore the flat sidecars and read ArrayRecord records."""
    return Plan(plan.ledger, [TokenStore(store.path, flat=False) for store in plan.stores()])


def doc_starts(shards: list[list[int]]) -> np.ndarray:
    """Stream offsets at which documents start."""
    lengths = [length for shard in shards for length in shard]
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
