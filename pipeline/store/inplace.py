"""Corpora read in place: what their index records and their stores have in common.

A corpus that is already tokenized (a Megatron `.bin/.idx`, Parquet or Arrow token columns) is
read where it lies. `pipeline index` writes, once, an index directory holding a self-checksummed
JSON record (the files' sizes and sampled digests, counts, dtype, end-of-document id,
fingerprint) and the arrays the plan needs, each listed with its SHA-256. `InPlaceStore` opens
such a directory and offers what the plan reads of a `TokenStore` (metadata, document offsets,
checked reads of token ranges per shard); each format's store supplies its shards' readers.

End of document, for every format: nothing is inserted. When every non-empty document ends with
the same id, that id is the corpus's `eod_id` (`eod: ends`); otherwise documents carry no end
token (`eod: none`, `eod_id` -1). Document boundaries come from the index either way.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.errors import StoreError
from pipeline.store.identity import MANIFEST_CHECKSUM, manifest_digest, sample_digest
from pipeline.store.meta import StoreFacts, StoreMeta
from pipeline.store.spans import spans_in_ranges
from pipeline.store.store_files import FileIdentity, identity_or_none, sha256_of
from pipeline.store.token_store import TokenSpan
from pipeline.version import VERSION_KEY, __version__

REINDEX = "the dataset changed after `pipeline index`: run it again (a new fingerprint)"
SAMPLE_BYTES = 1 << 16
ID_LIMIT = 2**31  # the plan's token buffers are int32


def sampled_digest(path: Path, block_bytes: int = SAMPLE_BYTES) -> str:
    """The digest of a few fixed blocks of the file (`identity.sample_digest` over its blocks)."""
    size = path.stat().st_size
    with path.open("rb") as file:

        def block(index: int) -> bytes:
            file.seek(index * block_bytes)
            return file.read(block_bytes)

        return sample_digest(math.ceil(size / block_bytes), block)


def file_entry(path: Path) -> dict[str, Any]:
    """What an index records of a data file to know it again at open: size, sampled digest."""
    return {"bytes": path.stat().st_size, "sample_sha256": sampled_digest(path)}


class TokenScan:
    """The checks of a corpus's ids as `pipeline index` reads them: every id a whole number in
    [0, 2**31), and the largest one."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.max_id, self.at = path, dtype.newbyteorder("<"), -1, 0

    def __call__(self, chunk: bytes | memoryview) -> None:
        tokens = np.frombuffer(chunk, dtype=self.dtype)
        if tokens.size:
            low, high = tokens.min(), tokens.max()
            whole = self.dtype.kind != "f" or bool(np.all(tokens == np.floor(tokens)))
            if low < 0 or high >= ID_LIMIT or not whole:
                raise StoreError(
                    f"{self.path}: tokens from byte {self.at} on are not all whole ids in "
                    f"[0, 2**31) (found {low}..{high}); not a token dataset"
                )
            self.max_id = max(self.max_id, int(high))
        self.at += len(chunk)


def nonempty(offsets: np.ndarray) -> np.ndarray:
    """Document offsets (documents + 1) without the empty documents' repeated entries."""
    sizes = np.diff(offsets)
    return offsets[np.concatenate([np.flatnonzero(sizes), [len(sizes)]])]


def eod_of(last_tokens: np.ndarray) -> int:
    """The id every document ends with, or -1 when they do not share one."""
    ends = np.asarray(last_tokens)
    return int(ends[0]) if ends.size and np.all(ends == ends[0]) else -1


def vocabulary(max_id: int, vocab_size: int | None, where: Path) -> int:
    """`vocab_size`, default the largest id + 1; refused when an id is not below it."""
    vocab = max_id + 1 if vocab_size is None else vocab_size
    if vocab <= max_id:
        raise StoreError(f"{where}: token id {max_id} is not below --vocab-size {vocab}")
    return vocab


def write_record(target: Path, name: str, record: dict[str, Any], content: dict) -> None:
    """Seal `record` (its `fingerprint` from `content`, the identity of the data; its own
    checksum) and write it as `target/name`, last, atomically: a directory without it is no
    index."""
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    record["fingerprint"] = digest
    record[VERSION_KEY] = __version__  # the release that wrote it, outside the fingerprint
    record[MANIFEST_CHECKSUM] = manifest_digest(record)
    temporary = target / f"{name}.tmp"
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True))
    temporary.replace(target / name)


def tokenizer_entry(name: str, vocab_size: int, eod_id: int) -> dict[str, Any]:
    """The manifest-shaped tokenizer of a corpus whose files name none."""
    return {
        "name": name,
        "kind": "in-place",
        "spec": "",
        "model_sha256": "",
        "vocab_size": vocab_size,
        "eod_id": eod_id,
    }


def save_array(target: Path, name: str, array: np.ndarray) -> str:
    """Save an index array; returns its SHA-256 for the record."""
    np.save(target / name, array)
    return sha256_of(target / name)


