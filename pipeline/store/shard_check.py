"""A shard's first-use checks: what its files hold is what the manifest says.

Opening a store reads its manifest only; each shard is checked when it is first used, at the
cost of reading its two small indexes and hashing a few records, so a 10,000-shard store starts
at once and a damaged or foreign shard still stops with one line naming the file. These
functions load what a shard serves from and refuse it when it does not match: the record and
document indexes and a masked store's loss mask (checksummed .npy files, read once into
memory), the flat sidecar (its sampled records, memory-mapped; its blocks are checked as they
are first read, `flat_blocks`) and the ArrayRecord records (their count and sampled records,
through an open reader). `TokenStore` decides when they run. A file that matches its checksum
in the manifest but not the manifest's counts or dtype names the manifest (`RESEALED`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import math
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader
from numpy.lib import format as npy_format

from pipeline.errors import StoreError
from pipeline.store.flat_blocks import BLOCK_BYTES, FlatBlocks, block_count
from pipeline.store.identity import sample_digest
from pipeline.store.meta import MANIFEST
from pipeline.store.remote_reads import RemoteFlat, checked_file
from pipeline.store.retry import RetryPolicy, is_transient
from pipeline.store.store_files import (
    LISTED_ARRAYS,
    RESEALED,
    FileIdentity,
    identity_of,
    wrong_flat_size,
)
from pipeline.urls import is_url, read_local

# numpy parses .npy headers with `ast`, which CPython 3.11 cannot run in two threads at once
# ("AST constructor recursion depth mismatch"): every store's index loads take this one lock.
_NPY_LOAD_LOCK = threading.Lock()
_INT64 = np.dtype(np.int64)  # what an index holds (compared to a dtype, not the type: cheaper)


# The header numpy writes for a plain array (`format.write_array`, version 1.0), parsed here
# without `ast` (~35 us a file, three files a shard's first use); any other form goes to numpy.
_PLAIN_HEADER = re.compile(
    rb"\{'descr': '([<>|][a-z][0-9]{1,2})', 'fortran_order': (False|True), "
    rb"'shape': \(((?:[0-9]+, )*[0-9]*),?\), \} *\n"
)


@functools.lru_cache(maxsize=4096)
def _plain_header(header: bytes) -> tuple[np.dtype, tuple[int, ...], bool, int] | None:
    """(dtype, shape, Fortran order, data offset) of a plain version 1.0 header (the file's
    first bytes up to its data), None for any other. Kept per header: a store's shards of
    equal counts share theirs, and the parse costs more than the read."""
    end = 10 + int.from_bytes(header[8:10], "little")
    plain = _PLAIN_HEADER.fullmatch(header, 10, end)
    if header[:8] != b"\x93NUMPY\x01\x00" or plain is None or len(header) != end:
        return None
    descr, fortran, dims = plain.groups()
    shape = tuple(int(d) for d in dims.split(b", ") if d)
    return np.dtype(descr.decode()), shape, fortran == b"True", end


def _npy_array(data: bytes) -> np.ndarray:
    """The array of a .npy file's bytes, read-only and without a copy: a plain header parsed
    here (`_plain_header`), any other by numpy (`np.load` of a byte stream copies the data in
    small reads, slower than the hash of it)."""
    plain = _plain_header(data[: 10 + int.from_bytes(data[8:10], "little")])
    if plain is not None:
        dtype, shape, fortran, offset = plain
    else:
        stream = io.BytesIO(data)
        with _NPY_LOAD_LOCK:
            version = npy_format.read_magic(stream)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f".npy format version {version} is not supported")
            read_header = npy_format.read_array_header_1_0
            if version == (2, 0):
                read_header = npy_format.read_array_header_2_0
            shape, fortran, dtype = read_header(stream)
        offset = stream.tell()
    if dtype.hasobject:
        raise ValueError("an index holds numbers, not Python objects")
    array = np.frombuffer(data, dtype, math.prod(shape), offset)  # numpy's keywords: ~1 us
    return array if len(shape) == 1 else array.reshape(shape, order="F" if fortran else "C")


def _load_npy(
    root: str, entry: dict[str, Any], key: str, checksum_key: str
) -> tuple[str, np.ndarray]:
    """The .npy file listed under `key` in a shard's manifest entry (in the store at `root`, a
    directory or a URL), checked against its manifest checksum: read once, into memory (8
    bytes per record or document, less than the reader's own index), so the array served is
    the bytes hashed."""
    path = f"{root}/{entry[key]}"
    if is_url(path):  # one download per host, checked (remote_reads)
        data = checked_file(path, entry[checksum_key], checksum_key)
        return path, _parsed(path, data)
    try:  # one read, both hashed and parsed
        data = read_local(path, checked=True)
    except FileNotFoundError:
        missing = f"{path}: {LISTED_ARRAYS[key]} listed in the manifest is missing"
        raise StoreError(missing) from None
    except OSError as error:
        raise StoreError(f"{path}: cannot read: {error.strerror or error}") from None
    if hashlib.sha256(data).hexdigest() != entry[checksum_key]:
        raise StoreError(
            f"{path}: does not match its checksum ({checksum_key}) in the manifest: the "
            "file was altered or truncated; prepare the store again"
        )
    return path, _parsed(path, data)


def _parsed(path: str, data: bytes) -> np.ndarray:
    try:
        return _npy_array(data)
    except (OSError, ValueError, EOFError) as error:
        raise StoreError(f"{path}: not a readable .npy index: {error}") from None


def load_index(
    root: str, entry: dict[str, Any], key: str, checksum_key: str, count: int
) -> np.ndarray:
    """A shard's record or document index, checked against the manifest."""
    _, index = _load_npy(root, entry, key, checksum_key)
    # the index matches its checksum: the manifest is at fault
    if index.shape != (count + 1,) or index.dtype != _INT64:
        raise StoreError(
            f"{root}/{MANIFEST}: needs an int64[{count + 1}] {entry[key]}, which is "
            f"{index.dtype}{list(index.shape)}; {RESEALED}"
        )
    if int(index[0]) != 0 or int(index[-1]) != entry["tokens"]:
        raise StoreError(
            f"{root}/{MANIFEST}: says tokens 0..{entry['tokens']}, {entry[key]} spans tokens "
            f"{int(index[0])}..{int(index[-1])}; {RESEALED}"
        )
    return index


def load_mask(root: str, entry: dict[str, Any]) -> np.ndarray:
    """A masked store's untrained spans of a shard: int64 [k, 2] token ranges, ordered, not
    overlapping and inside the shard, checked against the manifest's checksum."""
    path, spans = _load_npy(root, entry, "untrained", "untrained_sha256")
    size = int(entry["tokens"])
    if spans.ndim != 2 or spans.shape[1:] != (2,) or spans.dtype != np.int64:
        found = f"{spans.dtype}{list(spans.shape)}"
        raise StoreError(f"{path}: {found}, a loss mask is int64[k, 2]; prepare the store again")
    flat = spans.reshape(-1)
    if flat.size and (flat[0] < 0 or flat[-1] > size or np.any(flat[1:] < flat[:-1])):
        raise StoreError(
            f"{path}: untrained spans are not ordered ranges inside the shard's {size} "
            "tokens; prepare the store again"
        )
    return spans


def map_flat(
    root: str, number: int, entry: dict[str, Any], known: FileIdentity | None, dtype: np.dtype
) -> tuple[np.ndarray, FileIdentity]:
    """Shard `number`'s flat sidecar (its manifest entry `entry`), memory-mapped, and its
    identity: at the shard's first use (`known` None) it must have the manifest's size, at a
    later one be the file seen then (`known`). Its identity is the descriptor's mapped, not a
    `stat` of its name. Its content is checked by `check_sample` and as it is read
    (`flat_blocks`)."""
    path = f"{root}/{entry['flat']}"
    try:  # the file mapped is the one checked: its `fstat`, not a `stat` of its name
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _replaced(path) if known else _wrong_size(root, number, entry, None, dtype) from None
    except OSError as error:
        raise StoreError(f"{path}: cannot read: {error.strerror}") from None
    try:  # the map outlives the descriptor; np.memmap costs 0.2 ms more per shard
        found = identity_of(os.fstat(fd))
        size = int(entry["tokens"])
        if known is None and found.size != size * dtype.itemsize:
            raise _wrong_size(root, number, entry, found, dtype)
        if known is not None and found != known:
            raise _replaced(path)
        if not size:  # an empty shard's sidecar is an empty file, which cannot be mapped
            return np.empty(0, dtype), found
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise StoreError(f"{path}: cannot read: {error.strerror}") from None
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype, size), found


