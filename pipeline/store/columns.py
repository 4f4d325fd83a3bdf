"""Parquet/Arrow token columns read in place, behind the interface the plan reads stores by.

`ColumnStore` opens an index directory written by `pipeline index DIR_OR_GLOB --format
parquet` (columns_index.py). Each file is a shard; its documents are its rows. The files are
never rewritten: a read decodes the chunks (row groups, record batches) it needs and checks
each against the CRC32C the index recorded on its first decode in the process (unless reads
are unchecked), as a flat sidecar's blocks are checked on their first read. Arrow chunks are
views of a memory map and are kept; decoded Parquet chunks are copies, and the last
`KEEP_BYTES` of them are kept per file. At open, the files' sizes and sampled digests are
checked against the index; `check_unchanged` compares their identities with those taken at
open; `verify()` decodes and checks every chunk and re-derives every file's documents.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.in_place import DEFAULT_COLUMN
from pipeline.store.columns_files import ColumnFile, column_files
from pipeline.store.columns_index import (
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_VERSION,
    build_columns_index,
    chunk_crc,
    index_file,
)
from pipeline.store.inplace import REINDEX, InPlaceStore
from pipeline.store.loss_column import LossColumn

KEEP_BYTES = 64 << 20  # decoded Parquet chunks kept per file (Arrow chunks are mapped views)


class ChunkReader:
    """A file's ids by token range, decoded chunk by chunk and checked on decode."""

    def __init__(
        self,
        path: Path,
        column: str,
        starts: np.ndarray,
        crcs: np.ndarray,
        check: bool,
        index: Path,
    ) -> None:
        self.path, self.column, self.check = path, column, check
        self.index = index  # errors name the index directory first: the plan keys by it
        self.starts, self.crcs = starts, crcs.tolist()
        self._file: ColumnFile | None = None
        self._decoded: OrderedDict[int, np.ndarray] = OrderedDict()
        self._held = 0  # bytes of decoded Parquet chunks in `_decoded`
        self._checked: set[int] = set()  # chunks whose CRC passed in this process
        self._lock = threading.Lock()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Ids [start, stop) of the file (a non-empty range)."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        last = int(np.searchsorted(self.starts, stop, side="left"))
        parts = []
        for chunk in range(first, last):
            base = int(self.starts[chunk])
            lo, hi = max(start, base) - base, min(stop, int(self.starts[chunk + 1])) - base
            parts.append(self.chunk(chunk)[lo:hi])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def chunk(self, index: int) -> np.ndarray:
        """Chunk `index`'s ids: decoded (and checked) or kept from an earlier read."""
        with self._lock:
            values = self._decoded.get(index)
            if values is not None:
                self._decoded.move_to_end(index)
                return values
            values = self.decode(index, self.check and index not in self._checked)[1]
            self._checked.add(index)
            self._decoded[index] = values
            if self.path.suffix == ".parquet":  # a copy: keep the last KEEP_BYTES of them
                self._held += values.nbytes
                while self._held > KEEP_BYTES and len(self._decoded) > 1:
                    self._held -= self._decoded.popitem(last=False)[1].nbytes
            return values

    def decode(self, index: int, check: bool) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, ids) of chunk `index` from the file, its size and (`check`) its CRC32C
        against the index."""
        try:
            if self._file is None:
                self._file = ColumnFile(self.path, self.column)
            lengths, values = self._file.chunk(index)
        except StoreError as error:
            raise StoreError(f"{self.index}: {error}") from error
        expected = int(self.starts[index + 1] - self.starts[index])
        if values.size != expected or (check and chunk_crc(values) != self.crcs[index]):
            raise StoreError(
                f"{self.index}: {self.path}: chunk {index} (row group or record batch) does "
                f"not match its size and checksum in the index; {REINDEX}"
            )
        return lengths, values


class ColumnStore(InPlaceStore):
    """Parquet/Arrow token columns, by their index directory `path`; see the module
    docstring."""

    RECORD, KIND, VERSION = INDEX_FILE, INDEX_FORMAT, INDEX_VERSION

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
        """`build_columns_index` of `column` (default `DEFAULT_COLUMN`) and a loss column."""
        return build_columns_index(
            data,
            out,
            column=column or DEFAULT_COLUMN,
            labels=labels,
            loss_mask=loss_mask,
            vocab_size=vocab_size,
        )

    @classmethod
    def check_data(cls, record: dict[str, Any], path: Path, data: Path) -> None:
        """The files the source's directory or glob holds now are the indexed files."""
        indexed = [Path(entry["file"]) for entry in record["files"]]
        found = [file.resolve() for file in column_files(data)]
        for file in found:
            if file not in indexed:
                raise StoreError(f"{file}: not in the index {path}; {REINDEX}")
        for file in indexed:
            if file not in found:
                raise StoreError(f"{file}: indexed in {path}, but not in {data}; {REINDEX}")

    def __init__(self, path: str | Path, *, verify: bool = False, check_reads: bool = True):
        super().__init__(path, check_reads)
        entries = self.manifest["files"]
        files = [Path(entry["file"]) for entry in entries]
        for number, (file, entry) in enumerate(zip(files, entries)):
            self._check_file(f"file{number}", file, entry)
        docs = self._per_file("docs", [e["documents"] + 1 for e in entries])
        chunks = self._per_file("chunks", [e["chunks"] + 1 for e in entries])
        crcs = self._per_file("crcs", [e["chunks"] for e in entries])
        self._untrained = self._per_file("untrained", [e["untrained_spans"] for e in entries])
        column = self.manifest["column"]
        readers = [
            ChunkReader(file, column, starts, crc, check_reads, self.path)
            for file, starts, crc in zip(files, chunks, crcs)
        ]
        self._shards(files, docs, readers)
        if verify:
            self.verify()

    def _watched(self) -> dict[str, Path]:
        return {**super()._watched(), **{f"file{n}": f for n, f in enumerate(self._files)}}

    def _per_file(self, key: str, counts: list[int]) -> list[np.ndarray]:
        """An index array cut into the files' parts (`counts` entries each)."""
        return np.split(self._array(key), np.cumsum(counts)[:-1])

    def verify(self, shards: Iterable[int] | None = None) -> None:
        """The full pass over `shards` (all by default; a process's share in the feed's
        background check): each file indexed again (every chunk decoded), its documents, chunk
        CRCs and loss mask compared with the index, every id below the vocabulary size."""
        loss = LossColumn.of_record(self.manifest)
        for shard in range(len(self._files)) if shards is None else shards:
            file, reader = self._files[shard], self._readers[shard]
            found = index_file(file, self.manifest["column"], loss)
            same = (
                np.array_equal(found["docs"], self._docs[shard])
                and np.array_equal(found["chunks"], reader.starts)
                and found["crcs"].tolist() == reader.crcs
                and np.array_equal(found["untrained"], self._untrained[shard])
            )
            if not same:
                raise StoreError(f"{file}: its content is not as indexed; {REINDEX}")
            if found["max_id"] >= self.vocab_size:
                raise StoreError(
                    f"{file}: token id {found['max_id']} is not below the vocabulary size "
                    f"{self.vocab_size}"
                )
