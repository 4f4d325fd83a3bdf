"""What makes a token store itself: the manifest's checksum and each shard's sampled records.

Both the writer and the reader use these functions, so what prepare records is by construction
what every reader re-derives:

* `manifest_sha256`: the manifest checks itself; any edit of a count, the dtype or a checksum
  (or a truncated file) is refused when the store is opened.
* `sample_sha256` per shard: a digest of a few records at fixed positions (`sample_records`),
  checked when a shard is first opened. A same-size shard of another store (a twin prepared
  with another seed or from other text) cannot pass it without reading as the same records.
* `check_manifest`: the shape of a manifest (every field present with the right type, the flat
  token sidecar's `flat`/`flat_sha256` optional but both or neither, its block checksums
  `BLOCK_KEYS` optional but all or none, the document id file `ID_KEYS` in every shard or in
  none), so a damaged manifest
  is one line naming the manifest and the field, never a traceback. A masked store (format
  version 4) lists each shard's loss mask and its checksum (`MASK_KEYS`); others list none.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import StoreError

MANIFEST_CHECKSUM = "manifest_sha256"
DTYPES = ("uint16", "uint32")
SHARD_INTS = ("documents", "records", "tokens", "bytes")
SHARD_STRS = ("file", "index", "docs", "sha256", "index_sha256", "docs_sha256", "sample_sha256")
MASK_KEYS = ("untrained", "untrained_sha256")  # a masked store's per-shard loss mask
BLOCK_KEYS = ("flat_blocks", "flat_blocks_sha256", "flat_block_bytes")  # optional, with "flat"
ID_KEYS = ("ids", "ids_sha256")  # optional document ids (doc_ids.py): in every shard or none
TOTALS = (("num_documents", "documents"), ("num_records", "records"), ("num_tokens", "tokens"))


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON, its own checksum field left out."""
    body = {key: value for key, value in manifest.items() if key != MANIFEST_CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sample_records(records: int) -> list[int]:
    """The records a shard's identity samples: the first, the last and two between."""
    if records <= 0:
        return []
    return sorted({0, records // 3, (2 * records) // 3, records - 1})


def sample_digest(records: int, read: Callable[[int], bytes]) -> str:
    """SHA-256 over the sampled records (index, length and bytes of each); `read(i)` reads one."""
    digest = hashlib.sha256()
    for index in sample_records(records):
        data = read(index)
        digest.update(f"{index}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()


def check_manifest(manifest: Any, path: str | Path, masked: bool = False) -> None:
    """Refuse a manifest whose fields are missing, mistyped, inconsistent or not its own; a
    `masked` store's shards each list their loss mask (`MASK_KEYS`), other stores' none."""
    if not isinstance(manifest, dict):
        raise StoreError(f"{path}: a manifest is a JSON object, got {type(manifest).__name__}")
    if manifest.get(MANIFEST_CHECKSUM) != manifest_digest(manifest):
        raise StoreError(
            f"{path}: the manifest's checksum ({MANIFEST_CHECKSUM}) does not match its content: "
            "it was edited or damaged; prepare the store again"
        )
    _require(manifest.get("dtype") in DTYPES, path, "dtype", f"one of {', '.join(DTYPES)}")
    tokenizer = manifest.get("tokenizer")
    _require(isinstance(tokenizer, dict), path, "tokenizer", "an object")
    for key in ("name", "kind", "spec", "model_sha256"):
        _require(isinstance(tokenizer.get(key), str), path, f"tokenizer.{key}", "a string")
    for key in ("vocab_size", "eod_id"):
        _require(_count(tokenizer.get(key)), path, f"tokenizer.{key}", "an integer >= 0")
    _require(
        tokenizer["eod_id"] < tokenizer["vocab_size"], path, "tokenizer.eod_id", "< vocab_size"
    )
    shards = manifest.get("shards")
    _require(isinstance(shards, list) and shards, path, "shards", "a non-empty list")
    ids = any(name in shards[0] for name in ID_KEYS)  # then in every shard: all or none
    for index, entry in enumerate(shards):
        if not isinstance(entry, dict):
            _require(False, path, f"shards[{index}]", "an object")
        bad = _shard_field(entry, masked, ids)  # no message built for a good one: 1,000s a mix
        if bad is not None:
            _require(False, path, f"shards[{index}].{bad[0]}", bad[1])
    for total, field in TOTALS:
        expected = sum(entry[field] for entry in shards)
        _require(manifest.get(total) == expected, path, total, f"the shards' sum {expected}")


def _shard_field(entry: dict[str, Any], masked: bool, ids: bool) -> tuple[str, str] | None:
    """The first field of a manifest's shard entry that is wrong, and what it must be; None
    when all are right (`check_manifest`). Plain loops and `in` tests: a restore of a big
    mixture checks thousands of entries."""
    get = entry.get
    for name in SHARD_INTS:
        value = get(name)
        if type(value) is not int or value < 0:  # a JSON integer, not a bool
            return name, "an integer >= 0"
    for name in SHARD_STRS + MASK_KEYS if masked else SHARD_STRS:
        if not isinstance(get(name), str):
            return name, "a string"
    if not masked:
        for name in MASK_KEYS:
            if name in entry:
                return name, "absent (format 3 has no mask)"
    for name in _FILES[masked]:
        if not _file_name(entry[name]):
            return name, "a file name"
    if "flat" in entry or "flat_sha256" in entry:  # the optional flat token sidecar
        for name in ("flat", "flat_sha256"):
            if not isinstance(get(name), str):
                return name, "a string"
        if not _file_name(entry["flat"]):
            return "flat", "a file name"
    if not entry.keys().isdisjoint(BLOCK_KEYS):
        if "flat" not in entry:  # its block checksums (flat_blocks.py)
            return "flat", "present with flat_blocks"
        for name in BLOCK_KEYS[:2]:
            if not isinstance(get(name), str):
                return name, "a string"
        if not _file_name(entry["flat_blocks"]):
            return "flat_blocks", "a file name"
        size = get("flat_block_bytes")
        if not (_count(size) and size >= 4 and size & (size - 1) == 0):
            return "flat_block_bytes", "a power of two >= 4"
    if ids or not entry.keys().isdisjoint(ID_KEYS):  # as shards[0]: ids for all or none
        for name in ID_KEYS:
            if not isinstance(get(name), str):
                return name, "a string"
        if not _file_name(entry["ids"]):
            return "ids", "a file name"
    return None


_FILES = {False: ("file", "index", "docs"), True: ("file", "index", "docs", "untrained")}


def tokenizer_identity(tokenizer: dict[str, Any]) -> tuple[str, str, int, int]:
    """What must agree for two stores' ids to mean the same tokens: kind, model file digest,
    vocabulary size and end-of-document id (not the file's name or where it lived)."""
    return (
        tokenizer["kind"],
        tokenizer["model_sha256"],
        tokenizer["vocab_size"],
        tokenizer["eod_id"],
    )


def _file_name(name: str) -> bool:
    """A bare name in the store's directory (what `Path(name).name == name` says, without
    building a Path per file: an open checks thousands)."""
    return "/" not in name and name not in ("", ".", "..")


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0  # a JSON integer: not a bool


def _require(ok: bool, path: str | Path, key: str, what: str) -> None:
    if not ok:
        raise StoreError(f"{path}: manifest field '{key}' must be {what}; prepare the store again")