def load_record(path: Path, name: str, kind: str, version: int) -> dict[str, Any]:
    """The index record `name` in directory `path`, checked to be a `kind` record of
    `version`, and its own."""
    file = path / name
    try:
        record = json.loads(file.read_text())
    except FileNotFoundError:
        raise StoreError(
            f"{path}: no index here ({name} is missing); run `pipeline index` (with --out DIR "
            "for this directory)"
        ) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StoreError(f"{file}: unreadable index: {error}") from None
    if not isinstance(record, dict) or record.get("format") != kind:
        raise StoreError(f"{file}: not a {kind} file")
    if record.get("format_version") != version:
        raise StoreError(
            f"{file}: index version {record.get('format_version')}, this version of pipeline "
            f"reads {version}: run `pipeline index` again"
        )
    if record.get(MANIFEST_CHECKSUM) != manifest_digest(record):
        raise StoreError(
            f"{file}: its checksum ({MANIFEST_CHECKSUM}) does not match its content: it was "
            "edited or damaged; run `pipeline index` again"
        )
    return record


def record_meta(path: Path, record: dict[str, Any]) -> StoreMeta:
    """What the plan needs of an indexed corpus (fingerprint, tokens per shard, dtype, ids)."""
    return StoreMeta(
        path,
        record["fingerprint"],
        np.array(record["shard_tokens"], dtype=np.int64),
        np.dtype(record["dtype"]),
        record["tokenizer"],
        record["masked"],
    )


def index_dir(target: Path) -> Path:
    """`target` created for an index (a `pipeline index --out` that cannot be is one line)."""
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StoreError(f"{target}: cannot create the index directory: {error.strerror}") from None
    return target


class ShardReader(Protocol):
    """A shard's tokens as `read_pieces` copies them: `read(start, stop)`, checked."""

    def read(self, start: int, stop: int) -> np.ndarray: ...


