"""Document ids: what `prepare --id-field` / `--record-ids` records of each document.

A store with ids has one id file per shard, `shard-…ids.jsonl`: line i is the id of the shard's
document i, as a JSON string (ASCII, so an id may hold any character, a newline included). Its
SHA-256 is in the shard's manifest entry (`ids`, `ids_sha256`), which the self-checksummed
manifest covers; every reader here checks the file against it as it reads it. A store without
ids has no such files and no such fields (byte for byte what it was before ids existed).

Ids are unique in a store (`check_unique`, run by both prepare runners before the manifest):
an id names one document. Finding documents by id (`locate`) is one streaming pass over the id
files that keeps only the wanted ids in memory: O(wanted) memory, O(documents) time.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import PrepareError, StoreError
from pipeline.store.identity import ID_KEYS

IDS_SUFFIX = "ids.jsonl"
BUCKET_IDS = 1 << 22  # ids per bucket of the uniqueness check (16 bytes each in memory)


def encode_id(document_id: str) -> bytes:
    """An id as its line in an id file."""
    return json.dumps(document_id, ensure_ascii=True).encode() + b"\n"


def decode_id(line: bytes) -> str:
    return json.loads(line)


def write_ids(path: Path, ids: Iterable[str]) -> None:
    with open(path, "wb") as f:
        for document_id in ids:
            f.write(encode_id(document_id))


def has_ids(manifest: Mapping[str, Any]) -> bool:
    """Whether the store records document ids (all its shards do, or none; a corpus read in
    place has none)."""
    return "ids" in (manifest.get("shards") or [{}])[0]


def shard_lines(root: Path, entry: Mapping[str, Any]) -> Iterator[bytes]:
    """The lines of a shard's id file, streamed; the file's checksum is checked when the last
    line has been read (a caller that stops early has read an unchecked prefix: it checks what
    it found by reading on, as `locate` does)."""
    path = root / entry["ids"]
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for line in f:
                digest.update(line)
                yield line
    except FileNotFoundError:
        raise StoreError(f"{path}: document id file listed in the manifest is missing") from None
    except OSError as error:
        raise StoreError(f"{path}: cannot read: {error.strerror or error}") from None
    if digest.hexdigest() != entry["ids_sha256"]:
        raise StoreError(
            f"{path}: content checksum does not match the store's manifest; the id file was "
            "altered or truncated: prepare the store again"
        )


def shard_ids(root: Path, entry: Mapping[str, Any], documents: int) -> list[str]:
    """Every id of one shard, in document order, checked (checksum and count)."""
    ids = [decode_id(line) for line in shard_lines(root, entry)]
    if len(ids) != documents:
        raise StoreError(
            f"{root / entry['ids']}: {len(ids)} ids for {documents} documents; prepare the "
            "store again"
        )
    return ids


def locate(
    root: Path, manifest: Mapping[str, Any], wanted: Iterable[str]
) -> dict[str, tuple[int, int]]:
    """(shard, document index) of each wanted id found in the store (absent ids are left out),
    by one checked pass over every id file; memory holds the wanted ids only."""
    lines = {encode_id(document_id): document_id for document_id in wanted}
    found: dict[str, tuple[int, int]] = {}
    for shard, entry in enumerate(manifest["shards"]):
        count = 0
        for count, line in enumerate(shard_lines(root, entry), start=1):
            if line in lines:
                found[lines[line]] = (shard, count - 1)
        if count != entry["documents"]:
            raise StoreError(
                f"{root / entry['ids']}: {count} ids for {entry['documents']} documents; "
                "prepare the store again"
            )
    return found


def check_unique(root: Path, shards: list[Any], where: str) -> None:
    """Refuse a store (being prepared at `root`; `shards` its `ShardInfo`s) in which an id names
    two documents, naming the id and both. Hashes every id to 128 bits and sorts them in
    buckets by hash, so memory is one bucket (`BUCKET_IDS` ids), not the corpus."""
    total = sum(s.documents for s in shards)
    buckets = max(1, -(-total // BUCKET_IDS))
    with tempfile.TemporaryDirectory(prefix="pipeline-ids-") as spill:
        files = [open(Path(spill) / f"{b}.bin", "wb") for b in range(buckets)]  # noqa: SIM115
        try:
            for shard in shards:
                hashes = _hashes(shard_lines(root, _entry(shard)))
                for b in range(buckets):
                    files[b].write(hashes[hashes[:, 0] % buckets == b].tobytes())
        finally:
            for f in files:
                f.close()
        for b in range(buckets):
            hashes = np.fromfile(Path(spill) / f"{b}.bin", dtype=np.uint64).reshape(-1, 2)
            hashes = hashes[np.lexsort((hashes[:, 1], hashes[:, 0]))]
            same = np.flatnonzero((hashes[1:] == hashes[:-1]).all(axis=1))
            if same.size:
                _refuse_duplicate(root, shards, hashes[same[0]], where)


def _entry(shard: Any) -> dict[str, Any]:
    """The id fields of a `ShardInfo`, as its manifest entry has them."""
    return {key: getattr(shard, key) for key in ID_KEYS}


def _hashes(lines: Iterable[bytes]) -> np.ndarray:
    """uint64 [n, 2]: the 128-bit BLAKE2b hash of each id line."""
    digests = b"".join(hashlib.blake2b(line, digest_size=16).digest() for line in lines)
    return np.frombuffer(digests, dtype=np.uint64).reshape(-1, 2)


def _refuse_duplicate(root: Path, shards: list[Any], target: np.ndarray, where: str) -> None:
    """Name the id whose hash is `target` and the first two documents it names."""
    places = []
    for number, shard in enumerate(shards):
        for index, line in enumerate(shard_lines(root, _entry(shard))):
            if (_hashes([line])[0] == target).all():
                places.append((number, index, decode_id(line)))
    (s1, d1, document_id), (s2, d2, _) = places[:2]
    raise PrepareError(
        f"{where}: document id {document_id!r} names two documents (shard {s1} document {d1} "
        f"and shard {s2} document {d2}); ids must be unique in a store: fix the input, or "
        "record the inputs' own keys (--record-ids without --id-field)"
    )
