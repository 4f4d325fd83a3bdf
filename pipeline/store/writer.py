"""Writing a token store: shards, indexes, manifest, and the atomic commit.

Both prepare runners (the local one and Apache Beam) call these functions, so there is exactly
one definition of the on-disk format. A store is built in a hidden temporary directory beside
its destination and renamed into place after the manifest is written: a directory that opens as
a store is always complete.

Cloud Storage has no rename. A `gs://` store is staged in a local directory (or, for Beam's
workers, under a hidden prefix beside the destination) and copied into place file by file with
the manifest last: until the manifest object exists the prefix does not open as a store. An
`INCOMPLETE` marker object, written before the first file and deleted after the manifest, tells
the next prepare of the same `--out` that what it finds there is an interrupted upload, which
it replaces. ArrayRecord writes local files only, so a shard is always written locally and then
copied.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from pipeline.errors import PrepareError
from pipeline.store.doc_ids import IDS_SUFFIX, write_ids
from pipeline.store.flat_blocks import BLOCK_BYTES, prefix_crcs
from pipeline.store.identity import MANIFEST_CHECKSUM, manifest_digest, sample_digest
from pipeline.store.meta import FORMAT_NAME, FORMAT_VERSION, MANIFEST, MASKED_FORMAT_VERSION
from pipeline.store.shard_readers import READER_OPTIONS
from pipeline.store.store_files import FLAT_SUFFIX, file_sha256
from pipeline.urls import check_reachable, clear_prefix, copy_file, is_url, remove_tree
from pipeline.version import VERSION_KEY, __version__

# One record per chunk: reading a record never decompresses its neighbours.
WRITER_OPTIONS = "group_size:1,uncompressed"
# Long documents are split into records of at most this many tokens, so a window reads about
# what it needs rather than a whole book; short documents stay one record each.
DEFAULT_RECORD_TOKENS = 2048
# In a cloud store's prefix from before its first file is copied until after its manifest:
# there without a manifest, it marks the leftovers of an interrupted upload.
INCOMPLETE = ".incomplete"


@dataclass(frozen=True)
class ShardInfo:
    file: str
    index: str
    docs: str
    documents: int
    records: int
    tokens: int
    bytes: int
    sha256: str
    index_sha256: str
    docs_sha256: str
    sample_sha256: str
    flat: str | None = None  # the optional flat token sidecar (docs/token-store.md)
    flat_sha256: str | None = None
    flat_blocks: str | None = None  # the sidecar's block checksums (flat_blocks.py)
    flat_blocks_sha256: str | None = None
    flat_block_bytes: int | None = None
    untrained: str | None = None  # only in stores with a loss mask (format version 4)
    untrained_sha256: str | None = None
    ids: str | None = None  # only in stores with document ids (doc_ids.py)
    ids_sha256: str | None = None


def token_dtype(vocab_size: int) -> np.dtype:
    """The most compact unsigned dtype that holds every id, eod included."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


def write_shard(
    directory: Path,
    shard: int,
    num_shards: int,
    documents: Iterable[np.ndarray] | Iterable[tuple[np.ndarray, np.ndarray]],
    dtype: np.dtype,
    record_tokens: int = DEFAULT_RECORD_TOKENS,
    flat: bool = True,
    masked: bool = False,
    ids: bool = False,
) -> ShardInfo:
    """Write one shard (documents already end with eod) and its record and document indexes,
    and with `flat` the same tokens once more as one raw array: the sidecar the feed reads.

    With `masked`, each document is `(tokens, untrained)`: `untrained` an int64 `[k, 2]` array
    of the document's untrained `[start, stop)` token ranges, written (as shard offsets) to the
    shard's untrained-span index. With `ids`, each document is `(document, id)` (`document` as
    above), the ids written to the shard's id file (`doc_ids`).
    """
    args = (shard, num_shards, documents, dtype, record_tokens, flat, masked, ids)
    if not is_url(directory):
        return _write_local_shard(directory, *args)
    with tempfile.TemporaryDirectory(prefix="pipeline-shard-") as local:
        info = _write_local_shard(Path(local), *args)
        for path in sorted(Path(local).iterdir()):  # every file the shard has, whatever it is
            copy_file(path, directory / path.name)
    return info


