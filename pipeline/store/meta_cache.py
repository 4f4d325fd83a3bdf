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

A file is read in one piece whatever the number of stores (a restore of 1,024 sources parsed
~270 kB of JSON, a list per store, ~5 ms): a JSON line of the strings (paths, fingerprints,
digests, dtypes; each distinct tokenizer once, the stores of a mixture share one) and the
numbers as arrays after it (each manifest's identity; shard, tokenizer and mask columns; every
store's token counts; where each shard's entry is in the manifest's bytes), read as a few lists
and arrays (`_Read`); a store's `StoreMeta` is made when the plan asks for it, its counts and
entry positions read-only views of those arrays. The positions (`StoreMeta.spans`, version 3)
are found once in the checked bytes (`manifest_spans.entry_spans`) and kept with their digest:
a restore's store opens parse the entries they use without looking for them (~17 us a store).

A summary never stands for the store itself: the store is opened at its first draw, which
reads its manifest again and takes the summary's word only for bytes of the checked SHA-256
(`TokenStore`); other bytes are checked in full and must have the planned fingerprint, or the
store is refused in one line naming the source and the store (`store_set.open_at`). A file
is used only whole and as written: it carries the SHA-256 of its body and its format version;
anything else (damaged, another version's: version 2 had no entry positions) is logged and
rewritten. Files are written atomically; the least recently used beyond `MAX_FILES` are
removed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.store.meta import MANIFEST, StoreMeta
from pipeline.urls import cache_directory, cache_entries, write_atomically

log = logging.getLogger("pipeline")

CACHE_ENV = "PIPELINE_MANIFEST_CACHE"
VERSION = 3  # bump when the file's layout, an entry's fields or StoreMeta's meaning change
MAX_FILES = 64  # sets of stores kept (one file each, ~0.2 kB per store)
SUFFIX = ".summary"
# an entry's name (version 1 wrote `.json`: evicted, never read); anything else is left alone
ENTRY = re.compile(r"[0-9a-f]{32}\.(?:summary|json)")
IDS = np.dtype("<u8")  # per store: the manifest's device, inode and size
# per store: mtime_ns, ctime_ns, shards, tokenizer, masked, tokens, spanned; counts; spans
INTS = np.dtype("<i8")
COLUMNS = 7  # of INTS a store

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
    `save` when a store was read afresh or is no longer planned."""

    def __init__(self, paths: list[Path]) -> None:
        directory = cache_dir()
        names = sorted({str(path) for path in paths})
        name = hashlib.sha256("\n".join(names).encode()).hexdigest()[:32]
        self.file = None if directory is None else directory / f"{name}{SUFFIX}"
        self._read = _Read.empty() if self.file is None else self._load()
        self._fresh: dict[str, tuple[Stat, StoreMeta]] = {}  # this start's, by path
        self._kept = False  # whether a store was read afresh (`keep`)

    def meta(self, path: Path, stat: Stat | None) -> StoreMeta | None:
        """The kept metadata of the store at `path` if its manifest's identity is `stat`."""
        key = str(path)
        meta = None if stat is None else self._read.meta(key, path, stat)
        if meta is not None:
            self._fresh[key] = (stat, meta)
        return meta

    def vouched(
        self, paths: Sequence[Path], keys: Sequence[str], records: Sequence[str]
    ) -> list[StoreMeta | None]:
        """`meta` of each local store at `paths` (`keys`: their str) that holds none of the
        files `records` (an in-place index's), its manifest stated here: one loop of plain
        calls for a mixture's hundreds (two `access`, one `stat` a store). None where the
        caller reads the store (`formats.local_meta`: in place, new, changed or missing)."""
        read, out = self._read, []
        rows, access, exists = read.rows, os.access, os.F_OK
        probes = [f"/{record}" for record in records]
        for path, key in zip(paths, keys):
            row, meta = rows.get(key), None
            if row is not None:
                for probe in probes:  # a loop, not `any` of a list: ~0.6 us a store less
                    if access(key + probe, exists):
                        break
                else:
                    meta = self._unchanged(read, row, path, key)
            out.append(meta)
        return out

    def _unchanged(self, read: _Read, row: int, path: Path, key: str) -> StoreMeta | None:
        """`vouched`'s answer for a store of no in-place record: its kept row's metadata if
        its manifest file's identity is the row's."""
        try:
            s = os.stat(f"{key}/{MANIFEST}")
        except OSError:
            return None
        ident = read.idents[row]  # kept by `_fresh`: not a tuple made a store
        if ident != (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns):
            return None
        meta = read.meta_of(row, path)
        self._fresh[key] = (ident, meta)
        return meta

    def keep(self, meta: StoreMeta, stat: Stat | None) -> None:
        """Keep `meta`, read from the manifest file of identity `stat` (taken before the
        read: a manifest replaced in between then reads as changed at the next start)."""
        if stat is not None and meta.checked is not None:
            self._fresh[str(meta.path)] = (stat, meta)
            self._kept = True

    def save(self) -> None:
        """Write the entries of this start, if they are not the file's (atomically; a cache
        that cannot be written is skipped with a warning)."""
        if self.file is None or (not self._kept and self._fresh.keys() == self._read.rows.keys()):
            return
        try:
            body = _encode(self._fresh)
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.file, hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        except (OSError, OverflowError) as error:
            log.warning(
                "%s: manifest summaries not kept (%s); set %s=off", self.file, error, CACHE_ENV
            )
            return
        self._kept, self._read = False, _Read.decode(body)
        _evict(self.file.parent, self.file)

    def _load(self) -> _Read:
        """The file's entries; none if there is no file or it is not whole and of this
        version (then logged)."""
        assert self.file is not None
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return _Read.empty()
        except OSError as error:
            log.warning("%s: manifest summaries not used (%s)", self.file, error)
            return _Read.empty()
        digest, _, body = data.partition(b"\n")
        try:
            if hashlib.sha256(body).hexdigest().encode() != digest:
                raise ValueError("its content does not match its checksum")
            read = _Read.decode(body)
        except (ValueError, KeyError, AttributeError, TypeError, IndexError) as error:
            log.warning(
                "%s: manifest summaries not used (%s); reading the manifests", self.file, error
            )
            return _Read.empty()
        with suppress(OSError):  # its last use, for `_evict`
            os.utime(self.file)
        return read


class _Read:
    """A file's stores, by path (`rows`): each one's `StoreMeta` made when asked (`meta`),
    from the file's columns (as Python lists: a few calls whatever the number of stores)."""

    def __init__(
        self, header: dict[str, Any], ids: np.ndarray, ints: np.ndarray, counts, spans
    ) -> None:
        self.header = header
        self.rows = {path: row for row, path in enumerate(header["paths"])}
        self.ints = ints.tolist()
        # each store's manifest identity (`Stat`), as `manifest_stat` gives it
        self.idents = list(zip(*ids.T.tolist(), *ints[:, :2].T.tolist()))
        self.ends = np.cumsum(ints[:, 2]).tolist()  # where each store's counts end in `counts`
        self.counts = counts  # and its entries' (start, end) pairs in `spans`, at twice that
        self.spans = spans
        self.dtypes = {name: np.dtype(name) for name in set(header["dtypes"])}

    @classmethod
    def empty(cls) -> _Read:
        """No stores."""
        return cls.decode(_encode({}))

    @classmethod
    def decode(cls, body: bytes) -> _Read:
        """A file's body (`_encode`) taken apart; one of another version or shape raises."""
        line, _, blob = body.partition(b"\n")
        header = json.loads(line)
        if header.get("version") != VERSION:
            raise ValueError(f"version {header.get('version')}, this version writes {VERSION}")
        n = len(header["paths"])
        if not all(len(header[key]) == n for key in ("fingerprints", "digests", "dtypes")):
            raise ValueError("its columns are not of one length")
        if not all(isinstance(tokenizer, dict) for tokenizer in header["tokenizers"]):
            raise ValueError("a tokenizer is not of this version's shape")
        ids = np.frombuffer(blob, IDS, 3 * n).reshape(n, 3)
        ints = np.frombuffer(blob, INTS, COLUMNS * n, ids.nbytes).reshape(n, COLUMNS)
        size = int(ints[:, 2].sum())
        if len(blob) != ids.nbytes + ints.nbytes + 3 * size * INTS.itemsize:
            raise ValueError("its arrays are not of the lengths its header gives")
        if n and (ints[:, 2:].min() < 0 or ints[:, 3].max() >= len(header["tokenizers"])):
            raise ValueError("a store's shards, tokenizer or totals are out of range")
        counts = np.frombuffer(blob, INTS, size, ids.nbytes + ints.nbytes)
        spans = np.frombuffer(blob, INTS, 2 * size, ids.nbytes + ints.nbytes + counts.nbytes)
        return cls(header, ids, ints, counts, spans)

    def meta(self, key: str, path: Path, stat: Stat) -> StoreMeta | None:
        """The metadata of the store at `path` (`key`: its str) if kept with the manifest
        identity `stat`."""
        row = self.rows.get(key)
        return None if row is None or self.idents[row] != stat else self.meta_of(row, path)

    def meta_of(self, row: int, path: Path) -> StoreMeta:
        """The metadata of store `row`, at `path`."""
        _, _, shards, tokenizer, masked, total, spanned = self.ints[row]
        header, end = self.header, self.ends[row]
        values = (
            path, header["fingerprints"][row], self.counts[end - shards : end],
            self.dtypes[header["dtypes"][row]], header["tokenizers"][tokenizer], masked != 0,
        )  # fmt: skip
        spans = (self.spans, 2 * (end - shards)) if spanned else None
        return StoreMeta.kept(values, total, header["digests"][row], spans)


def _encode(entries: dict[str, tuple[Any, StoreMeta]]) -> bytes:
    """A file's body: a JSON line of the stores' strings (each distinct tokenizer once), then
    their numbers as little-endian arrays (`_Read.decode`): a store's entry positions are
    zeros, not spanned, where they are not known."""
    tokenizers: dict[str, int] = {}  # a tokenizer's canonical JSON -> its index
    ids, ints, counts, spans = [], [], [], []
    for stat, meta in entries.values():
        index = tokenizers.setdefault(json.dumps(meta.tokenizer, sort_keys=True), len(tokenizers))
        found = meta.spans
        ids.append(stat[:3])
        ints.append([*stat[3:], meta.num_shards, index, int(meta.masked), meta.num_tokens,
                     int(found is not None)])  # fmt: skip
        counts.append(meta.shard_tokens)
        spans.append(np.zeros((meta.num_shards, 2), INTS) if found is None else found)
    metas = [meta for _, meta in entries.values()]
    header = {
        "version": VERSION,
        "tokenizers": [json.loads(text) for text in tokenizers],
        "paths": list(entries),
        "fingerprints": [meta.fingerprint for meta in metas],
        "digests": [meta.checked for meta in metas],
        "dtypes": [meta.dtype.name for meta in metas],
    }
    arrays = (
        np.array(ids, IDS).reshape(-1, 3),
        np.array(ints, INTS).reshape(-1, COLUMNS),
        np.concatenate([np.zeros(0, INTS), *counts]).astype(INTS),
        np.array([span for found in spans for span in found], INTS).reshape(-1),
    )
    return json.dumps(header).encode() + b"\n" + b"".join(a.tobytes() for a in arrays)


def _evict(directory: Path, kept: Path) -> None:
    """Remove the least recently used entry files but `kept` beyond `MAX_FILES`."""
    entries = cache_entries(directory, ENTRY)
    for _, _, path in entries[: max(0, len(entries) - MAX_FILES)]:
        if path != kept:
            with suppress(OSError):
                path.unlink(missing_ok=True)
