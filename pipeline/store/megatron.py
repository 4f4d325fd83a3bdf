"""A Megatron indexed dataset read in place, behind the interface the plan reads stores by.

`MegatronStore` opens an index directory written by `pipeline index PREFIX`
(megatron_index.py) and serves `PREFIX.bin` through a memory map, never rewriting it. To the
plan it is a store of one shard (the whole `.bin`), whose documents are the dataset's documents
(`docs.npy`) and whose tokens are read as they are (inplace.py says how the end of a document
is decided). What a `TokenStore` checks, it checks too:

* at open: the index's own checksum and its arrays' SHA-256, the `.bin` and `.idx` sizes and
  sampled digests against those `pipeline index` recorded (a changed file is refused by
  name: index it again);
* every read: the blocks a read touches, against the `.bin`'s block CRCs on their first read
  (`flat_blocks.FlatBlocks`; `check_reads=False` serves them as mapped);
* while running: `check_unchanged` compares the files' identities (inode, size, mtime) with
  those taken at open;
* `verify()`: the whole `.bin` against its block CRCs, the `.idx` against its SHA-256, the
  documents re-derived from the `.idx`, and every id below the vocabulary size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.store import megatron_index
from pipeline.store.flat_blocks import FlatBlocks, prefix_crcs
from pipeline.store.inplace import REINDEX, InPlaceStore, TokenScan
from pipeline.store.megatron_format import read_index
from pipeline.store.megatron_index import (
    INDEX_FILE,
    INDEX_FORMAT,
    INDEX_VERSION,
    data_files,
    indexed_prefix,
)
from pipeline.store.store_files import sha256_of


class MegatronStore(InPlaceStore):
    """A Megatron dataset, by its index directory `path`; see the module docstring."""

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
        """`megatron_index.build_index`; a column or a loss column is an error: one stream of
        ids."""
        if (column, labels, loss_mask) != (None, None, None):
            raise StoreError(
                "--column, --labels and --loss-mask are for --format parquet; a Megatron dataset "
                "has one stream"
            )
        return megatron_index.build_index(data, out, vocab_size=vocab_size)

    @classmethod
    def check_data(cls, record: dict[str, Any], path: Path, data: Path) -> None:
        """The index's prefix is `data`."""
        prefix = indexed_prefix(record, Path(os.path.abspath(path)))
        if prefix.resolve() != Path(data).resolve():
            raise StoreError(
                f"{path}: indexes {prefix}, the source reads {data}; index that "
                "dataset (`pipeline index PREFIX --out DIR`) and name its directory"
            )

    def __init__(self, path: str | Path, *, verify: bool = False, check_reads: bool = True):
        super().__init__(path, check_reads)
        self.bin_path, self.idx_path = data_files(indexed_prefix(self.manifest, self.path))
        self._check_file("bin", self.bin_path, self.manifest["bin"])
        self._check_file("idx", self.idx_path, self.manifest["idx"])
        docs = self._array("docs", self.manifest["num_documents"] + 1)
        tokens = np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"), mode="r")
        flat = FlatBlocks(
            Path(f"{self.path}: {self.bin_path}"),  # the index dir first: the plan keys by it
            tokens,
            self._array("blocks"),
            block_bytes=self.manifest["block_bytes"],
            whole_sha256="",
            check=check_reads,
            remedy=REINDEX,
        )
        self._shards([self.bin_path], [docs], [flat])
        if verify:
            self.verify()

    def _watched(self) -> dict[str, Path]:
        return {**super()._watched(), "bin": self.bin_path, "idx": self.idx_path}

    def verify(self, shards: object = None) -> None:
        """The full pass: every byte of both files against what `pipeline index` recorded."""
        if sha256_of(self.idx_path) != self.manifest["idx"]["sha256"]:
            raise StoreError(f"{self.idx_path}: does not match its SHA-256 in the index; {REINDEX}")
        offsets = read_index(self.idx_path).document_offsets(self.manifest["bin"]["bytes"])
        if not np.array_equal(np.unique(offsets), self._docs[0]):
            raise StoreError(f"{self.path / 'docs.npy'}: does not match {self.idx_path}; {REINDEX}")
        scan = TokenScan(self.bin_path, self.dtype)
        crcs = prefix_crcs(self.bin_path, self.manifest["block_bytes"], scan)
        if int(crcs[-1]) != self.manifest["bin"]["crc32c"]:
            raise StoreError(
                f"{self.bin_path}: does not match its checksum in the index; {REINDEX}"
            )
        if scan.max_id >= self.vocab_size:
            raise StoreError(
                f"{self.bin_path}: token id {scan.max_id} is not below the vocabulary size "
                f"{self.vocab_size}"
            )