def _write_local_shard(
    directory: Path,
    shard: int,
    num_shards: int,
    documents: Iterable[np.ndarray] | Iterable[tuple[np.ndarray, np.ndarray]],
    dtype: np.dtype,
    record_tokens: int,
    flat: bool,
    masked: bool,
    ids: bool,
) -> ShardInfo:
    name = shard_name(shard, num_shards)
    data_path = directory / f"{name}.array_record"
    index_path = directory / f"{name}.index.npy"
    docs_path = directory / f"{name}.docs.npy"
    flat_path = directory / f"{name}.{FLAT_SUFFIX}"
    record_lengths, doc_lengths, spans, doc_ids = [], [], [], []
    base = 0
    writer = ArrayRecordWriter(str(data_path), WRITER_OPTIONS)
    sidecar = open(flat_path, "wb") if flat else None  # noqa: SIM115 (closed below)
    try:
        for document in documents:
            if ids:
                document, document_id = document
                doc_ids.append(document_id)
            if masked:
                document, untrained = document
                spans.append(np.asarray(untrained, np.int64).reshape(-1, 2) + base)
            tokens = np.ascontiguousarray(document, dtype=dtype)
            base += len(tokens)
            for start in range(0, len(tokens), record_tokens):
                chunk = tokens[start : start + record_tokens]
                writer.write(chunk.tobytes())
                record_lengths.append(len(chunk))
            if sidecar is not None:
                sidecar.write(tokens.tobytes())
            doc_lengths.append(len(tokens))
    finally:
        writer.close()
        if sidecar is not None:
            sidecar.close()
    np.save(index_path, _prefix_sums(record_lengths))
    np.save(docs_path, _prefix_sums(doc_lengths))
    reader = ArrayRecordReader(str(data_path), READER_OPTIONS)
    try:
        sample = sample_digest(len(record_lengths), lambda i: reader.read(i, i + 1)[0])
    finally:
        reader.close()
    sidecar_info = _sidecar_info(flat_path, directory / f"{name}.blocks.npy") if flat else {}
    if masked:
        untrained_path = directory / f"{name}.untrained.npy"
        np.save(untrained_path, np.concatenate([np.zeros((0, 2), np.int64), *spans]))
        sidecar_info["untrained"] = untrained_path.name
        sidecar_info["untrained_sha256"] = file_sha256(untrained_path)
    if ids:
        ids_path = directory / f"{name}.{IDS_SUFFIX}"
        write_ids(ids_path, doc_ids)
        sidecar_info["ids"] = ids_path.name
        sidecar_info["ids_sha256"] = file_sha256(ids_path)
    return ShardInfo(
        file=data_path.name,
        index=index_path.name,
        docs=docs_path.name,
        documents=len(doc_lengths),
        records=len(record_lengths),
        tokens=int(sum(doc_lengths)),
        bytes=data_path.stat().st_size,
        sha256=file_sha256(data_path),
        index_sha256=file_sha256(index_path),
        docs_sha256=file_sha256(docs_path),
        sample_sha256=sample,
        **sidecar_info,
    )


def _sidecar_info(flat_path: Path, blocks_path: Path) -> dict[str, Any]:
    """The manifest fields of a shard's flat sidecar: its checksum, and the file of its block
    checksums (written here) that the feed checks each block against on its first read."""
    np.save(blocks_path, prefix_crcs(flat_path, BLOCK_BYTES))
    return {
        "flat": flat_path.name,
        "flat_sha256": file_sha256(flat_path),
        "flat_blocks": blocks_path.name,
        "flat_blocks_sha256": file_sha256(blocks_path),
        "flat_block_bytes": BLOCK_BYTES,
    }


