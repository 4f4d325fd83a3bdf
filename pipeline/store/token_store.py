"""Reading a prepared token store: the concatenated token stream of a corpus, by token range.

A store is a directory (see docs/token-store.md)::

    manifest.json                         format, tokenizer, dtype, counts, checksums
    shard-00000-of-00004.array_record     one record per document: its tokens, eod last
    shard-00000-of-00004.index.npy        int64 prefix sums of record lengths (records + 1)
    shard-00000-of-00004.docs.npy         int64 prefix sums of document lengths (docs + 1)
    shard-00000-of-00004.flat.bin         optional: the shard's tokens as one raw array
    shard-00000-of-00004.untrained.npy    int64 [k, 2] untrained token ranges (masked stores)

The *stream* of a store is its shards' documents concatenated in shard order. The plan reads
ranges of shards in other orders too, so the primitive is `read_shard_tokens`; `read_tokens`
reads a range of the natural stream. Both return the positions where documents start, taken from
the index (never inferred from token values: a tokenizer may emit the eod id inside a text).

The plan's hot path, `read_pieces`, copies from the flat sidecar through a memory map when
the manifest lists one (no per-record Python loop), and reads ArrayRecord records otherwise;
both give the same tokens. ArrayRecord stays the canonical store, the one Grain and TFDS read.

`TokenStore` is the public API and holds what a store knows of its shards; the work is done
by one module per job: `manifest_text` (a checked manifest parsed as asked), `opened_identity`
(the store's manifest as seen at open, and whether it still is), `store_files` (the files'
identities and checksums), `shard_check` (a shard's first-use checks),
`shard_readers` (the ArrayRecord readers, the bound on open shards, retries), `piece_reads`
(`read_pieces`, the batched copy) and `store_verify` (the full pass); `read_pieces`,
`READER_OPTIONS` and `file_sha256` are importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from pipeline.errors import StoreError, UnreachableError
from pipeline.store.flat_blocks import FlatBlocks
from pipeline.store.manifest_text import ManifestText
from pipeline.store.meta import MANIFEST, StoreFacts, StoreMeta, load_manifest
from pipeline.store.opened_identity import OpenedIdentity
from pipeline.store.piece_reads import read_pieces
from pipeline.store.remote_reads import RemoteFlat, together
from pipeline.store.remote_shards import local_shard, open_copy
from pipeline.store.retry import RetryPolicy
from pipeline.store.shard_check import (
    check_records,
    flat_blocks,
    load_index,
    load_mask,
    map_flat,
    remote_flat,
)
from pipeline.store.shard_readers import (
    READER_OPTIONS,
    ShardReaders,
    default_max_open,
    open_reader,
)
from pipeline.store.spans import spans_in_ranges
from pipeline.store.store_files import (
    FileIdentity,
    file_sha256,
    files_unchanged,
    local_identity,
    shard_files,
)
from pipeline.store.store_verify import check_all_records, check_checksums
from pipeline.urls import is_url, location

__all__ = [
    "DEFAULT_RETRY",
    "READER_OPTIONS",
    "TokenSpan",
    "TokenStore",
    "file_sha256",
    "is_store",
    "read_pieces",
]

DEFAULT_RETRY = RetryPolicy()
# The files a local shard's first use reads whole or maps (`_open_shard_locked`), which
# `shard_files` then need not ask for: its indexes, its loss mask if any, its sidecar when it
# is served from it, and its block checksums when its reads are checked.
_READ = ("index", "docs", "untrained")
_READ_FLAT = (*_READ, "flat")  # and its sidecar, mapped
_READ_WITH_BLOCKS = (*_READ_FLAT, "flat_blocks")


@dataclass(frozen=True)
class TokenSpan:
    """Tokens of a stream range and the offsets (within the span) where documents start."""

    tokens: np.ndarray
    doc_starts: np.ndarray


class TokenStore(StoreFacts):
    """A verified, read-only view of a token store. Cheap to open; shards open on first read.

    Opening checks the manifest (its checksum and fields; bytes a host checked before, of
    SHA-256 `known.checked`, are parsed only as asked: `ManifestText`) and reads no shard file.
    A shard's first use (`_open_shard`) checks that the manifest was not replaced since, that
    its files exist and have the manifest's sizes (`shard_files`; identities its later uses
    and `same_as` compare), its record and document indexes and a masked store's loss mask
    (`shard_check`). What it serves is checked as it is read: a flat sidecar's blocks against
    their checksums (its sampled records, `sample_sha256`, at its first use where its reads
    are not checked: `flat_blocks`), ArrayRecord records by their count and sample at the
    first read through its reader (`_check_records`). `verify()` reads every byte and record.

    `path` is a directory or a `gs://` URL. `known`: the store's metadata as a plan read it
    (`StoreMeta.load`), whose manifest the open takes instead of reading and checking it again
    while the manifest file is the one it was read from (`StoreMeta.manifest_if`). A cloud
    store's shard files are checked as they are first read: a shard with a flat sidecar and
    block checksums is served from the sidecar's checked blocks (`remote_reads`), any other is
    downloaded whole, checked against its SHA-256 and read from local disk (`remote_shards`). At
    most `max_open_shards` (default $PIPELINE_MAX_OPEN_SHARDS, else
    `shard_readers.MAX_OPEN_SHARDS`) shards keep an open reader and their indexes (least
    recently read closed first; `ShardReaders`), so host memory does not grow with the corpus;
    reads that fail transiently are retried by `retry`. `flat=False` ignores the flat sidecars
    and reads every token through ArrayRecord. `check_reads` (the default) checks each block of
    a sidecar against its checksum on its first read (`flat_blocks`); False serves them as
    mapped (the feed's `verify: off`). Indexes and loss masks are checked whole at a shard's
    first use, and ArrayRecord checks each record's chunk as it reads it, either way.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        verify: bool = False,
        max_open_shards: int | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        flat: bool = True,
        check_reads: bool = True,
        known: StoreMeta | None = None,
    ) -> None:
        if max_open_shards is None:
            max_open_shards = default_max_open()
        if max_open_shards < 1:
            raise StoreError(f"{path}: max_open_shards must be at least 1, got {max_open_shards}")
        self.path = location(path)
        self._root = str(self.path)  # shards' files are joined to it as strings: cheaper
        self._manifest_file = f"{self._root}/{MANIFEST}"
        self.retry = retry
        self.check_reads = check_reads
        # Before the read: a manifest replaced in between then reads as replaced, never as ours.
        self.remote = is_url(self._root)
        self._identity = OpenedIdentity(self.path, self._manifest_file, self.remote)
        self._text = ManifestText.read(self.path, self._identity.value, known)
        self.meta = self._text.meta
        self.dtype = self.meta.dtype
        self.eod_id: int = self.meta.tokenizer["eod_id"]
        self.vocab_size: int = self.meta.tokenizer["vocab_size"]
        count = self.meta.num_shards
        self.shard_tokens = self.meta.shard_tokens
        self.masked = self.meta.masked
        # What a shard's first use loads, per shard: its indexes, loss mask and sidecar map.
        self._loaded: dict[str, list[np.ndarray | FlatBlocks | RemoteFlat | None]] = {
            key: [None] * count for key in ("index", "docs", "untrained", "flat")
        }
        self._flat = flat
        self._use_flat: list[bool | None] = [None] * count  # `_served_flat`, once asked
        self._readers = ShardReaders(
            count,
            max_open_shards,
            retry,
            new_reader=self._new_reader,
            first_read=self._first_read,
            on_drop=self._forget,
            name=self.shard_file,
        )
        self._opened = [False] * count  # the shard's first-use checks passed
        self._records_checked = [False] * count  # and those of its ArrayRecord records
        # The identities of a local shard's files (`shard_files`), taken at its first use: its
        # later uses and `same_as` compare them. A cloud store has none: its shards are checked
        # by content.
        self._file_identities: list[dict[str, FileIdentity | None] | None] = [None] * count
        if verify:
            self.verify()

    def check_unchanged(self) -> None:
        """Refuse a store that is no longer the one opened (`OpenedIdentity`): checked at a
        local shard's first use (a cloud shard's when its files fail their checks), and by a
        running feed every few seconds."""
        self._identity.check()

    @property
    def shard_starts(self) -> np.ndarray:
        """Where each shard starts in the store's stream (`StoreMeta.shard_starts`), made when
        asked: a feed's reads never do, and a store's open would spend ~15 us on it."""
        return self.meta.shard_starts

    @cached_property
    def shard_documents(self) -> np.ndarray:
        """Documents per shard (int64 [num_shards])."""
        return np.array([s["documents"] for s in self.manifest["shards"]], dtype=np.int64)

    @property
    def manifest(self) -> dict[str, Any]:
        """The store's manifest, parsed whole when first asked (`ManifestText`: a feed's
        reads ask only for the entries of the shards they use)."""
        return self._text.manifest()

    def _served_flat(self, shard: int) -> bool:
        """Whether the shard is served from its flat sidecar. A cloud store is when it has
        block checksums (`remote_reads`), else from whole shards downloaded (`remote_shards`):
        never through ArrayRecord's gs:// reader, which would download far more than it
        serves."""
        use = self._use_flat[shard]
        if use is None:
            entry = self._text.entry(shard)
            use = self._flat and "flat" in entry and (not self.remote or "flat_blocks" in entry)
            self._use_flat[shard] = use
        return use

    def same_as(self, other: TokenStore) -> bool:
        """Whether `other`, opened later with the same options, found this store's path and
        manifest unchanged, and the files of the shards this one has used are unchanged too
        (sizes, inodes, modification times), so that this one, with the shards it has already
        opened and checked, may stand in for it."""
        return (
            self.path == other.path
            and self._text.digest == other._text.digest  # the same manifest bytes
            and self._identity.value == other._identity.value
            and self._flat == other._flat
            and self._readers.max_open == other._readers.max_open
            and self.retry == other.retry
            and self.check_reads == other.check_reads
            and all(
                files_unchanged(self._root, self._text.entry(shard), identities)
                for shard, identities in enumerate(self._file_identities)
                if identities
            )
        )

    def shard_file(self, shard: int) -> Path:
        """The ArrayRecord file of shard `shard`."""
        return self.path / self._text.entry(self.check_shard(shard))["file"]

    def check_shard(self, shard: int) -> int:
        """`shard`, refused unless the store has it: a negative index would silently read
        another shard; numpy would raise IndexError."""
        if not 0 <= shard < self.num_shards:
            raise StoreError(
                f"{self.path}: shard {shard} does not exist (the store has shards "
                f"0..{self.num_shards - 1})"
            )
        return shard

    def record_offsets(self, shard: int) -> np.ndarray:
        """Prefix sums of the shard's record lengths, in memory (length records + 1)."""
        return self._index(shard, "index")

    def doc_offsets(self, shard: int) -> np.ndarray:
        """Prefix sums of the shard's document lengths, in memory (length documents + 1).

        Every document boundary is a record boundary; a long document spans several records.
        """
        return self._index(shard, "docs")

    def untrained_spans(
        self, shards: Sequence[int], starts: Sequence[int], stops: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The untrained ranges inside each token range [starts[i], stops[i]) of shard
        shards[i], as (i, first, end) arrays (`spans.spans_in_ranges`); none in a store
        without a loss mask."""
        if not self.masked:
            return (np.empty(0, np.int64),) * 3
        return spans_in_ranges(lambda shard: self._index(shard, "untrained"), shards, starts, stops)

    def read_shard_tokens(self, shard: int, start: int, stop: int) -> TokenSpan:
        """Tokens [start, stop) of one shard, reading only the records that overlap the range."""
        self.check_shard(shard)
        if not 0 <= start <= stop <= self.shard_tokens[shard]:
            raise StoreError(
                f"{self.shard_file(shard)}: token range [{start}, {stop}) is outside the shard "
                f"(0..{int(self.shard_tokens[shard])})"
            )
        if start == stop:
            return TokenSpan(np.empty(0, self.dtype), np.empty(0, np.int64))
        remote = self.flat_blocks(shard) if self.remote else None
        if remote is not None:  # its checked blocks: ArrayRecord's gs:// reader reads far more
            starts = self._doc_starts(shard, start, stop) - start
            return TokenSpan(remote.read(start, stop).copy(), starts)
        offsets = self.record_offsets(shard)
        first = int(np.searchsorted(offsets, start, side="right")) - 1
        last = int(np.searchsorted(offsets, stop, side="left"))  # exclusive
        records = self._read_records(shard, first, last)
        tokens = np.frombuffer(b"".join(records), dtype=self.dtype)
        base = int(offsets[first])
        if tokens.size != int(offsets[last]) - base:
            raise StoreError(
                f"{self.shard_file(shard)}: records {first}..{last - 1} hold {tokens.size} tokens "
                f"but the index says {int(offsets[last]) - base}; the store is corrupt"
            )
        starts = self._doc_starts(shard, start, stop) - start
        return TokenSpan(tokens[start - base : stop - base], starts)

    def read_tokens(self, start: int, stop: int) -> TokenSpan:
        """Tokens [start, stop) of the store's natural stream (shards in order)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise StoreError(
                f"{self.path}: token range [{start}, {stop}) is outside the stream "
                f"(0..{self.num_tokens})"
            )
        parts, starts = [], []
        first = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        pos = start
        for shard in range(max(first, 0), self.num_shards):
            if pos >= stop:
                break
            lo = pos - int(self.shard_starts[shard])
            hi = min(stop, int(self.shard_starts[shard + 1])) - int(self.shard_starts[shard])
            span = self.read_shard_tokens(shard, lo, hi)
            parts.append(span.tokens)
            starts.append(span.doc_starts + (pos - start))
            pos += hi - lo
        if not parts:
            return TokenSpan(np.empty(0, self.dtype), np.empty(0, np.int64))
        return TokenSpan(np.concatenate(parts), np.concatenate(starts))

    def document(self, shard: int, index: int) -> np.ndarray:
        """One whole document (with its eod), for inspection."""
        docs = self.doc_offsets(shard)
        if not 0 <= index < len(docs) - 1:
            raise StoreError(
                f"{self.shard_file(shard)}: document {index} does not exist "
                f"(the shard has documents 0..{len(docs) - 2})"
            )
        return self.read_shard_tokens(shard, int(docs[index]), int(docs[index + 1])).tokens

    def flat_tokens(self, shard: int) -> np.ndarray | None:
        """The shard's tokens from its flat sidecar, memory-mapped, its sampled records checked
        (here, where its first use left them to its checked reads) but its blocks not (read
        through `flat_blocks` to serve them); None for a shard read through ArrayRecord
        (`read_record_list`)."""
        blocks = self.flat_blocks(shard)
        if blocks is None:
            return None
        blocks.identify()  # the sampled records: its blocks are not checked here
        return blocks.tokens

    def opened(self, shard: int) -> bool:
        """Whether the shard's first use is done (its indexes loaded, its files checked): its
        `flat_blocks` then makes no request."""
        return self._opened[shard]

    def flat_blocks(self, shard: int) -> FlatBlocks | RemoteFlat | None:
        """The shard's flat sidecar as served: `FlatBlocks.read` checks each block on its first
        read (unless the store was opened with `check_reads=False`); None for a shard read
        through ArrayRecord (`read_record_list`). A cloud shard of that kind is opened here,
        so downloaded, as `piece_reads` asks for a batch's sidecars: all at once."""
        if not self._served_flat(shard):
            return self._open_shard(shard, "flat") if self.remote else None
        blocks = self._loaded["flat"][shard]
        if blocks is None:
            return self._open_shard(shard, "flat")
        self._readers.touch(shard)
        return blocks

    def shard_view(self, shard: int) -> tuple[FlatBlocks | RemoteFlat | None, np.ndarray]:
        """(`flat_blocks`, `doc_offsets`) of a shard (checked by the caller) in one call: what
        `read_pieces` reads its pieces through. A step of a big mixture reads dozens of shards,
        each once, and these calls are most of what a shard costs it."""
        return self.flat_blocks(shard), self.doc_offsets(shard)

    def held_view(
        self, shard: int
    ) -> tuple[FlatBlocks | RemoteFlat | None, np.ndarray, tuple[int, int] | None] | None:
        """`shard_view` of a shard (checked by the caller) whose first use is done, without
        marking it used, and the key that marks it (`OpenShards.touch_many`, with the other
        shards of a step under one lock; None: nothing to mark, its reads through ArrayRecord
        mark it); None when the shard is not held (`shard_view` opens it)."""
        docs = self._loaded["docs"][shard]
        if docs is None or (self.remote and not self._use_flat[shard]):
            return None
        if not self._use_flat[shard]:
            return None, docs, None
        blocks = self._loaded["flat"][shard]
        return None if blocks is None else (blocks, docs, self._readers.key(shard))

    def read_record_list(self, shard: int, records: list[int]) -> list[bytes]:
        """Records by index, under one lock. One `read(i, i + 1)` per record: in array_record
        0.8 a multi-record `read(list)` or `read(first, last)` call costs ~100 µs more than
        reading its records one by one (docs/benchmarks.md has the measurement)."""
        return self._readers.read(
            shard,
            lambda reader: [reader.read(record, record + 1)[0] for record in records],
            f"{records[0]}..{records[-1]}",
        )

    def verify(self, shards: Iterable[int] | None = None) -> None:
        """The full pass over `shards` (default: all): every file's checksum, then the manifest
        against every record.

        Per shard: the shard's first-open checks, the SHA-256 of each of its files that
        `CHECKSUMS` lists (data, indexes, and the sidecar and loss mask where it has them), its
        record count, every record's length against the index (so the dtype too), and every
        token id below the tokenizer's vocabulary size. Reads those shards whole, once.
        """
        for shard in range(self.num_shards) if shards is None else shards:
            entry = self._text.entry(self.check_shard(shard))
            if self.remote:  # the object hashed as it is downloaded, into the copy opened and
                self._local_copy(shard, fresh=True)  # read below (not a copy cached before)
            self._open_shard(shard)
            check_checksums(self.path, entry, self.remote)
            check_all_records(
                self.shard_file(shard),
                self.record_offsets(shard),
                self.dtype,
                self.vocab_size,
                lambda first, last, shard=shard: self._read_records(shard, first, last),
            )

    def close(self) -> None:
        """Close every open shard reader; a reader of a damaged file may fail to close."""
        self._readers.close()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _index(self, shard: int, key: str) -> np.ndarray:
        index = self._loaded[key][self.check_shard(shard)]
        return self._open_shard(shard, key) if index is None else index

    def _doc_starts(self, shard: int, start: int, stop: int) -> np.ndarray:
        """Shard offsets of the documents that start inside [start, stop)."""
        docs = self.doc_offsets(shard)
        first, last = np.searchsorted(docs, (start, stop), side="left")
        return docs[first:last]

    def _read_records(self, shard: int, first: int, last: int) -> list[bytes]:
        return self._readers.read(
            shard, lambda reader: reader.read(first, last), f"{first}..{last - 1}"
        )

    def _open_shard(self, shard: int, key: str = "index") -> np.ndarray | FlatBlocks | None:
        """First use of a shard: check it is still the store's, and is what the manifest says;
        returns what it loaded under `key` (`_loaded`), taken with the shard's lock held, so
        that another thread closing the shard once the lock is released cannot take it away.

        Costs its manifest entry's parse, a few `stat`s, reading and hashing its small
        indexes and mapping its sidecar: the manifest and the shard must be the files seen
        when the store was opened (a store replaced under a running feed stops here), the
        indexes must match their checksums and the manifest's counts. A shard served from its
        sidecar opens no ArrayRecord reader; the first read through ArrayRecord checks the
        records it reads from (`_check_records`)."""
        self._readers.touch(shard)  # an opened shard counts against the bound on open readers
        with self._readers.locks[shard]:
            self._open_shard_locked(shard)
            return self._loaded[key][shard]

    def _open_shard_locked(self, shard: int) -> None:
        """`_open_shard` with the shard's lock held."""
        if self._opened[shard]:
            return
        entry, root, flat = self._text.entry(shard), self._root, self._served_flat(shard)
        identities, tokens, remote = self._file_identities[shard], None, None
        if self.remote:  # its files at once, checked by content (`_fetch_shard`)
            offsets, docs, untrained, remote = self._fetch_shard(shard, entry, flat)
        else:  # direct calls: a restore's first step makes dozens of first uses
            self.check_unchanged()
            if not identities:  # the shard's first use: its files' sizes, its sidecar mapped
                read = (_READ_WITH_BLOCKS if self.check_reads else _READ_FLAT) if flat else _READ
                found = shard_files(root, shard, entry, self.dtype, read)
                if flat:  # its identity: the descriptor's mapped
                    tokens, found["flat"] = map_flat(root, shard, entry, None, self.dtype)
                self._file_identities[shard] = found  # whole: `same_as` may read it meanwhile
            elif local_identity(file := f"{root}/{entry['file']}") != identities["file"]:
                raise StoreError(
                    f"{file}: the shard was replaced or changed after the store was opened; "
                    "restart the job, or prepare the store again"
                )
            elif flat:  # the file its first use mapped
                tokens, _ = map_flat(root, shard, entry, identities["flat"], self.dtype)
            offsets = load_index(root, entry, "index", "index_sha256", entry["records"])
            docs = load_index(root, entry, "docs", "docs_sha256", entry["documents"])
            untrained = load_mask(root, entry) if self.masked else None
        if remote is not None:
            self._loaded["flat"][shard] = remote
        elif tokens is not None:
            blocks = flat_blocks(root, entry, tokens, offsets, self.check_reads)
            self._loaded["flat"][shard] = blocks
        else:
            self._check_records(shard, offsets)
        self._loaded["index"][shard] = offsets
        self._loaded["docs"][shard] = docs
        self._loaded["untrained"][shard] = untrained
        self._opened[shard] = True

    def _fetch_shard(
        self, shard: int, entry: dict[str, Any], flat: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, RemoteFlat | None]:
        """A cloud shard's first-use loads, all at once (one round trip, `remote_reads`): its
        indexes, loss mask and sidecar, checked by content against the manifest read at open
        (blocks against the store's CRCs, a whole download against its SHA-256 for ArrayRecord
        to read from disk: `remote_shards`), so nothing of a replacement is served; the store's
        identity is asked when a check fails, to name it (not at every first use on every host)."""
        root = self._root
        try:
            offsets, docs, untrained, remote, _ = together(
                lambda: load_index(root, entry, "index", "index_sha256", entry["records"]),
                lambda: load_index(root, entry, "docs", "docs_sha256", entry["documents"]),
                lambda: load_mask(root, entry) if self.masked else None,
                lambda: remote_flat(root, entry, self.dtype) if flat else None,
                lambda: None if flat else self._local_copy(shard),
            )
        except UnreachableError:
            raise  # nothing was checked: asking the identity would wait out the bound again
        except StoreError:
            self.check_unchanged()  # a replaced store is named as such, not by one of its files
            raise
        return offsets, docs, untrained, remote

    def _check_records(self, shard: int, offsets: np.ndarray) -> None:
        """First read of a shard through ArrayRecord (call with its lock held): open its reader
        and check its records (`shard_check.check_records`; again after `_forget`, on the
        reader a retried read left open, if any)."""
        if self._records_checked[shard]:
            return
        file = self.shard_file(shard)
        entry = self._text.entry(shard)
        reader = self._readers.take(shard)
        check_records(reader, file, entry, offsets, self.dtype, self.retry)
        self._readers.put(shard, reader)
        self._records_checked[shard] = True

    def _first_read(self, shard: int) -> None:
        """The checks before a read through ArrayRecord (`ShardReaders.read` calls it with the
        shard's lock held): the shard's first-use checks and those of its records."""
        self._open_shard_locked(shard)
        self._check_records(shard, self._loaded["index"][shard])

    def _forget(self, shard: int) -> None:
        """Forget what the shard's first use opened and checked, so that its next use opens
        and checks it again (`ShardReaders` calls it with the shard's lock held, when it drops
        the shard's reader)."""
        self._opened[shard] = self._records_checked[shard] = False
        for loaded in self._loaded.values():  # a thread copying from a map keeps its reference
            loaded[shard] = None

    def _local_copy(self, shard: int, fresh: bool = False) -> Path:
        """A cloud shard's local copy, checked against its SHA-256 (`remote_shards`; `fresh`:
        downloaded again even when cached)."""
        entry = self._text.entry(shard)
        return local_shard(str(self.shard_file(shard)), entry["sha256"], entry["bytes"], fresh)

    def _new_reader(self, shard: int) -> ArrayRecordReader:
        """A reader of the shard's file, or (a cloud shard) of its local copy, downloaded
        again if the cache evicted it since, or before the reader held it (`open_copy`)."""
        if self.remote:
            entry, url = self._text.entry(shard), str(self.shard_file(shard))
            return open_copy(url, entry["sha256"], entry["bytes"], open_reader)
        return open_reader(self.shard_file(shard))


def is_store(path: str | Path) -> bool:
    """Whether `path` is a complete store that this version of pipeline reads."""
    try:
        load_manifest(location(path))
    except StoreError:
        return False
    return True
