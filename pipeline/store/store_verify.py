"""The full pass over a prepared store's shard (`TokenStore.verify`): every byte, every record.

A shard's first use checks what it serves from cheaply (`shard_check`), and its reads check the
blocks they read (`flat_blocks`); `verify-store` reads a shard whole once: each file's SHA-256
against the manifest, then every record's length against the record index (so the dtype too)
and every token id against the tokenizer's vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.store.meta import MANIFEST
from pipeline.store.store_files import CHECKSUMS, sha256_of


def check_checksums(root: Path, entry: dict[str, Any], remote: bool) -> None:
    """The SHA-256 of each file of a shard (its manifest `entry`, in the store at `root`) that
    `CHECKSUMS` lists (data, indexes, and the sidecar and loss mask where it has them); a
    cloud shard's data file is hashed as it is downloaded, by the caller."""
    for key, checksum_key in CHECKSUMS:
        if key not in entry or (key == "file" and remote):
            continue
        path = root / entry[key]
        if sha256_of(path) != entry[checksum_key]:
            raise StoreError(
                f"{path}: content checksum does not match {root / MANIFEST}; the "
                "file was altered or truncated: prepare the store again"
            )


def check_all_records(
    file: Path,
    offsets: np.ndarray,
    dtype: np.dtype,
    vocab_size: int,
    read: Callable[[int, int], list[bytes]],
    batch: int = 4096,
) -> None:
    """Every record of a shard (`file`, record index `offsets`, records [i, j) read by
    `read(i, j)`) against its index, and every token id against `vocab_size`, `batch`
    records a read."""
    itemsize = dtype.itemsize
    for first in range(0, len(offsets) - 1, batch):
        last = min(first + batch, len(offsets) - 1)
        records = read(first, last)
        lengths = np.array([len(r) for r in records], dtype=np.int64)
        expected = np.diff(offsets[first : last + 1]) * itemsize
        wrong = np.flatnonzero(lengths != expected)
        if wrong.size:
            record = first + int(wrong[0])
            raise StoreError(
                f"{file}: record {record} holds {lengths[wrong[0]]} bytes, "
                f"the index and manifest say {expected[wrong[0]] // itemsize} tokens of "
                f"{dtype.name}; the store is corrupt: prepare it again"
            )
        tokens = np.frombuffer(b"".join(records), dtype=dtype)
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise StoreError(
                f"{file}: token id {int(tokens.max())} in records "
                f"{first}..{last - 1} is not below the vocabulary size {vocab_size}; "
                "the store is corrupt: prepare it again"
            )
