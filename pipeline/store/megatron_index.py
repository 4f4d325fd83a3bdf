"""`pipeline index PREFIX`: what the plan needs of a Megatron dataset, computed once, kept apart.

A Megatron dataset is read in place (pipeline/store/megatron.py): its `.bin` is never
rewritten. What the plan and the checked reads need of it is computed here, in one pass over
the `.bin` and one over the `.idx`, into an index directory (default `PREFIX.pipeline-index/`
beside the data, or one the user names)::

    megatron-index.json   the dataset's files (sizes, digests), counts, dtype, eod, fingerprint
    docs.npy              int64 token offsets of the documents in the .bin (documents + 1)
    blocks.npy            uint32 running CRC32C of the .bin at every 64 KiB (flat_blocks.py)

The index describes itself (`manifest_sha256`, as a store's manifest does) and lists the SHA-256
of its arrays. Identity: the `.idx`'s SHA-256, the `.bin`'s whole CRC32C, and a sampled digest
of each (the first, last and two middle 64 KiB blocks: `identity.sample_digest`), which an open
re-derives in a few reads; a changed file of the same size is refused at open when the samples
differ, and otherwise at the first read of a changed block (its checksum).

End of document: Megatron's preprocessing appends an EOD id to each document when asked
(`--append-eod`), and then every document ends with that id. The index looks: when every
non-empty document ends with the same id, that id is the dataset's `eod_id` (`eod: ends`);
otherwise the documents carry no end token (`eod: none`, `eod_id` -1). Either way nothing is
inserted: document boundaries come from the index, and segment ids and positions restart at
each one. Empty documents (two equal document indices) hold no token and are left out of
`docs.npy`; their count is recorded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.store.flat_blocks import BLOCK_BYTES, prefix_crcs
from pipeline.store.identity import MANIFEST_CHECKSUM, manifest_digest, sample_digest
from pipeline.store.megatron_format import read_index
from pipeline.store.store_files import file_sha256

INDEX_FILE = "megatron-index.json"
INDEX_FORMAT = "pipeline-megatron-index"
INDEX_VERSION = 1
DEFAULT_SUFFIX = ".pipeline-index"
DOCS, BLOCKS = "docs.npy", "blocks.npy"
ID_LIMIT = 2**31  # the plan's token buffers are int32


def default_index_dir(prefix: str | Path) -> Path:
    """Where `pipeline index PREFIX` keeps the index when no directory is named."""
    return Path(f"{prefix}{DEFAULT_SUFFIX}")


def data_files(prefix: str | Path) -> tuple[Path, Path]:
    """(`PREFIX.bin`, `PREFIX.idx`)."""
    return Path(f"{prefix}.bin"), Path(f"{prefix}.idx")


def sampled_digest(path: Path, block_bytes: int = BLOCK_BYTES) -> str:
    """The digest of a few fixed blocks of the file (`identity.sample_digest` over its blocks)."""
    size = path.stat().st_size
    with path.open("rb") as file:

        def block(index: int) -> bytes:
            file.seek(index * block_bytes)
            return file.read(block_bytes)

        return sample_digest(math.ceil(size / block_bytes), block)


class TokenScan:
    """The per-chunk checks of the `.bin`'s tokens during the CRC pass: every id a whole
    number in [0, 2**31), and the largest one."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.max_id, self.at = path, dtype.newbyteorder("<"), -1, 0

    def __call__(self, chunk: bytes) -> None:
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


