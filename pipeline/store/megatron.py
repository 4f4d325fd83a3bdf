"""A Megatron indexed dataset read in place, behind the interface the plan reads stores by.

`MegatronStore` opens an index directory written by `pipeline index PREFIX`
(megatron_index.py) and serves `PREFIX.bin` through a memory map, never rewriting it. To the
plan it is a store of one shard (the whole `.bin`), whose documents are the dataset's documents
(`docs.npy`) and whose tokens are read as they are (`megatron_index` says how the end of a
document is decided). What a `TokenStore` checks, it checks too:

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

import numpy as np

from pipeline.errors import StoreError
from pipeline.store.flat_blocks import FlatBlocks, prefix_crcs
from pipeline.store.megatron_format import read_index
from pipeline.store.megatron_index import (
    INDEX_FILE,
    TokenScan,
    data_files,
    load_index_record,
    sampled_digest,
)
from pipeline.store.meta import StoreFacts, StoreMeta
from pipeline.store.store_files import FileIdentity, identity_or_none, sha256_of
from pipeline.store.token_store import TokenSpan

REINDEX = "the dataset changed after `pipeline index`: run it again (a new fingerprint)"


def load_megatron_meta(path: str | Path) -> StoreMeta:
    """What the plan needs (fingerprint, tokens, dtype, ids), from the index record alone."""
    path = Path(path)
    record = load_index_record(path)
    return StoreMeta(
        path,
        record["fingerprint"],
        np.array([record["num_tokens"]], dtype=np.int64),
        np.dtype(record["dtype"]),
        record["tokenizer"],
    )


class MegatronStore(StoreFacts):
    """A Megatron dataset, by its index directory `path`; see the module docstring."""

    masked = False

    def __init__(self, path: str | Path, *, verify: bool = False, check_reads: bool = True):
        self.path = Path(os.path.abspath(path))
        self.check_reads = check_reads
        self._identities = {"index": identity_or_none(self.path / INDEX_FILE)}
        self.manifest = load_index_record(self.path)
        self.meta = load_megatron_meta(self.path)
        self.dtype = self.meta.dtype
        self.eod_id: int = self.manifest["tokenizer"]["eod_id"]
        self.vocab_size: int = self.manifest["tokenizer"]["vocab_size"]
        self.bin_path, self.idx_path = data_files(self.manifest["prefix"])
        for key, file in (("bin", self.bin_path), ("idx", self.idx_path)):
            self._identities[key] = self._check_file(file, self.manifest[key])
        self._docs = self._array("docs", self.manifest["num_documents"] + 1)
        crcs = self._array("blocks", None)
        if int(self._docs[-1]) != self.num_tokens or int(self._docs[0]) != 0:
            raise StoreError(
                f"{self.path / 'docs.npy'}: does not span the {self.num_tokens} tokens"
            )
        tokens = np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"), mode="r")
        self._flat = FlatBlocks(
            Path(f"{self.path}: {self.bin_path}"),  # the index dir first: the plan keys by it
            tokens,
            crcs,
            block_bytes=self.manifest["block_bytes"],
            whole_sha256="",
            check=check_reads,
            remedy=REINDEX,
        )
        self.shard_tokens = self.meta.shard_tokens
        self.shard_starts = self.meta.shard_starts
        self.shard_documents = np.array([self.num_documents], dtype=np.int64)
        if verify:
            self.verify()

    def _check_file(self, file: Path, recorded: dict) -> FileIdentity:
        """The file's identity, refused unless its size and sampled digest are as indexed."""
        identity = identity_or_none(file)
        if identity is None:
            raise StoreError(f"{file}: missing (indexed in {self.path / INDEX_FILE})")
        if identity.size != recorded["bytes"] or sampled_digest(file) != recorded["sample_sha256"]:
            raise StoreError(f"{file}: {REINDEX}")
        return identity

    def _array(self, key: str, length: int | None) -> np.ndarray:
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
        if shard != 0:
            raise StoreError(
                f"{self.bin_path}: shard {shard} does not exist (a Megatron dataset is shard 0)"
            )
        return shard

    def shard_file(self, shard: int) -> Path:
        self.check_shard(shard)
        return self.bin_path

    def doc_offsets(self, shard: int) -> np.ndarray:
        self.check_shard(shard)
        return self._docs

    record_offsets = doc_offsets  # a document is one record: reads never go through records

    def flat_blocks(self, shard: int) -> FlatBlocks:
        self.check_shard(shard)
        return self._flat

    def flat_tokens(self, shard: int) -> np.ndarray:
        return self.flat_blocks(shard).tokens

    def untrained_spans(self, shards, starts, stops) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """No loss mask: every token is trained on."""
        return (np.empty(0, np.int64),) * 3

    def trained(self, shard: int, start: int, stop: int) -> np.ndarray:
        """Every token is trained on (no loss mask)."""
        self.check_shard(shard)
        return np.ones(stop - start, dtype=bool)

    def read_shard_tokens(self, shard: int, start: int, stop: int) -> TokenSpan:
        self.check_shard(shard)
        return self.read_tokens(start, stop)

    def read_tokens(self, start: int, stop: int) -> TokenSpan:
        """Tokens [start, stop) of the `.bin` (blocks checked) and the document starts in it."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise StoreError(
                f"{self.bin_path}: token range [{start}, {stop}) is outside the dataset "
                f"(0..{self.num_tokens})"
            )
        if start == stop:
            return TokenSpan(np.empty(0, self.dtype), np.empty(0, np.int64))
        first, last = np.searchsorted(self._docs, (start, stop), side="left")
        return TokenSpan(self._flat.read(start, stop), self._docs[first:last] - start)

    def document(self, shard: int, index: int) -> np.ndarray:
        """One whole document, as stored."""
        if not 0 <= index < self.num_documents:
            raise StoreError(
                f"{self.bin_path}: document {index} does not exist (0..{self.num_documents - 1})"
            )
        return self.read_shard_tokens(
            shard, int(self._docs[index]), int(self._docs[index + 1])
        ).tokens

    def verify(self, shards: object = None) -> None:
        """The full pass: every byte of both files against what `pipeline index` recorded."""
        if sha256_of(self.idx_path) != self.manifest["idx"]["sha256"]:
            raise StoreError(f"{self.idx_path}: does not match its SHA-256 in the index; {REINDEX}")
        index = read_index(self.idx_path)
        offsets = index.document_offsets(self.manifest["bin"]["bytes"])
        if not np.array_equal(np.unique(offsets), self._docs):
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

    def check_unchanged(self) -> None:
        """Refuse a dataset or index whose files were replaced since this store opened them."""
        files = {"index": self.path / INDEX_FILE, "bin": self.bin_path, "idx": self.idx_path}
        for key, file in files.items():
            if identity_or_none(file) != self._identities[key]:
                raise StoreError(
                    f"{file}: replaced or changed after it was opened; restart the job"
                )

    def same_as(self, other: object) -> bool:
        """Whether `other`, opened later, found the same files (see `TokenStore.same_as`)."""
        return (
            isinstance(other, MegatronStore)
            and self.path == other.path
            and self.manifest == other.manifest
            and self._identities == other._identities
            and self.check_reads == other.check_reads
        )

    def close(self) -> None:
        """Nothing to close: the memory map goes with the store."""

    def __enter__(self) -> MegatronStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
