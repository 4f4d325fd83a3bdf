"""Remote shards served without flat sidecars: downloaded whole, checked, kept on local disk.

A gs:// store prepared without flat token sidecars (`prepare --no-flat-tokens`), or before their
block checksums existed, has no blocks `RemoteFlat` could serve checked. ArrayRecord's own gs://
reader would read it, but it asks for the rest of the object at each read (~50 times the store
for a short run: docs/benchmarks-history.md, "Reading from a bucket"), keeps nothing, and waits
for a network that drops forever. So such a shard is downloaded whole before ArrayRecord reads
it, from the local disk:

* in ranged requests of `PART_BYTES`, all at once (`remote_reads.together`), each through
  `remote_reads`' client: answered within `feed.read_timeout_s` or refused in one line naming
  the file and the endpoint, and counted in `feed.stats()`;
* checked against its SHA-256 in the manifest (`sha256`, which every store's manifest lists)
  before anything is read from it: what is served is the shard prepare wrote, or nothing;
* kept in the host's cache when the feed has one (`feed.cache`; `BlockCache.get_file`: named by
  its SHA-256, one download per host, atomic, least recently used evicted, a damaged copy
  fetched again), else in a temporary directory of this process, removed at exit and bounded by
  `PRIVATE_BYTES` (least recently used deleted first: a shard read again is downloaded again).
  The directory is named by the process (`pipeline-shards-HOST@PID-*`): the first process of
  the host to make one later removes those of processes that died without exiting (`kill -9`,
  an out-of-memory kill), never a live process's;
* opened through `open_copy`: a copy an eviction pass deleted before its reader held it open
  is taken again, never read as a file that is not there.

A copy is hashed once per process: one this process has checked (same device, inode and size
since) is opened again without hashing it, as a local store's shard is checked at its first
use, not at each.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from pipeline.errors import StoreError
from pipeline.store.block_cache import BlockCache
from pipeline.store.remote_reads import _fetch, host_cache, together
from pipeline.store.shard_readers import Vanished
from pipeline.store.store_files import sha256_of

PART_BYTES = 8 << 20  # bytes per ranged request of a shard's download
PARTS_AT_ONCE = 8  # a shard's parts in flight (a batch's shards download at once, too)
OPEN_TRIES = 3  # a copy evicted this many times before it is opened: the cache is too small
PRIVATE_BYTES = 4 << 30  # downloaded shards a process without `feed.cache` keeps on its disk
_PREFIX = "pipeline-shards-"  # then HOST@PID- of its owner: a temporary cache's directory

T = TypeVar("T")

_lock = threading.Lock()
# the copies this process hashed: (SHA-256, device, inode, size), which a rename keeps
_checked: set[tuple[str, int, int, int]] = set()
_private: dict[int, BlockCache] = {}  # this process's temporary cache, by process id


def local_shard(url: str, sha256: str, size: int, fresh: bool = False) -> Path:
    """A local copy of the shard at `url`, of `size` bytes and SHA-256 `sha256` (its manifest
    entry): from the cache when there, else downloaded and checked (see the module); `fresh`:
    downloaded and checked even when the cache holds it (a verify of the object itself)."""
    cache = host_cache() or _private_cache()
    download, check = partial(_download, url, sha256, size), partial(_matches, sha256)
    return cache.get_file(f"shards/{sha256}", download, check, fresh)


def open_copy(url: str, sha256: str, size: int, opener: Callable[[Path], T]) -> T:
    """`opener(path)` of the shard's local copy (`local_shard`), which raises `Vanished` when
    an eviction pass (of any process of the host) deleted the copy before `opener` held it
    open: the copy is taken again (downloaded and checked, or filled meanwhile by another
    process) and opened, up to `OPEN_TRIES` times. Once open, eviction cannot take it away."""
    for _ in range(OPEN_TRIES):
        with contextlib.suppress(Vanished):
            return opener(local_shard(url, sha256, size))
    raise StoreError(
        f"{url}: its local copy was evicted {OPEN_TRIES} times before it could be opened: the "
        "cache (feed.cache.max_gb) is smaller than the shards this host reads at once; raise it"
    )


def _matches(sha256: str, path: Path) -> bool:
    """Whether the copy at `path` has SHA-256 `sha256` (hashed once per process and file)."""
    stat = path.stat()
    seen = (sha256, stat.st_dev, stat.st_ino, stat.st_size)
    with _lock:
        if seen in _checked:
            return True
    if sha256_of(path) != sha256:
        return False
    with _lock:
        _checked.add(seen)
    return True


def _download(url: str, sha256: str, size: int, into: Path) -> None:
    """Write the shard at `url` into the file `into`, by parts fetched at once, and refuse it
    unless it is the manifest's (`size` bytes of SHA-256 `sha256`; hashed here, so the entry
    it becomes is not hashed again by this process)."""
    with open(into, "wb") as file:

        def part(start: int) -> None:
            stop = min(start + PART_BYTES, size)
            data = _fetch(url, start, stop)
            if len(data) != stop - start:
                raise StoreError(
                    f"{url}: {len(data)} bytes from byte {start}, where the manifest's shard of "
                    f"{size} bytes has {stop - start}: the shard was altered or truncated; "
                    "prepare the store again"
                )
            os.pwrite(file.fileno(), data, start)

        parts = (partial(part, start) for start in range(0, size, PART_BYTES))
        together(*parts, parallel=PARTS_AT_ONCE)
    if not _matches(sha256, into):
        raise StoreError(
            f"{url}: does not match its checksum (sha256) in the manifest: the shard was altered "
            "or damaged; prepare the store again"
        )


def _private_cache() -> BlockCache:
    """This process's temporary cache (a forked child makes its own), removed at exit; the
    ones of dead processes of this host are removed first (`_sweep`)."""
    with _lock:
        cache = _private.get(os.getpid())
        if cache is None:
            _sweep(Path(tempfile.gettempdir()))
            prefix = f"{_PREFIX}{socket.gethostname()}@{os.getpid()}-"
            root = Path(tempfile.mkdtemp(prefix=prefix))
            atexit.register(_remove, root, os.getpid())
            cache = _private[os.getpid()] = BlockCache(root, PRIVATE_BYTES)
        return cache


def _sweep(temporary: Path) -> None:
    """Remove the temporary caches under `temporary` of this host's processes that are gone
    (a process killed before its exit handler ran leaves up to `PRIVATE_BYTES` behind). One of
    another host (a temporary directory shared across machines or containers), of a live
    process or of a process of another user is kept."""
    for path in temporary.glob(f"{_PREFIX}{socket.gethostname()}@*"):
        owner = path.name.rpartition("@")[2].partition("-")[0]
        try:
            ours = path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if ours and owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(root: Path, owner: int) -> None:
    """Remove the temporary cache `root` at the exit of the process that made it (a forked
    child inherits the exit handler, not the directory)."""
    if os.getpid() == owner:
        shutil.rmtree(root, ignore_errors=True)