def _wrong_size(
    root: str, number: int, entry: dict[str, Any], found: FileIdentity | None, dtype: np.dtype
) -> StoreError:
    return StoreError(wrong_flat_size(root, number, entry, found, dtype))


def check_sample(root: str, entry: dict[str, Any], flat: np.ndarray, offsets: np.ndarray) -> None:
    """Refuse a mapped sidecar whose sampled records (record `offsets`) do not match the
    manifest's `sample_sha256`: another store's, or an older prepare's."""
    sample = sample_digest(
        len(offsets) - 1, lambda record: flat[offsets[record] : offsets[record + 1]].tobytes()
    )
    if sample != entry["sample_sha256"]:
        raise StoreError(
            f"{root}/{entry['flat']}: its sampled records do not match the manifest's "
            "sample_sha256: the sidecar is another store's or was altered; prepare the store "
            "again"
        )


def _replaced(path: str) -> StoreError:
    """The error of a sidecar that is not the file its shard's first use found."""
    return StoreError(
        f"{path}: the flat token sidecar was replaced or changed after the store was opened; "
        "restart the job, or prepare the store again"
    )


def flat_blocks(
    root: str, entry: dict[str, Any], tokens: np.ndarray, offsets: np.ndarray, check: bool
) -> FlatBlocks:
    """A shard's mapped sidecar `tokens` as served (`FlatBlocks`): with `check`, each block is
    checked on its first read against the shard's block checksum file (loaded here, checked
    against the manifest), or the whole sidecar against `flat_sha256` when the store has none.
    Its sampled records (`check_sample`, record index `offsets`) are checked here when its
    reads are not; when they are, every byte served is checked anyway, and the sample only
    when a read finds a block altered, to name a sidecar of another store as such."""
    crcs, block_bytes = None, entry.get("flat_block_bytes", BLOCK_BYTES)
    if check and "flat_blocks" in entry:
        crcs = _block_crcs(root, entry, tokens.nbytes, block_bytes)
    identify = functools.partial(check_sample, root, entry, tokens, offsets)
    if not check:
        identify()
    return FlatBlocks(
        f"{root}/{entry['flat']}",
        tokens,
        crcs,
        block_bytes=block_bytes,
        whole_sha256=entry["flat_sha256"],
        check=check,
        identify=identify if check else None,
    )


