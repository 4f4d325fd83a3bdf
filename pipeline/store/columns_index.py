"""`pipeline index DIR_OR_GLOB --format parquet`: Parquet/Arrow token columns, indexed once.

Each file of the corpus (columns_files.py) is a shard; each row of its token column
(`--column`, default `input_ids`) is a document, used as it is (inplace.py: the end-of-document
rule). One pass decodes every chunk (row group or record batch) and records, in the index
directory (default `DIR.pipeline-index/` beside a directory; a glob needs `--out`)::

    columns-index.json   the files (sizes, sampled digests, documents, chunks), column, loss
                         column (`loss`, loss_column.py), dtype, eod, fingerprint, its own
                         checksum
    docs.npy             int64 per file: its documents' token offsets (documents + 1)
    chunks.npy           int64 per file: its chunks' token offsets (chunks + 1)
    crcs.npy             uint32 per chunk: the CRC32C of its ids (little-endian, file dtype)
    untrained.npy        int64 [k, 2]: the token ranges that carry no loss (loss column)

A read decodes the chunks it needs and checks each against its CRC32C as it decodes it (unless
reads are unchecked), so a changed file serves nothing wrong; the open checks the files' sizes
and sampled digests, and the fingerprint (over the chunks' CRCs and the documents) says
whether a resumed run reads the same data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from pipeline.errors import StoreError
from pipeline.in_place import DEFAULT_COLUMN, default_index_dir
from pipeline.store.columns_files import ColumnFile, column_files
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
from pipeline.store.loss_column import LossColumn

INDEX_FILE = "columns-index.json"
INDEX_FORMAT = "pipeline-columns-index"
INDEX_VERSION = 1
DOCS, CHUNKS, CRCS, UNTRAINED = "docs.npy", "chunks.npy", "crcs.npy", "untrained.npy"


def chunk_crc(values: np.ndarray) -> int:
    """CRC32C of a chunk's ids, as little-endian bytes of their dtype."""
    data = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return google_crc32c.extend(0, data.view(np.uint8))


def columns_index_dir(data: str | Path) -> Path:
    """The default index directory of a directory of files or of one file (beside it, as a
    Megatron dataset's); a glob has none."""
    if not Path(data).exists():
        raise StoreError(f"{data}: the index of a glob needs a directory: --out DIR")
    return default_index_dir(Path(data).resolve())


def runs(positions: np.ndarray) -> np.ndarray:
    """Ascending positions as int64 [k, 2] (start, end) ranges of consecutive ones."""
    if not positions.size:
        return np.empty((0, 2), np.int64)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    firsts = positions[np.concatenate([[0], breaks])]
    lasts = positions[np.concatenate([breaks - 1, [positions.size - 1]])]
    return np.stack([firsts, lasts + 1], axis=1).astype(np.int64)


def index_file(path: Path, column: str, loss: LossColumn | None = None) -> dict[str, Any]:
    """One file's documents, chunk offsets, chunk CRCs, documents' last ids, largest id and,
    with a `loss` column, its untrained token ranges."""
    file = ColumnFile(path, column, loss)
    scan = TokenScan(path, file.dtype)
    lengths, sizes, crcs, ends = [np.zeros(1, np.int64)], [0], [], []
    untrained = [np.empty(0, np.int64)]
    for chunk in range(file.count):
        chunk_lengths, values = file.chunk(chunk)
        scan(memoryview(np.ascontiguousarray(values)).cast("B"))
        if loss is not None:
            no_loss = loss.untrained(file, chunk, chunk_lengths, values)
            untrained.append(np.flatnonzero(no_loss) + sum(sizes))
        lengths.append(chunk_lengths)
        sizes.append(values.size)
        crcs.append(chunk_crc(values))
        ends.append(values[np.cumsum(chunk_lengths)[chunk_lengths > 0] - 1])
    offsets = np.cumsum(np.concatenate(lengths))
    return {
        "dtype": file.dtype,
        "offsets": offsets,
        "docs": nonempty(offsets),
        "chunks": np.cumsum(sizes).astype(np.int64),
        "crcs": np.array(crcs, dtype=np.uint32),
        "ends": np.concatenate([np.empty(0, file.dtype), *ends]),
        "max_id": scan.max_id,
        "untrained": runs(np.concatenate(untrained)),
    }


def build_columns_index(
    data: str | Path,
    out: str | Path | None = None,
    *,
    column: str = DEFAULT_COLUMN,
    labels: str | None = None,
    loss_mask: str | None = None,
    vocab_size: int | None = None,
) -> Path:
    """Index the token column of the Parquet/Arrow files at `data` (a directory or a glob)
    into `out` (default beside a directory); returns the index directory. A `labels` column
    (Hugging Face's: -100 where a token carries no loss) or a `loss_mask` column (0/1, 0: no
    loss; not both) gives the corpus a loss mask."""
    loss = LossColumn.given(labels, loss_mask)
    target = columns_index_dir(data) if out is None else Path(out)
    files = column_files(data)
    found = [index_file(path, column, loss) for path in files]
    dtypes = {str(f["dtype"]) for f in found}
    if len(dtypes) > 1:
        raise StoreError(f"{data}: the files' {column!r} ids differ in type ({', '.join(dtypes)})")
    vocab = vocabulary(max(f["max_id"] for f in found), vocab_size, Path(data))
    index_dir(target)
    entries = [
        {
            "file": str(path.resolve()),
            **file_entry(path),
            "documents": int(f["docs"].size - 1),
            "empty_documents": int(f["offsets"].size - f["docs"].size),
            "chunks": int(f["crcs"].size),
            "untrained_spans": len(f["untrained"]),
        }
        for path, f in zip(files, found)
    ]
    tokens = [int(f["docs"][-1]) for f in found]
    if not sum(tokens):
        raise StoreError(f"{data}: column {column!r} holds no tokens")
    eod = eod_of(np.concatenate([f["ends"] for f in found]))
    record: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "format_version": INDEX_VERSION,
        "data": str(Path(data).resolve()) if Path(data).is_dir() else str(data),
        "column": column,
        "loss": None if loss is None else loss.to_record(),
        "masked": loss is not None,
        "dtype": dtypes.pop(),
        "files": entries,
        "num_documents": sum(e["documents"] for e in entries),
        "num_tokens": sum(tokens),
        "shard_tokens": tokens,
        "eod": "ends" if eod >= 0 else "none",
        "tokenizer": tokenizer_entry(f"columns:{Path(data).name}", vocab, eod),
        "docs": DOCS,
        "docs_sha256": save_array(target, DOCS, np.concatenate([f["docs"] for f in found])),
        "chunks": CHUNKS,
        "chunks_sha256": save_array(target, CHUNKS, np.concatenate([f["chunks"] for f in found])),
        "crcs": CRCS,
        "crcs_sha256": save_array(target, CRCS, np.concatenate([f["crcs"] for f in found])),
        "untrained": UNTRAINED,
        "untrained_sha256": save_array(
            target, UNTRAINED, np.concatenate([f["untrained"] for f in found])
        ),
    }
    content = {key: record[key] for key in ("dtype", "column", "shard_tokens", "docs_sha256")}
    content.update(crcs=record["crcs_sha256"], untrained=record["untrained_sha256"])
    write_record(target, INDEX_FILE, record, content)
    return target
