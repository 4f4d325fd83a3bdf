"""`pipeline index PREFIX`: what the plan needs of a Megatron dataset, computed once, kept apart.

A Megatron dataset is read in place (pipeline/store/megatron.py): its `.bin` is never
rewritten. What the plan and the checked reads need of it is computed here, in one pass over
the `.bin` and one over the `.idx`, into an index directory (default `PREFIX.pipeline-index/`
beside the data, or one the user names)::

    megatron-index.json   the dataset's files (sizes, digests), counts, dtype, eod, fingerprint
    docs.npy              int64 token offsets of the documents in the .bin (documents + 1)
    blocks.npy            uint32 running CRC32C of the .bin at every 64 KiB (flat_blocks.py)

The record describes itself (`manifest_sha256`, as a store's manifest does) and lists the
SHA-256 of its arrays (inplace.py has what the formats share, the end-of-document rule too).
Identity: the `.idx`'s SHA-256, the `.bin`'s whole CRC32C, and a sampled digest of each (the
first, last and two middle 64 KiB blocks), which an open re-derives in a few reads; a changed
file of the same size is refused at open when the samples differ, and otherwise at the first
read of a changed block (its checksum). Empty documents (two equal document indices) hold no
token and are left out of `docs.npy`; their count is recorded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.in_place import default_index_dir
from pipeline.store.flat_blocks import BLOCK_BYTES, prefix_crcs
from pipeline.store.inplace import (
    TokenScan,
    eod_of,
    file_entry,
    index_dir,
    nonempty,
    save_array,
    tokenizer_entry,
    vocabulary,
    write_record,
)
from pipeline.store.megatron_format import read_index
from pipeline.store.store_files import file_sha256

INDEX_FILE = "megatron-index.json"
INDEX_FORMAT = "pipeline-megatron-index"
INDEX_VERSION = 1
DOCS, BLOCKS = "docs.npy", "blocks.npy"


def indexed_prefix(record: dict[str, Any], index: Path) -> Path:
    """The dataset prefix an index (directory `index`) records: absolute, or relative to the
    index directory (an index beside its data)."""
    prefix = Path(record["prefix"])
    return prefix if prefix.is_absolute() else Path(os.path.normpath(index / prefix))


def data_files(prefix: str | Path) -> tuple[Path, Path]:
    """(`PREFIX.bin`, `PREFIX.idx`)."""
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def build_index(
    prefix: str | Path, out: str | Path | None = None, *, vocab_size: int | None = None
) -> Path:
    """Index the Megatron dataset at `prefix` into `out` (default `default_index_dir`); returns
    the directory. One pass over each file; `vocab_size` defaults to the largest id + 1."""
    prefix = Path(os.path.abspath(prefix))
    if prefix.suffix in (".bin", ".idx") and prefix.is_file():  # a file named for its prefix
        prefix = prefix.with_suffix("")
    bin_path, idx_path = data_files(prefix)
    for path in (bin_path, idx_path):
        if not path.is_file():
            other = (
                f"; {prefix} is a directory: for its Parquet/Arrow files give --format parquet"
                if prefix.is_dir()
                else ""
            )
            raise StoreError(
                f"{path}: no such file (a Megatron dataset is PREFIX.bin + PREFIX.idx){other}"
            )
    index = read_index(idx_path)
    bin_bytes = bin_path.stat().st_size
    offsets = index.document_offsets(bin_bytes)
    if offsets[-1] == 0:  # nothing to map, nothing to train on
        raise StoreError(f"{bin_path}: the dataset holds no tokens; nothing to index")
    scan = TokenScan(bin_path, index.dtype)
    crcs = prefix_crcs(bin_path, BLOCK_BYTES, scan)
    docs = nonempty(offsets)
    tokens = np.memmap(bin_path, dtype=index.dtype.newbyteorder("<"), mode="r")
    eod = eod_of(tokens[docs[1:] - 1] if docs.size > 1 else [])
    vocab = vocabulary(scan.max_id, vocab_size, bin_path)
    target = default_index_dir(prefix) if out is None else Path(out)
    index_dir(target)
    # an index beside its data names it relatively, so a copy of both reads the copy's data
    beside = Path(os.path.abspath(target)).parent == prefix.parent
    recorded = os.path.relpath(prefix, os.path.abspath(target)) if beside else str(prefix)
    idx_sha256 = file_sha256(idx_path)
    record: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "prefix": recorded,
        "dtype": index.dtype.name,
        "bin": {**file_entry(bin_path), "crc32c": int(crcs[-1])},
        "idx": {**file_entry(idx_path), "sha256": idx_sha256},
        "num_documents": int(docs.size - 1),
        "empty_documents": int(offsets.size - docs.size),
        "num_tokens": int(offsets[-1]),
        "shard_tokens": [int(offsets[-1])],
        "masked": False,
        "eod": "ends" if eod >= 0 else "none",
        "tokenizer": tokenizer_entry(f"megatron:{prefix.name}", vocab, eod),
        "docs": DOCS,
        "docs_sha256": save_array(target, DOCS, docs.astype(np.int64)),
        "blocks": BLOCKS,
        "blocks_sha256": save_array(target, BLOCKS, crcs),
        "block_bytes": BLOCK_BYTES,
    }
    content = {key: record[key] for key in ("dtype", "num_tokens", "docs_sha256")}
    content.update(idx=idx_sha256, bin=record["bin"]["crc32c"], bin_bytes=bin_bytes)
    write_record(target, INDEX_FILE, record, content)
    return target
