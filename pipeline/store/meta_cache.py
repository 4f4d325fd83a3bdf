"""A host's summaries of the manifests it checked, so that a restart plans a big mixture by stat.

A plan needs of each store only its token counts, fingerprint, dtype and tokenizer
(`StoreMeta`), yet reading and checking a manifest (its JSON, the SHA-256 of its canonical
form, its fields) costs ~0.3 ms: a restore of 256 sources spent most of its start there. So a
feed keeps, per set of stores it plans (one file per set under `$PIPELINE_MANIFEST_CACHE`,
default `$XDG_CACHE_HOME/pipeline/manifests`, `off` disables it), each store's metadata with
the identity of the manifest file it was read from: device, inode, size, modification and
change times (`manifest_stat`; a rewrite or a replacing rename changes them) and the SHA-256
of the checked bytes. The next start takes the metadata of a store whose manifest's identity
is unchanged from the summary, by one `stat`; any other store's manifest is read and checked.

A summary never stands for the store itself: the store is opened at its first draw, which
reads its manifest again and takes the summary's word only for bytes of the checked SHA-256
(`TokenStore`); other bytes are checked in full and must have the planned fingerprint, or the
store is refused in one line naming the source and the store (`store_set.open_at`). A file
is used only whole and as written: it carries the SHA-256 of its body and its format version;
anything else (damaged, another version's) is logged and rewritten. Files are written
atomically; the least recently used beyond `MAX_FILES` are removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.store.meta import MANIFEST, StoreMeta
from pipeline.urls import cache_directory, cache_entries, write_atomically

log = logging.getLogger("pipeline")

CACHE_ENV = "PIPELINE_MANIFEST_CACHE"
VERSION = 1  # bump when an entry's fields or StoreMeta's meaning change
MAX_FILES = 64  # sets of stores kept (one file each, ~0.5 kB per store)
ENTRY = re.compile(r"[0-9a-f]{32}\.json")  # an entry's name; anything else is left alone

Stat = tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns


def cache_dir() -> Path | None:
    """Where summaries are kept; None when `$PIPELINE_MANIFEST_CACHE` is `off`."""
    return cache_directory(CACHE_ENV, "manifests")


def manifest_stat(path: str | Path) -> Stat | None:
    """The identity of the manifest of the local store at `path` (None: no manifest file)."""
    try:
        s = os.stat(f"{os.fspath(path)}/{MANIFEST}")  # not os.path.join: ~1 us a store
    except OSError:
        return None
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


class Summaries:
    """The kept metadata of the local stores `paths` (`meta`, `keep`), written back by
    `save` when a store was read afresh."""

    def __init__(self, paths: list[Path]) -> None:
        directory = cache_dir()
        names = sorted({str(path) for path in paths})
        name = hashlib.sha256("\n".join(names).encode()).hexdigest()[:32]
        self.file = None if directory is None else directory / f"{name}.json"
        self._entries: dict[str, list[Any]] = {} if self.file is None else self._read()
        self._fresh: dict[str, list[Any]] = {}  # the entries of this start, by path

    def meta(self, path: Path, stat: Stat | None) -> StoreMeta | None:
        """The kept metadata of the store at `path` if its manifest's identity is `stat`."""
        entry = self._entries.get(str(path))
        if entry is None or stat is None or tuple(entry[0]) != stat:
            return None
        self._fresh[str(path)] = entry
        _, fingerprint, tokens, dtype, tokenizer, masked, digest = entry
        meta = StoreMeta(
            path, fingerprint, np.array(tokens, dtype=np.int64), np.dtype(dtype), tokenizer, masked
        )
        meta.vouch(digest)
        return meta

    def keep(self, meta: StoreMeta, stat: Stat | None) -> None:
        """Keep `meta`, read from the manifest file of identity `stat` (taken before the
        read: a manifest replaced in between then reads as changed at the next start)."""
        if stat is not None and meta.checked is not None:
            tokens = meta.shard_tokens.tolist()
            fields = [meta.fingerprint, tokens, meta.dtype.name, meta.tokenizer, meta.masked]
            self._fresh[str(meta.path)] = [list(stat), *fields, meta.checked]

    def save(self) -> None:
        """Write the entries of this start, if they differ from the file's (atomically; a
        cache that cannot be written is skipped with a warning)."""
        if self.file is None or self._fresh == self._entries:
            return
        body = json.dumps({"version": VERSION, "stores": self._fresh}).encode()
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.file, hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        except OSError as error:
            log.warning(
                "%s: manifest summaries not kept (%s); set %s=off", self.file, error, CACHE_ENV
            )
            return
        self._entries = dict(self._fresh)
        _evict(self.file.parent, self.file)

    def _read(self) -> dict[str, list[Any]]:
        """The file's entries; none if there is no file or it is not whole and of this
        version (then logged)."""
        assert self.file is not None
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as error:
            log.warning("%s: manifest summaries not used (%s)", self.file, error)
            return {}
        digest, _, body = data.partition(b"\n")
        try:
            if hashlib.sha256(body).hexdigest().encode() != digest:
                raise ValueError("its content does not match its checksum")
            content = json.loads(body)
            if content.get("version") != VERSION:
                raise ValueError(f"version {content.get('version')}, this version writes {VERSION}")
            entries = content["stores"]
            if not all(isinstance(e, list) and len(e) == 7 for e in entries.values()):
                raise ValueError("an entry is not of this version's shape")
        except (ValueError, KeyError, AttributeError) as error:
            log.warning(
                "%s: manifest summaries not used (%s); reading the manifests", self.file, error
            )
            return {}
        with suppress(OSError):  # its last use, for `_evict`
            os.utime(self.file)
        return entries


def _evict(directory: Path, kept: Path) -> None:
    """Remove the least recently used entry files but `kept` beyond `MAX_FILES`."""
    entries = cache_entries(directory, ENTRY)
    for _, _, path in entries[: max(0, len(entries) - MAX_FILES)]:
        if path != kept:
            with suppress(OSError):
                path.unlink(missing_ok=True)
