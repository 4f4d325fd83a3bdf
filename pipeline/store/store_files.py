"""A store's files as files: their names, their identities and their checksums.

A store is read by long-running jobs while `prepare --overwrite` may replace it, and a job
must never mix two stores' bytes. So a shard's first use takes the identity of each file it will
serve from (`shard_files`: existence and sizes against the manifest), its later uses (after
the bound on open shards closed it) compare them again, and a running feed compares the
manifest's (`store_identity`). The content
checks of a shard's files (indexes, mask, sidecar, records) are `shard_check`'s.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Container, Hashable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pipeline.errors import StoreError
from pipeline.store.meta import MANIFEST
from pipeline.urls import is_url, object_version

# (file key, checksum key) of every file of a shard listed in the manifest.
# A file whose key is absent from a shard's entry (the optional "flat" and "flat_blocks";
# "untrained", which only a masked store has; "ids", which only a store with ids has) is not
# checked.
CHECKSUMS = (
    ("file", "sha256"),
    ("index", "index_sha256"),
    ("docs", "docs_sha256"),
    ("flat", "flat_sha256"),
    ("flat_blocks", "flat_blocks_sha256"),
    ("untrained", "untrained_sha256"),
    ("ids", "ids_sha256"),
)
FLAT_SUFFIX = "flat.bin"
# How a message blames the manifest for what a file that matches its checksum in the manifest
# (so is as prepared) contradicts: a count or the dtype edited, the manifest's checksum redone.
RESEALED = (
    "the file matches its checksum in the manifest, so the manifest was edited and its "
    "checksum redone; prepare the store again"
)
LISTED_ARRAYS = {
    "index": "record index",
    "docs": "document index",
    "untrained": "loss mask",
    "flat_blocks": "block checksum file",
}
"""A shard's `.npy` files by manifest key, with the name a missing one is reported by."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_of(source: Path | bytes) -> str:
    """SHA-256 of a file, or of bytes already read."""
    if isinstance(source, bytes):
        return hashlib.sha256(source).hexdigest()
    try:
        return file_sha256(source)
    except OSError as error:
        raise StoreError(f"{source}: cannot read: {error.strerror}") from None


class FileIdentity(NamedTuple):
    """What changes when a file is replaced or rewritten: its version (a local file's device,
    inode and mtime; a cloud object's generation number) and its size. A named tuple: a
    shard's first use makes four (a frozen dataclass costs ~1 us more each)."""

    version: tuple[int, ...]
    size: int


def identity_of(stat: os.stat_result) -> FileIdentity:
    """A local file's identity from its `stat` (or `fstat`)."""
    return FileIdentity((stat.st_dev, stat.st_ino, stat.st_mtime_ns), stat.st_size)


def local_identity(path: str | Path) -> FileIdentity | None:
    """A local file's identity; None for a missing one (`identity_or_none` without asking
    whether `path` is a URL: a shard's first use takes several)."""
    try:
        return identity_of(os.stat(path))
    except OSError:
        return None


def identity_or_none(path: str | Path) -> FileIdentity | None:
    """A local file's or a cloud object's identity; None for a missing one."""
    if not is_url(path):
        return local_identity(path)
    try:
        found = object_version(path)
    except StoreError:
        raise
    except Exception as error:  # gcsfs retried what was transient
        raise StoreError(f"{path}: cannot read the object's metadata: {error}") from None
    return None if found is None else FileIdentity((found[0],), found[1])


def store_identity(path: Path) -> Hashable | None:
    """The identity of the store at `path` now: what changes when it is replaced or rewritten.

    Local: the manifest's (device, inode, size, mtime), as `prepare` writes the manifest last
    and `--overwrite` swaps the whole directory. A cloud store: the manifest object's
    generation number and size (one metadata request), as a bucket commit writes the manifest
    last and `--overwrite` deletes it first. None for a missing manifest.
    """
    return identity_or_none(path / MANIFEST)


def shard_identity(root: str, entry: dict[str, Any]) -> FileIdentity:
    """The identity of the data file of the shard whose manifest entry is `entry`, in the local
    store at `root`, which must exist and have the manifest's size."""
    path = f"{root}/{entry['file']}"
    identity = local_identity(path)
    if identity is None:
        raise StoreError(f"{path}: shard listed in the manifest is missing")
    if identity.size != entry["bytes"]:
        raise StoreError(
            f"{path}: {identity.size} bytes, the manifest says {entry['bytes']}; "
            "the shard is truncated or altered: prepare the store again"
        )
    return identity


def wrong_flat_size(
    root: str, number: int, entry: dict[str, Any], found: FileIdentity | None, dtype: np.dtype
) -> str:
    """Why shard `number`'s sidecar is not the size its manifest entry says. A sidecar that
    still matches its checksum (hashed here, on this error path only) is as prepared: then the
    manifest's token count or dtype was edited."""
    flat, size = f"{root}/{entry['flat']}", entry["tokens"] * dtype.itemsize
    if found is not None and sha256_of(Path(flat)) == entry["flat_sha256"]:
        return (
            f"{root}/{MANIFEST}: shards[{number}] says {entry['tokens']} tokens of "
            f"{dtype.name} ({size} bytes), but its flat token sidecar {entry['flat']} holds "
            f"{found.size} bytes; {RESEALED}"
        )
    return (
        f"{flat}: flat token sidecar listed in the manifest is missing or not {size} bytes; "
        "prepare the store again"
    )


def shard_files(
    root: str,
    number: int,
    entry: dict[str, Any],
    dtype: np.dtype,
    read: Container[str] = (),
) -> dict[str, FileIdentity]:
    """Shard `number`'s files (its manifest entry `entry`) in the local store at `root`: every
    file the entry lists exists, its data file and flat sidecar have the manifest's sizes;
    their identities, by manifest key. Taken at the shard's first use (`TokenStore`), so an
    open costs the same whatever the number of shards, as a cloud store's always did. `root`
    is a string: joins of `pathlib` paths cost more than the `stat`s (~10 a shard). The files
    under the keys `read`, which the caller reads whole or maps right after (a missing one
    refused there, in the same words; a sidecar's size and identity taken from the descriptor
    it maps, `shard_check.map_flat`), are not asked for first: a restore's first step uses
    dozens of shards."""
    identity = {"file": shard_identity(root, entry)}
    for key, kind in LISTED_ARRAYS.items():
        if key not in entry or key in read:
            continue  # "untrained", "flat_blocks": optional (identity.check_manifest)
        path = f"{root}/{entry[key]}"
        if not os.access(path, os.F_OK):  # `exists` without its `stat` result: ~1 us less
            raise StoreError(f"{path}: {kind} listed in the manifest is missing")
    if "flat" in entry and "flat" not in read:
        flat = f"{root}/{entry['flat']}"
        size = entry["tokens"] * dtype.itemsize
        identity["flat"] = local_identity(flat)
        if identity["flat"] is None or identity["flat"].size != size:
            raise StoreError(wrong_flat_size(root, number, entry, identity["flat"], dtype))
    return identity


def files_unchanged(
    root: str, entry: dict[str, Any], identities: dict[str, FileIdentity | None]
) -> bool:
    """Whether a shard's files whose identities `shard_files` took are still those files."""
    return all(local_identity(f"{root}/{entry[key]}") == known for key, known in identities.items())
