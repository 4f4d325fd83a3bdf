"""How a process reads a remote (gs://) store's bytes: once, checked, in bounded time.

ArrayRecord's gs:// reader asks for the rest of the object from a record's chunk to the end at
every read, so a feed reading a small store downloaded it ~50 times over (docs/benchmarks.md,
"Reading from a bucket"). A remote store with flat sidecars is instead served from its
sidecars' checksummed blocks (`RemoteFlat`), each block downloaded by one ranged request, and
its manifest and indexes by one request each; everything goes through this module, which

* fetches through gcsfs (the client etils.epath uses), each request bounded by
  `feed.read_timeout_s`: an endpoint that does not answer fails with one line naming the file
  and the endpoint, never hangs;
* keeps what it fetched: in memory (`MEMORY_BYTES`, least recently used dropped first), and in
  the host's disk cache when the feed configures one (`feed.cache`, `block_cache`);
* checks every entry before it is served: a block against the store's CRC32Cs, a file against
  its SHA-256 in the manifest, a manifest against its own checksum (`identity`);
* counts the bytes it downloaded (`downloaded`, reported by `feed.stats()`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numpy as np

from pipeline.errors import StoreError
from pipeline.store.block_cache import BlockCache
from pipeline.urls import CONNECTIONS

MEMORY_BYTES = 256 << 20  # fetched bytes kept in this process's memory
# Requests in flight at once from one `together`: every request of a stage, so that a stage of
# 256 sources is one round trip, not two (it was 32, then 128); the client's pool holds two such
# stages (`urls.CONNECTIONS`), so none of them queues for a connection.
PARALLEL = CONNECTIONS // 2


@dataclass
class _State:
    cache: BlockCache | None = None
    downloaded: int = 0
    requests: int = 0


_state = _State()
_lock = threading.Lock()
_memory: OrderedDict[str, bytes] = OrderedDict()
_memory_bytes = 0
_inflight: dict[str, threading.Event] = {}  # keys being loaded, set when done


def configure(cache_dir: str | None, max_gb: float, timeout_s: float) -> None:
    """Set this process's disk cache (None: none) and per-request time limit: the feed's
    `feed.cache` and `feed.read_timeout_s`. A cache already open on the same directory stays."""
    from pipeline.urls import REQUEST_TIMEOUT_S

    with _lock:
        REQUEST_TIMEOUT_S[0] = timeout_s
        if cache_dir is None:
            _state.cache = None
            return
        root = Path(cache_dir).expanduser().absolute()
        max_bytes = int(max_gb * (1 << 30))
        cache = _state.cache
        if cache is None or cache.root != root or cache.max_bytes != max_bytes:
            _state.cache = BlockCache(root, max_bytes)


def host_cache() -> BlockCache | None:
    """This process's disk cache (`feed.cache`), None without one."""
    return _state.cache


def forget() -> None:
    """Drop what this process keeps in memory: its next reads find entries in the disk cache
    or the bucket, as a fresh process does (a benchmark's or a test's cold start)."""
    global _memory_bytes
    with _lock:
        _memory.clear()
        _memory_bytes = 0


def downloaded() -> int:
    """Bytes this process has downloaded from object storage through this module."""
    return _state.downloaded