def _block_crcs(root: str, entry: dict[str, Any], size: int, block_bytes: int) -> np.ndarray:
    """A shard's block checksum file (`flat_blocks`) for a sidecar of `size` bytes, checked
    against the manifest and refused unless it has the shape prepare writes."""
    _, crcs = _load_npy(root, entry, "flat_blocks", "flat_blocks_sha256")
    count = block_count(size, block_bytes) + 1
    if crcs.shape != (count,) or crcs.dtype != np.uint32:  # as prepared: the manifest's
        raise StoreError(
            f"{root}/{MANIFEST}: needs uint32[{count}] block checksums of "
            f"{entry['flat']} in blocks of {block_bytes} bytes, {entry['flat_blocks']} is "
            f"{crcs.dtype}{list(crcs.shape)}; {RESEALED}"
        )
    return crcs


def remote_flat(root: str, entry: dict[str, Any], dtype: np.dtype) -> RemoteFlat:
    """A remote shard's flat sidecar as served (`RemoteFlat`): every block checked
    against the shard's block checksum file (loaded here, checked against the manifest) when it
    is downloaded or read from the host's cache, whatever `feed.verify` says, since a cache
    entry is trusted only once checked. Only stores with block checksums are served so."""
    block_bytes = entry.get("flat_block_bytes", BLOCK_BYTES)
    crcs = _block_crcs(root, entry, int(entry["tokens"]) * dtype.itemsize, block_bytes)
    return RemoteFlat(
        f"{root}/{entry['flat']}", entry["flat_sha256"], dtype, int(entry["tokens"]), crcs,
        block_bytes,
    )  # fmt: skip


def _discard(reader: ArrayRecordReader) -> None:
    """Close the reader of a shard found damaged; closing a damaged file can fail too."""
    with contextlib.suppress(Exception):
        reader.close()


def check_records(
    reader: ArrayRecordReader,
    file: Path,
    entry: dict[str, Any],
    offsets: np.ndarray,
    dtype: np.dtype,
    retry: RetryPolicy,
) -> None:
    """Check, through `reader`, a shard's record count, and its sampled records' lengths
    against the index `offsets` and their digest against the manifest's `sample_sha256`; a
    shard that fails is refused, its reader closed."""
    lengths: dict[int, int] = {}

    def read(record: int) -> bytes:
        data = reader.read(record, record + 1)[0]
        lengths[record] = len(data)
        return data

    def sample_records() -> tuple[int, str]:
        count = reader.num_records()
        return count, sample_digest(count, read)

    try:  # transient faults are retried, as on every read
        found, sample = retry.call(sample_records)
    except Exception as error:  # ArrayRecord raises plain RuntimeErrors
        _discard(reader)
        tries = f" ({retry.attempts} tries)" if is_transient(error) else ""
        raise StoreError(f"{file}: cannot read the shard{tries}: {error}") from None
    if found != entry["records"]:
        _discard(reader)
        raise StoreError(
            f"{file}: {found} records, the manifest says {entry['records']}; the shard "
            "is damaged or not this store's: prepare the store again"
        )
    for record, size in lengths.items():
        expected = int(offsets[record + 1] - offsets[record])
        if size != expected * dtype.itemsize and sample == entry["sample_sha256"]:
            _discard(reader)  # the records are as prepared, and so is the index: the dtype
            raise StoreError(
                f"{file.parent / MANIFEST}: says dtype {dtype.name}, record {record} of "
                f"{file.name} holds {size} bytes for {expected} tokens; {RESEALED}"
            )
        if size != expected * dtype.itemsize:
            _discard(reader)
            raise StoreError(
                f"{file}: record {record} holds {size} bytes, not the {expected} tokens "
                f"of {dtype.name} the index and manifest say; prepare the store again"
            )
    if sample != entry["sample_sha256"]:
        _discard(reader)
        raise StoreError(
            f"{file}: its sampled records do not match the manifest's sample_sha256: "
            "the shard is another store's or was altered; prepare the store again"
        )
