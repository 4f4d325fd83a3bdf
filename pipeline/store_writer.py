"""Writing a token store: shards, indexes, manifest, and the atomic commit.

Both prepare runners (the local one and Apache Beam) call these functions, so there is exactly
one definition of the on-disk format. A store is built in a hidden temporary directory beside
its destination and renamed into place after the manifest is written: a directory that opens as
a store is always complete.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from pipeline.errors import PrepareError
from pipeline.store import FORMAT_NAME, FORMAT_VERSION, MANIFEST, file_sha256

# One record per chunk: reading a document never decompresses its neighbours.
WRITER_OPTIONS = "group_size:1,uncompressed"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    index: str
    documents: int
    tokens: int
    bytes: int
    sha256: str
    index_sha256: str


def token_dtype(vocab_size: int) -> np.dtype:
    """The most compact unsigned dtype that holds every id, eod included."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def write_shard(
    directory: Path, shard: int, num_shards: int, documents: Iterable[np.ndarray], dtype: np.dtype
) -> ShardInfo:
    """Write one shard (documents already end with eod) and its index of prefix sums."""
    name = shard_name(shard, num_shards)
    data_path = directory / f"{name}.array_record"
    index_path = directory / f"{name}.index.npy"
    lengths = []
    writer = ArrayRecordWriter(str(data_path), WRITER_OPTIONS)
    try:
        for tokens in documents:
            writer.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
            lengths.append(len(tokens))
    finally:
        writer.close()
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(index_path, offsets)
    return ShardInfo(
        file=data_path.name,
        index=index_path.name,
        documents=len(lengths),
        tokens=int(offsets[-1]),
        bytes=data_path.stat().st_size,
        sha256=file_sha256(data_path),
        index_sha256=file_sha256(index_path),
    )


def write_manifest(
    directory: Path,
    shards: list[ShardInfo],
    tokenizer: dict[str, Any],
    dtype: np.dtype,
    created: dict[str, Any],
) -> None:
    """Write the manifest last: its presence is what makes the directory a store."""
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tokenizer": tokenizer,
        "dtype": np.dtype(dtype).name,
        "num_documents": sum(s.documents for s in shards),
        "num_tokens": sum(s.tokens for s in shards),
        "shards": [asdict(s) for s in shards],
        "created": created,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def staging_dir(out: Path) -> Path:
    """A fresh hidden directory beside `out`, on the same filesystem so the rename is atomic."""
    path = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise PrepareError(f"{out}: output directory exists (pass --overwrite to replace it)")


def commit(staging: Path, out: Path, overwrite: bool) -> None:
    """Move a complete store into place; an existing one is replaced only with `overwrite`."""
    check_destination(out, overwrite)
    if out.exists():
        retired = out.parent / f".{out.name}.retired-{uuid.uuid4().hex[:8]}"
        os.rename(out, retired)
        os.rename(staging, out)
        shutil.rmtree(retired)
    else:
        os.rename(staging, out)