def _prefix_sums(lengths: list[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def write_manifest(
    directory: Path,
    shards: list[ShardInfo],
    tokenizer: dict[str, Any],
    dtype: np.dtype,
    created: dict[str, Any],
) -> None:
    """Write the manifest last: its presence is what makes the directory a store.

    The manifest records the release that wrote it (`pipeline_version`); the store's
    fingerprint leaves it out, so a store prepared again by a later release is the same data.
    A store with a loss mask is format version 4, which older readers refuse rather than
    train on every token; a store without one stays version 3, byte for byte as before.
    """
    masked = any(s.untrained is not None for s in shards)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": MASKED_FORMAT_VERSION if masked else FORMAT_VERSION,
        "tokenizer": tokenizer,
        "dtype": np.dtype(dtype).name,
        "num_documents": sum(s.documents for s in shards),
        "num_records": sum(s.records for s in shards),
        "num_tokens": sum(s.tokens for s in shards),
        "shards": [_entry(s) for s in shards],
        "created": created,
        VERSION_KEY: __version__,  # the release that wrote it; not part of the fingerprint
    }
    manifest[MANIFEST_CHECKSUM] = manifest_digest(manifest)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def synthetic_tokenizer(vocab_size: int, eod_id: int) -> dict[str, Any]:
    """The manifest's tokenizer entry of a synthetic store (tests, benchmarks): no model, so
    nothing can tokenize text for it, only the ids it declares."""
    return {
        "name": "synthetic",
        "kind": "synthetic",
        "model_sha256": "",
        "spec": "synthetic",
        "vocab_size": vocab_size,
        "eod_id": eod_id,
    }


def _entry(shard: ShardInfo) -> dict[str, Any]:
    """A shard's manifest entry; optional files that were not written are not listed."""
    return {key: value for key, value in asdict(shard).items() if value is not None}


def staging_dir(out: Path, shared: bool = False) -> Path:
    """A fresh hidden directory beside `out`, on the same filesystem so the rename is atomic.

    For a URL `out`: a local temporary directory, or with `shared` (writers on other machines)
    a hidden prefix beside `out`; `commit` copies either into place. A local staging
    directory's name carries this process's id, so the next `prepare` of the same `out` can
    tell a leftover of a killed run (`clean_leftovers`) from the staging of a run still going.
    """
    if is_url(out):
        if shared:
            return out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
        return Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-"))
    clean_leftovers(out)
    path = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def clean_leftovers(out: Path) -> list[Path]:
    """Remove what killed runs of `prepare --out OUT` left beside OUT; returns what it removed.

    `.OUT.partial-PID-*`: a staging directory whose process (on this machine) is gone;
    `.OUT.retired-*`: a replaced store that `--overwrite` was deleting when it was killed.
    """
    removed = []
    if not out.parent.is_dir():
        return removed
    for path in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        kind, _, rest = path.name[len(out.name) + 2 :].partition("-")
        owner = rest.split("-")[0]
        dead = kind == "retired" or (kind == "partial" and not _running(owner))
        if dead and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _running(pid: str) -> bool:
    if not pid.isdigit():
        return False  # an older run's name (no pid): nothing can still be writing it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse, before any work, an `--out` that exists (without `overwrite`) or that is not a
    directory (`overwrite` replaces directories only)."""
    if is_url(out):  # a bucket prefix: it exists when it holds an object
        check_reachable(out)
        if out.exists() and not overwrite and not interrupted_upload(out):
            raise PrepareError(f"{out}: output directory exists (pass --overwrite to replace it)")
        return
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise PrepareError(
            f"{out}: --out exists and is not a directory (--overwrite replaces a directory, "
            "deleting whatever it holds); remove it or choose another --out"
        )
    if not overwrite:
        raise PrepareError(f"{out}: output directory exists (pass --overwrite to replace it)")


def commit(staging: Path, out: Path, overwrite: bool) -> None:
    """Move a complete store into place; an existing one is replaced only with `overwrite`."""
    check_destination(out, overwrite)
    if is_url(out):
        _copy_into_place(staging, out)
    elif out.exists():
        retired = out.parent / f".{out.name}.retired-{uuid.uuid4().hex[:8]}"
        os.rename(out, retired)
        os.rename(staging, out)
        shutil.rmtree(retired)
    else:
        os.rename(staging, out)


def interrupted_upload(out: Any) -> bool:
    """Whether a cloud `out` holds what an interrupted commit left: the marker, no manifest."""
    return (out / INCOMPLETE).exists() and not (out / MANIFEST).exists()


def _copy_into_place(staging: Path, out: Any) -> None:
    """Commit to an object store, in an order that never leaves a half-written store that opens
    and that the same command, run again, always finishes:

    1. the `INCOMPLETE` marker: from here until step 5, `out` is an unfinished upload;
    2. the old manifest is deleted, so an old store stops opening before any of its files go,
       then every other object under `out` but the marker (an old store, or an earlier
       interrupted upload);
    3. the staged files are copied, whatever files the store has;
    4. the manifest, last: from here `out` opens as the new store;
    5. the marker is deleted, then the staging.
    """
    marker = out / INCOMPLETE
    marker.write_text(f"an upload of {staging}: interrupted if there is no {MANIFEST}\n")
    old_manifest = out / MANIFEST
    if old_manifest.exists():
        old_manifest.unlink()
    clear_prefix(out, keep=INCOMPLETE)
    for source in sorted(staging.iterdir()):
        if source.name != MANIFEST:
            copy_file(source, out / source.name)
    copy_file(staging / MANIFEST, out / MANIFEST)
    marker.unlink()
    remove_tree(staging)