def build_index(
    prefix: str | Path, out: str | Path | None = None, *, vocab_size: int | None = None
) -> Path:
    """Index the Megatron dataset at `prefix` into `out` (default `default_index_dir`); returns
    the directory. One pass over each file; `vocab_size` defaults to the largest id + 1."""
    prefix = Path(os.path.abspath(prefix))
    bin_path, idx_path = data_files(prefix)
    for path in (bin_path, idx_path):
        if not path.is_file():
            raise StoreError(
                f"{path}: no such file (a Megatron dataset is PREFIX.bin + PREFIX.idx)"
            )
    index = read_index(idx_path)
    bin_bytes = bin_path.stat().st_size
    offsets = index.document_offsets(bin_bytes)
    scan = TokenScan(bin_path, index.dtype)
    crcs = prefix_crcs(bin_path, BLOCK_BYTES, scan)
    sizes = np.diff(offsets)
    docs = offsets[np.concatenate([np.flatnonzero(sizes), [len(sizes)]])]
    tokens = np.memmap(bin_path, dtype=index.dtype.newbyteorder("<"), mode="r")
    ends = tokens[docs[1:] - 1] if docs.size > 1 else np.empty(0, index.dtype)
    eod = int(ends[0]) if ends.size and np.all(ends == ends[0]) else -1
    vocab = scan.max_id + 1 if vocab_size is None else vocab_size
    if vocab <= scan.max_id:
        raise StoreError(f"{bin_path}: token id {scan.max_id} is not below --vocab-size {vocab}")
    target = default_index_dir(prefix) if out is None else Path(out)
    target.mkdir(parents=True, exist_ok=True)
    np.save(target / DOCS, docs.astype(np.int64))
    np.save(target / BLOCKS, crcs)
    idx_sha256 = file_sha256(idx_path)
    record: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "prefix": str(prefix),
        "dtype": index.dtype.name,
        "bin": {
            "bytes": bin_bytes,
            "crc32c": int(crcs[-1]),
            "sample_sha256": sampled_digest(bin_path),
        },
        "idx": {
            "bytes": idx_path.stat().st_size,
            "sha256": idx_sha256,
            "sample_sha256": sampled_digest(idx_path),
        },
        "num_documents": int(docs.size - 1),
        "empty_documents": int(sizes.size - (docs.size - 1)),
        "num_tokens": int(offsets[-1]),
        "eod": "ends" if eod >= 0 else "none",
        "tokenizer": {
            "name": f"megatron:{prefix.name}",
            "kind": "megatron",
            "spec": "",
            "model_sha256": "",
            "vocab_size": vocab,
            "eod_id": eod,
        },
        "docs": DOCS,
        "docs_sha256": file_sha256(target / DOCS),
        "blocks": BLOCKS,
        "blocks_sha256": file_sha256(target / BLOCKS),
        "block_bytes": BLOCK_BYTES,
    }
    content = {key: record[key] for key in ("dtype", "num_tokens", "docs_sha256")}
    content.update(idx=idx_sha256, bin=record["bin"]["crc32c"], bin_bytes=bin_bytes)
    record["fingerprint"] = hashlib.sha256(
        json.dumps(content, sort_keys=True).encode()
    ).hexdigest()[:16]
    record[MANIFEST_CHECKSUM] = manifest_digest(record)
    temporary = target / f"{INDEX_FILE}.tmp"
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True))
    temporary.replace(target / INDEX_FILE)  # written last: a directory without it is no index
    return target


def load_index_record(path: Path) -> dict[str, Any]:
    """The index record in directory `path`, checked to be one this version reads and its own."""
    file = path / INDEX_FILE
    try:
        record = json.loads(file.read_text())
    except FileNotFoundError:
        raise StoreError(
            f"{path}: no Megatron index here ({INDEX_FILE} is missing); run "
            "`pipeline index PREFIX` (with --out DIR for this directory)"
        ) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise StoreError(f"{file}: unreadable Megatron index: {error}") from None
    if not isinstance(record, dict) or record.get("format") != INDEX_FORMAT:
        raise StoreError(f"{file}: not a {INDEX_FORMAT} file")
    if record.get("format_version") != INDEX_VERSION:
        raise StoreError(
            f"{file}: index version {record.get('format_version')}, this version of pipeline "
            f"reads {INDEX_VERSION}: run `pipeline index` again"
        )
    if record.get(MANIFEST_CHECKSUM) != manifest_digest(record):
        raise StoreError(
            f"{file}: its checksum ({MANIFEST_CHECKSUM}) does not match its content: it was "
            "edited or damaged; run `pipeline index` again"
        )
    return record


def is_index(path: Path) -> bool:
    """Whether `path` is a directory holding a Megatron index (what `formats` dispatches on)."""
    return (Path(path) / INDEX_FILE).is_file()