def _fetch(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes [start, end) of the object at `url` (all of it without a range): one request,
    answered within the configured time or refused in one line (`urls.bounded`)."""
    from pipeline.urls import _filesystem, bounded, storage_endpoint

    fs, path = _filesystem(url)  # refuses an endpoint that cannot be connected to, in seconds
    try:
        data = bounded(url, fs._cat_file, path, start=start, end=end)
    except StoreError:
        raise
    except FileNotFoundError:
        raise StoreError(f"{url}: listed in the store's manifest but missing") from None
    except Exception as error:  # gcsfs retried what was transient
        raise StoreError(
            f"{url}: cannot read from Cloud Storage at {storage_endpoint()}: {error}"
        ) from None
    with _lock:
        _state.downloaded += len(data)
        _state.requests += 1
    return data


def _remembered(key: str) -> bytes | None:
    with _lock:
        data = _memory.get(key)
        if data is not None:
            _memory.move_to_end(key)
        return data


def _remember(key: str, data: bytes) -> None:
    global _memory_bytes
    with _lock:
        if key in _memory:
            return
        _memory[key] = data
        _memory_bytes += len(data)
        while _memory_bytes > MEMORY_BYTES and len(_memory) > 1:
            _, dropped = _memory.popitem(last=False)
            _memory_bytes -= len(dropped)


def _get(key: str, fetch: Callable[[], bytes], check: Callable[[bytes], bool]) -> bytes:
    """Entry `key`: from memory, else the disk cache (checked), else fetched and checked; one
    thread of the process at a time per key (the others wait for its result)."""
    while True:
        data = _remembered(key)
        if data is not None:
            return data
        with _lock:
            busy = _inflight.get(key)
            if busy is None:
                _inflight[key] = threading.Event()
        if busy is None:
            break
        busy.wait()  # then from memory, or (its fetch failed) this thread's turn
    try:
        return _load(key, fetch, check)
    finally:
        with _lock:
            _inflight.pop(key).set()


def _load(key: str, fetch: Callable[[], bytes], check: Callable[[bytes], bool]) -> bytes:
    cache = _state.cache
    if cache is not None:
        data = cache.get(key, fetch, check)
    else:
        data = fetch()
        if not check(data):
            raise StoreError(f"{key}: downloaded bytes do not match their checksum")
    _remember(key, data)
    return data


def checked_file(url: str, sha256: str, what: str) -> bytes:
    """The whole object at `url`, which must have SHA-256 `sha256` (a store file the manifest
    lists): content-addressed, so fetched once per host however many stores or opens read it."""
    import hashlib

    def check(data: bytes) -> bool:
        return hashlib.sha256(data).hexdigest() == sha256

    try:
        return _get(f"files/{sha256}", lambda: _fetch(url), check)
    except StoreError as error:
        if "do not match" not in str(error):
            raise
        raise StoreError(
            f"{url}: does not match its checksum ({what}) in the manifest: the file was "
            "altered or truncated; prepare the store again"
        ) from None


def manifest_bytes(url: str, version: tuple[int, int] | None) -> bytes:
    """A remote store's manifest; with its (generation, size) `version`, the cached copy of that
    generation when there is one (a warm restart then downloads only the identity)."""
    if version is None:
        return _fetch(url)
    key = f"manifests/{_digest(url)}-{version[0]}"

    def fetch() -> bytes:
        data = _fetch(url)
        if len(data) != version[1]:
            raise StoreError(f"{url}: the manifest changed while it was read; restart the job")
        return data

    return _get(key, fetch, lambda data: len(data) == version[1])


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RemoteFlat:
    """A remote shard's flat sidecar as served: blocks of `block_bytes` fetched (one ranged
    request each, in parallel for a prefetch), each checked against the store's running CRC32Cs
    `crcs` (`flat_blocks.prefix_crcs`) before it is kept or served. Same `read` as
    `FlatBlocks`."""

    def __init__(
        self,
        url: str,
        sha256: str,
        dtype: np.dtype,
        tokens: int,
        crcs: np.ndarray,
        block_bytes: int,
    ) -> None:
        self.url, self.dtype, self.block_bytes = url, dtype, block_bytes
        self.size = tokens * dtype.itemsize
        self.shift = (block_bytes // dtype.itemsize).bit_length() - 1
        self._crcs = crcs.astype(np.uint32).tolist()
        self._key = f"blocks/{sha256}-{block_bytes}"

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) (a non-empty range)."""
        first, last = start >> self.shift, ((stop - 1) >> self.shift) + 1
        data = b"".join(self.block(block) for block in range(first, last))
        base = first << self.shift
        return np.frombuffer(data, self.dtype)[start - base : stop - base]

    def missing(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """The blocks token ranges [start, stop) touch that this process does not hold yet."""
        found: set[int] = set()
        for start, stop in ranges:
            found.update(range(start >> self.shift, ((stop - 1) >> self.shift) + 1))
        return [block for block in sorted(found) if _remembered(f"{self._key}/{block}") is None]

    def block(self, block: int) -> bytes:
        lo = block * self.block_bytes
        hi = min(lo + self.block_bytes, self.size)
        want = self._crcs[block + 1]
        start = self._crcs[block]

        def check(data: bytes) -> bool:
            return len(data) == hi - lo and google_crc32c.extend(start, data) == want

        try:
            return _get(f"{self._key}/{block}", lambda: _fetch(self.url, lo, hi), check)
        except StoreError as error:
            if "do not match" not in str(error):
                raise
            raise StoreError(
                f"{self.url}: bytes {lo}..{hi - 1} do not match their block checksums "
                "(flat_blocks): the sidecar was altered or damaged; prepare the store again"
            ) from None


def together(*calls: Callable[[], Any], parallel: int = PARALLEL) -> list[Any]:
    """Run `calls` at once (one round trip for all of them, up to `parallel` of them), their
    results in order; the first failure is re-raised once all have ended. A pool per call
    (gone when it returns), so that a call may itself call `together` without waiting on a
    slot."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(min(len(calls), parallel), thread_name_prefix="remote-read") as pool:
        futures = [pool.submit(call) for call in calls]
    return [future.result() for future in futures]


def prefetch_blocks(
    flats: Iterable[tuple[RemoteFlat, Iterable[tuple[int, int]]]], parallel: int = PARALLEL
) -> None:
    """Fetch every block that the token ranges of each sidecar touch and this process does not
    hold yet, all at once (up to `parallel` at a time)."""
    missing = [(flat, block) for flat, ranges in flats for block in flat.missing(ranges)]
    together(*(lambda f=flat, b=block: f.block(b) for flat, block in missing), parallel=parallel)
