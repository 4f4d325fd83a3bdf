"""A best_fit source's packing, kept on local disk so a new process restores without repacking.

Packing is a pure function of the store's content and a few settings, so its result can be
kept: one `.npz` file per key under `$PIPELINE_PACKING_CACHE` (default
`$XDG_CACHE_HOME/pipeline/packings`, `off` disables it). The key is everything the packing
depends on: the packing policy's name (two policies never share an entry), the store's manifest
checksum (`manifest_sha256`, which covers every shard's files), the seed, source name,
`seq_len`, lanes, `too_long` and `PACKING_VERSION`, bumped whenever the packing algorithm
changes. A file is used only if it names exactly that key and its arrays
match the SHA-256 it carries, with the shapes the store implies; anything else (damaged,
truncated, stale, another key's) is logged, rebuilt and rewritten, never used. Files are
written atomically (`write_atomically`), so readers on the same host never see half of one.

Keys change whenever a store is prepared again or a setting changes, so old entries would pile
up on a small boot disk: a hit marks its entry used (its mtime), and after each write the least
recently used entries (never the new one, never a file not named like an entry) are removed
until the entries total at most `$PIPELINE_PACKING_CACHE_MAX_GB` (default `MAX_GB`). Processes
sharing the directory may remove an entry another is about to read: that reader packs again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import zipfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config.env import positive_number
from pipeline.urls import cache_directory, cache_entries, write_atomically
from pipeline.wording import counted

log = logging.getLogger("pipeline")

PACKING_VERSION = 1  # bump when the packing (packing.py) would pack the same store differently
CACHE_ENV = "PIPELINE_PACKING_CACHE"
MAX_GB = 10.0  # the entries' total size bound (10^9 bytes): a small part of a TPU VM boot disk
MAX_GB_ENV = "PIPELINE_PACKING_CACHE_MAX_GB"  # overrides MAX_GB
ENTRY = re.compile(r"[0-9a-f]{32}\.npz")  # an entry's name; anything else is left alone
ARRAYS = ("doc_start", "doc_tokens", "row_offsets", "row_docs", "counts")

Packing = dict[str, np.ndarray]  # ARRAYS: int64 each; counts = [truncated, dropped]


def cache_dir() -> Path | None:
    """Where packings are kept; None when `$PIPELINE_PACKING_CACHE` is `off`."""
    return cache_directory(CACHE_ENV, "packings")


def cached(key: dict[str, Any], documents: int, build: Callable[[], Packing]) -> Packing:
    """The packing of `key` from the cache, else `build()` (then kept for the next process).

    `documents` is the store's document count, which a kept packing's arrays must agree with.
    """
    directory = cache_dir()
    if directory is None:
        return build()
    max_gb = positive_number(MAX_GB_ENV, MAX_GB, "GB")  # a bad value fails before packing
    text = json.dumps({**key, "version": PACKING_VERSION}, sort_keys=True)
    path = directory / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.npz"
    packing, problem = _read(path, text, documents)
    if packing is not None:
        with suppress(OSError):  # removed meanwhile, or a read-only cache: served all the same
            os.utime(path)
        return packing
    if problem:
        log.warning("%s: packing cache entry not used (%s); packing again", path, problem)
    packing = build()
    if _write(path, text, packing):
        _evict(directory, path, max_gb)
    return packing


def _digest(text: str, packing: Packing) -> str:
    digest = hashlib.sha256(text.encode())
    for name in ARRAYS:
        array = np.ascontiguousarray(packing[name], dtype=np.int64)
        digest.update(f"{name}:{array.size}:".encode())
        digest.update(array.data)
    return digest.hexdigest()


def _read(path: Path, text: str, documents: int) -> tuple[Packing | None, str]:
    """(packing, "") for a sound entry of this key; (None, "") when there is none (never kept,
    or just removed by another process); (None, why) for anything else."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {name: data[name] for name in (*ARRAYS, "key", "sha256")}
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        return None, f"unreadable: {error}"
    if str(stored["key"]) != text:
        return None, "it was written for other settings or another store"
    packing = {name: stored[name] for name in ARRAYS}
    if any(a.dtype != np.int64 or a.ndim != 1 for a in packing.values()):
        return None, "its arrays are not int64 vectors"
    if str(stored["sha256"]) != _digest(text, packing):
        return None, "its content does not match its checksum"
    offsets, rows = packing["row_offsets"], packing["row_docs"]
    sound = (
        packing["doc_start"].size == packing["doc_tokens"].size == documents
        and packing["counts"].size == 2
        and offsets.size >= 2
        and offsets[0] == 0
        and offsets[-1] == rows.size
        and bool(np.all(np.diff(offsets) > 0))
        and (rows.size == 0 or (rows.min() >= 0 and rows.max() < documents))
    )
    if not sound:
        return None, "its arrays do not fit the store"
    for array in packing.values():
        array.setflags(write=False)
    return packing, ""


def _write(path: Path, text: str, packing: Packing) -> bool:
    """Keep `packing` under `path`, atomically; a cache that cannot be written is skipped
    (False)."""
    arrays = {name: np.asarray(packing[name], dtype=np.int64) for name in ARRAYS}
    data = io.BytesIO()  # serialised first: write_atomically takes bytes
    np.savez(data, key=np.array(text), sha256=np.array(_digest(text, packing)), **arrays)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data.getvalue())
    except OSError as error:
        log.warning("%s: packing not kept (%s); set %s=off to silence", path, error, CACHE_ENV)
        return False
    return True


def _evict(directory: Path, kept: Path, max_gb: float) -> None:
    """Remove the least recently used entries but `kept` until all total at most `max_gb`."""
    entries = cache_entries(directory, ENTRY)
    total = sum(size for _, size, _ in entries)
    removed, freed = 0, 0
    for _, size, path in entries:
        if total <= max_gb * 1e9:
            break
        if path != kept:
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("%s: packing cache entry not removed (%s)", path, error)
                continue
            total, removed, freed = total - size, removed + 1, freed + size
    if removed:
        log.info(
            "packing cache: removed %s (%.1f MB) to stay under %g GB",
            counted(removed, "entry", "entries"),
            freed / 1e6,
            max_gb,
        )