class InPlaceStore(StoreFacts):
    """The part of a corpus read in place that does not depend on its format: the index
    record, its arrays, the data files' identities, and token reads through each shard's
    reader (`_readers`, set by the format's store with `_shards`)."""

    RECORD = ""  # the record's file name in the index directory
    KIND = ""  # its `format`
    VERSION = 1

    @classmethod
    def build_index(
        cls,
        data: str | Path,
        out: str | Path | None,
        *,
        column: str | None,
        labels: str | None,
        loss_mask: str | None,
        vocab_size: int | None,
    ) -> Path:
        """Index the corpus at `data` into `out` (None: the format's default directory) and
        return the index directory (`pipeline index`: the command picks the class by format,
        the class checks the options its format takes)."""
        raise NotImplementedError

    @classmethod
    def check_data(cls, record: dict[str, Any], path: Path, data: Path) -> None:
        """Refuse the index `record` (in directory `path`) unless it indexes the corpus at
        `data`, as it is now: a source whose `index:` names another corpus's index, or whose
        files were added or removed since, would read other data than its `path:` says."""
        raise NotImplementedError

    def __init__(self, path: str | Path, check_reads: bool) -> None:
        self.path = Path(os.path.abspath(path))
        self.check_reads = check_reads
        self._identities: dict[str, FileIdentity | None] = {
            "index": identity_or_none(self.path / self.RECORD)
        }
        self.manifest = load_record(self.path, self.RECORD, self.KIND, self.VERSION)
        self.meta = record_meta(self.path, self.manifest)
        self.dtype = self.meta.dtype
        self.masked = self.meta.masked
        self._untrained: list[np.ndarray] = []  # a masked corpus's spans, per shard
        self.eod_id: int = self.manifest["tokenizer"]["eod_id"]
        self.vocab_size: int = self.manifest["tokenizer"]["vocab_size"]
        self.shard_tokens = self.meta.shard_tokens
        self.shard_starts = self.meta.shard_starts
        self._files: list[Path] = []
        self._docs: list[np.ndarray] = []
        self._readers: list[ShardReader] = []

    def _shards(self, files: list[Path], docs: list[np.ndarray], readers: list) -> None:
        """The shards' data files, document offsets and readers, checked against the record."""
        for file, offsets, tokens in zip(files, docs, self.shard_tokens.tolist()):
            if offsets[0] != 0 or offsets[-1] != tokens:
                raise StoreError(f"{file}: the index's documents do not span its {tokens} tokens")
        self._files, self._docs, self._readers = files, docs, readers
        self.shard_documents = np.array([len(d) - 1 for d in docs], dtype=np.int64)

    def _check_file(self, key: str, file: Path, recorded: dict[str, Any]) -> None:
        """Take the file's identity, refused unless its size and sampled digest are as
        indexed."""
        identity = identity_or_none(file)
        if identity is None:
            raise StoreError(f"{file}: missing (indexed in {self.path / self.RECORD})")
        if identity.size != recorded["bytes"] or sampled_digest(file) != recorded["sample_sha256"]:
            raise StoreError(f"{file}: {REINDEX}")
        self._identities[key] = identity

    def _array(self, key: str, length: int | None = None) -> np.ndarray:
        """An array of the index directory, checked against its SHA-256 (and length)."""
        file = self.path / self.manifest[key]
        try:
            data = file.read_bytes()
        except OSError as error:
            raise StoreError(f"{file}: cannot read: {error.strerror}") from None
        if sha256_of(data) != self.manifest[f"{key}_sha256"]:
            raise StoreError(f"{file}: does not match its checksum; run `pipeline index` again")
        array = np.load(file)
        if length is not None and len(array) != length:
            raise StoreError(f"{file}: {len(array)} entries, expected {length}")
        return array

    def check_shard(self, shard: int) -> int:
        if not 0 <= shard < self.num_shards:
            raise StoreError(
                f"{self.path}: shard {shard} does not exist (0..{self.num_shards - 1})"
            )
        return shard

    def shard_file(self, shard: int) -> Path:
        return self._files[self.check_shard(shard)]

    def doc_offsets(self, shard: int) -> np.ndarray:
        return self._docs[self.check_shard(shard)]

    record_offsets = doc_offsets  # a document is one record: reads never go through records

    def flat_blocks(self, shard: int) -> ShardReader:
        """The shard's reader: `read_pieces` copies from it (checked reads)."""
        return self._readers[self.check_shard(shard)]

    def shard_view(self, shard: int) -> tuple[ShardReader, np.ndarray]:
        """(`flat_blocks`, `doc_offsets`) in one call, as `read_pieces` reads a shard."""
        shard = self.check_shard(shard)
        return self._readers[shard], self._docs[shard]

    def held_view(self, shard: int) -> tuple[ShardReader, np.ndarray, None]:
        """`shard_view`, and no key to mark it used by: an in-place corpus's files stay open."""
        return (*self.shard_view(shard), None)

    def untrained_spans(
        self, shards: Sequence[int], starts: Sequence[int], stops: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The untrained ranges inside each token range [starts[i], stops[i]) of shard
        shards[i], as (i, first, end) arrays (`spans.spans_in_ranges`); none without a mask."""
        if not self.masked:
            return (np.empty(0, np.int64),) * 3
        return spans_in_ranges(self._untrained.__getitem__, shards, starts, stops)

    def read_shard_tokens(self, shard: int, start: int, stop: int) -> TokenSpan:
        """Tokens [start, stop) of a shard (checked) and the document starts in the range."""
        size = int(self.shard_tokens[self.check_shard(shard)])
        if not 0 <= start <= stop <= size:
            raise StoreError(
                f"{self.shard_file(shard)}: token range [{start}, {stop}) is outside the shard "
                f"(0..{size})"
            )
        if start == stop:
            return TokenSpan(np.empty(0, self.dtype), np.empty(0, np.int64))
        docs = self._docs[shard]
        first, last = np.searchsorted(docs, (start, stop), side="left")
        return TokenSpan(self._readers[shard].read(start, stop), docs[first:last] - start)

    def read_tokens(self, start: int, stop: int) -> TokenSpan:
        """Tokens [start, stop) of the natural stream (shards in order)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise StoreError(
                f"{self.path}: token range [{start}, {stop}) is outside the stream "
                f"(0..{self.num_tokens})"
            )
        parts, starts = [np.empty(0, self.dtype)], [np.empty(0, np.int64)]
        for shard in range(self.num_shards):
            base = int(self.shard_starts[shard])
            lo, hi = max(start, base), min(stop, int(self.shard_starts[shard + 1]))
            if lo < hi:
                span = self.read_shard_tokens(shard, lo - base, hi - base)
                parts.append(span.tokens)
                starts.append(span.doc_starts + (lo - start))
        return TokenSpan(np.concatenate(parts), np.concatenate(starts))

    def document(self, shard: int, index: int) -> np.ndarray:
        """One whole document, as stored."""
        docs = self.doc_offsets(shard)
        if not 0 <= index < len(docs) - 1:
            raise StoreError(
                f"{self.shard_file(shard)}: document {index} does not exist (0..{len(docs) - 2})"
            )
        return self.read_shard_tokens(shard, int(docs[index]), int(docs[index + 1])).tokens

    def _watched(self) -> dict[str, Path]:
        """The files whose identities `check_unchanged` compares, by `_identities` key."""
        return {"index": self.path / self.RECORD}

    def data_files(self) -> list[Path]:
        """The corpus's files this index reads (what `verify-store` checked, by name)."""
        return [file for key, file in self._watched().items() if key != "index"]

    def check_unchanged(self) -> None:
        """Refuse a corpus or index whose files were replaced since this store opened them."""
        for key, file in self._watched().items():
            if identity_or_none(file) != self._identities[key]:
                raise StoreError(
                    f"{file}: replaced or changed after it was opened; restart the job"
                )

    def same_as(self, other: object) -> bool:
        """Whether `other`, opened later, found the same files (see `TokenStore.same_as`)."""
        return (
            type(other) is type(self)
            and self.path == other.path
            and self.manifest == other.manifest
            and self._identities == other._identities
            and self.check_reads == other.check_reads
        )

    def close(self) -> None:
        """Nothing to close: memory maps and decoded chunks go with the store."""

    def __enter__(self) -> InPlaceStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
