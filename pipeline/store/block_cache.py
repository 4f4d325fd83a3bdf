"""A host's local cache of remote store bytes (`feed: {cache: {dir: DIR, max_gb: N}}`).

Hundreds of hosts that restart together would each download again everything they read; the
cache keeps what was downloaded on the host's local disk, shared by its processes and across
restarts. Entries are content-addressed (a block of a flat sidecar by the sidecar's SHA-256 and
the block's number, a small file or a whole shard by its own SHA-256, a manifest by its URL and
generation), so an entry never goes stale: data that changes has another key. Small entries are
bytes (`get`); a whole shard, which ArrayRecord reads from the disk, is a file (`get_file`).

* **Checked, never trusted.** `get` checks an entry (the caller's `check`: the store's CRC32C
  of the block, or the file's SHA-256) when it is filled and when a process first reads it; a
  damaged entry is deleted and fetched again, never served.
* **One download per entry and host.** A fill holds an advisory lock (`fcntl.flock` of the
  entry's lock file) and looks again once it has it: the processes of a host that want the
  same block wait for the first one's download instead of making their own; fills of other
  entries do not wait. (An evicted entry's lock file goes with it: a fill racing that eviction
  may download the block a second time, never serve a part.) A child forked mid-fill holds
  none of the host's locks (`host_locks`) and has no pass thread of its parent's: it fills and
  evicts as any process.
* **Atomic, safe under kill -9.** A fill writes a uniquely named partial file and renames it
  over the entry: an entry is whole or absent. A process killed mid-fill leaves a partial file
  (never read; removed by a later eviction pass once it is old) and releases its lock with its
  death.
* **Bounded, without stalling fills.** The host's processes keep one count of the cache's
  bytes (`_TOTAL`, under its `flock`, held for microseconds): a fill adds its entry and renames
  it in under that lock (a process killed in between leaves the count high, never low), and
  when that takes the count over `max_bytes`, it makes an eviction pass due and returns: the
  pass runs in the process's one background thread (`_Passes`), after the host's pass lock
  (`_PASS`: one pass per host at a time). A pass that finds the count over the bound deletes
  the least recently used entries (by modification time, which a read refreshes) down to 90 %
  of the bound counted by its scan. The scan and deletions hold no lock the fills take: the
  pass then sets the count to what its scan left plus what fills added meanwhile (counted
  possibly twice: high, never low). A fill over the bound while a pass runs (in any process)
  makes another pass due after it, which looks at the count again. So the cache stands above
  `max_bytes` while a pass is due or running, by the fills made meanwhile; once its passes are
  done (`settle`) it holds at most `max_bytes`, unless the entry filled last is alone larger
  than that: it is kept for its caller, alone, and goes at the next pass. A process killed
  mid-pass (kill -9, or at exit: the thread is a daemon) leaves the count high. A whole
  shard's path handed out by `get_file` may be deleted by a pass before its caller opens it:
  the caller takes the copy again (`remote_shards.open_copy`); once a file is open, deleting
  it takes nothing from its reader.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pipeline.errors import StoreError
from pipeline.store.host_locks import locked

_LOCK = ".lock"  # beside each entry: its fills' lock file (empty)
_PARTIAL = ".partial"
_STALE_PARTIAL_S = 600.0  # a partial file this old belongs to a fill that died
_TOTAL = ".total"  # at the root: the bytes of the host's entries, as 20 digits (flock: fills)
_PASS = ".pass"  # at the root: held (flock) by the host's one eviction pass running
T = TypeVar("T")


class BlockCache:
    """Entries under `root`, at most ~`max_bytes` in all (see the module docstring)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(
                f"{self.root}: cannot create the cache directory (feed.cache.dir): "
                f"{error.strerror or error}"
            ) from None
        self.damaged = 0  # entries found damaged and fetched again, by this process

    def get(self, key: str, fetch: Callable[[], bytes], check: Callable[[bytes], bool]) -> bytes:
        """The entry `key`: read from the cache when whole and `check`ed, else `fetch`ed (by one
        process of the host at a time), checked and stored. A fetch that fails its check is
        refused by the caller's `check` raising, or here if it returns False."""
        path = self.root / key

        def fill(partial: Path) -> bytes:
            data = fetch()
            if not check(data):
                raise StoreError(f"{key}: downloaded bytes do not match their checksum")
            partial.write_bytes(data)
            return data

        data = self._read_checked(path, check)
        if data is not None:
            return data
        return self._filled(path, lambda: self._read_checked(path, check), fill)

    def get_file(
        self,
        key: str,
        fill: Callable[[Path], None],
        check: Callable[[Path], bool],
        fresh: bool = False,
    ) -> Path:
        """The path of the entry `key`, a file too large to hold in memory (a whole shard):
        there when whole and `check`ed, else filled by `fill(partial)` (by one process of the
        host at a time), which writes the file and raises unless it passes its checks. An eviction
        pass of any process may delete the entry before the caller opens it: a caller that
        finds it gone asks again. `fresh`: filled again even when it is there (a check of the
        source itself, not of the copy)."""
        path = self.root / key

        def checked() -> Path | None:
            return path if self._file_checked(path, check) else None

        def filled(partial: Path) -> Path:
            fill(partial)
            return path

        if fresh:
            return self._filled(path, lambda: None, filled)
        return checked() or self._filled(path, checked, filled)

    def _filled(self, path: Path, found: Callable[[], T | None], fill: Callable[[Path], T]) -> T:
        """Fill the entry at `path` under its lock, unless `found()` finds it filled by another
        process meanwhile: `fill(partial)` writes (and checks) a partial file, renamed over the
        entry once whole; then a pass is due if the cache is over its bound."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_name(path.name + _LOCK)):
            result = found()  # another process filled it meanwhile
            if result is not None:
                return result
            partial = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{_PARTIAL}")
            try:
                result = fill(partial)
                self._store(partial, path)
            except OSError as error:
                raise StoreError(
                    f"{path}: cannot write the cache entry: {error.strerror or error}"
                ) from None
            finally:
                partial.unlink(missing_ok=True)
        return result

    def _store(self, partial: Path, path: Path) -> None:
        """Rename the whole file `partial` over the entry `path`, counted in the host's total
        first; then, if that is over the bound, make a pass due (sparing `path`): it runs in
        the background, this fill does not wait for it."""
        size = partial.stat().st_size
        with self._counted() as descriptor:
            total = self._count(descriptor) + size
            os.pwrite(descriptor, b"%020d" % total, 0)
            os.replace(partial, path)
        if total > self.max_bytes:
            _passes.request(self, path)

    def _counted(self) -> contextlib.AbstractContextManager[int]:
        """The host's count file, open and locked."""
        return locked(self.root / _TOTAL)

    def _count(self, descriptor: int) -> int:
        """The count in the locked count file; one missing or damaged is counted on the disk."""
        counted = os.pread(descriptor, 20, 0)
        return int(counted) if len(counted) == 20 and counted.isdigit() else self._scan()

    @staticmethod
    def settle(timeout_s: float = 60.0) -> bool:
        """Wait until this process's eviction passes are done, those due included (a test, or a
        benchmark, that must see the cache's end state); False if still running at `timeout_s`."""
        return _passes.settle(timeout_s)

    def _pass(self, keep: Path) -> None:
        """Evict down to 90 % of the bound, `keep` spared, if the cache is still over it (a pass
        that ran meanwhile may have brought it down). Runs with the host's pass lock held (in
        `_Passes`); only reading and setting the count hold its lock, so the host's fills do not
        wait for the scan and deletions."""
        with self._counted() as counted:
            before = self._count(counted)
        if before <= self.max_bytes:
            return
        left = self._evict(keep)
        with self._counted() as counted:
            now = os.pread(counted, 20, 0)
            if len(now) == 20 and now.isdigit() and int(now) >= before:
                left += int(now) - before  # fills since `before`, some maybe also scanned
            else:  # damaged, or counted again on the disk meanwhile
                left = self._scan()
            os.pwrite(counted, b"%020d" % left, 0)

    def _read_checked(self, path: Path, check: Callable[[bytes], bool]) -> bytes | None:
        try:
            data = path.read_bytes()
        except OSError:
            return None
        return data if self._passes(path, check(data)) else None

    def _file_checked(self, path: Path, check: Callable[[Path], bool]) -> bool:
        """Whether the file entry at `path` is there and passes `check` (one another process
        evicts meanwhile is not there: fetched again, not counted as damaged)."""
        if not path.is_file():
            return False
        try:
            good = check(path)
        except FileNotFoundError:
            return False
        return self._passes(path, good)

    def _passes(self, path: Path, good: bool) -> bool:
        """`good`, for an entry just checked: a good one becomes the most recently used, a
        damaged one is deleted (fetched again, never served)."""
        if good:
            with contextlib.suppress(OSError):
                os.utime(path)
            return True
        self.damaged += 1
        path.unlink(missing_ok=True)
        return False

    def _entries(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every entry; stale partial files are removed on the way.
        (`os.scandir`, not `os.walk` and `Path`s: a pass scans every entry, and a cache of 64 KiB
        blocks holds millions.)"""
        found = []
        now = time.time()
        folders = [str(self.root)]
        while folders:
            with contextlib.suppress(OSError), os.scandir(folders.pop()) as listing:
                for item in listing:
                    name = item.name
                    if name.endswith(_LOCK) or name in (_TOTAL, _PASS):
                        continue
                    try:
                        if item.is_dir(follow_symlinks=False):
                            folders.append(item.path)
                            continue
                        stat = item.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if name.endswith(_PARTIAL):
                        if now - stat.st_mtime > _STALE_PARTIAL_S:
                            with contextlib.suppress(OSError):
                                os.unlink(item.path)
                        continue
                    found.append((stat.st_mtime, stat.st_size, item.path))
        return found

    def _scan(self) -> int:
        """The bytes of every entry, counted on the disk."""
        return sum(size for _, size, _ in self._entries())

    def _evict(self, keep: Path) -> int:
        """Delete least recently used entries, `keep` excepted, down to 90 % of the bound by a
        scan of the disk (no lock held: fills may race in); returns the bytes the scan left."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= 0.9 * self.max_bytes:
                break
            if path != str(keep):
                self._delete(path)
                total -= size
        return total

    def _delete(self, path: str) -> None:
        """Delete the entry at `path` and its lock file (a fill racing this downloads again)."""
        for gone in (path, path + _LOCK):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(gone)


class _Passes:
    """This process's eviction passes: run by one background thread, started by the fill that
    takes a cache over its bound (which returns at once) and gone once no pass is due. A fill
    over the bound while a pass runs makes another due, run after it (it looks at the count
    first: it may find the cache brought down already). The thread waits for the host's pass
    lock (`_PASS`: one pass per host; waiting costs no fill anything). A daemon: one killed at
    exit mid-pass leaves the count high, as kill -9 does."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)  # a child has no pass thread

    def reset(self) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.due: dict[Path, tuple[BlockCache, Path]] = {}  # by root: the latest fill's
        self.running = False

    def request(self, cache: BlockCache, keep: Path) -> None:
        """Make a pass of `cache` due, sparing `keep` (the entry just filled, for its caller)."""
        with self.lock:
            self.due[cache.root] = (cache, keep)
            if not self.running:
                self.running = True
                threading.Thread(target=self.run, name="pipeline-cache-pass", daemon=True).start()

    def settle(self, timeout_s: float) -> bool:
        """Whether the thread is gone (nothing due or running) within `timeout_s`."""
        with self.lock:
            return self.idle.wait_for(lambda: not self.running, timeout_s)

    def run(self) -> None:
        """The passes due, one at a time, until none is. A pass that raises ends the thread
        (its traceback printed) as one that finds none due: the next fill over the bound
        starts another, where a thread left marked running would let the cache grow."""
        try:
            while True:
                with self.lock:
                    if not self.due:
                        return
                    cache, keep = self.due.pop(next(iter(self.due)))
                # a cache whose directory went (a temporary one removed at exit) or cannot be
                # written: no pass; the next fill over the bound tries again
                with contextlib.suppress(OSError), locked(cache.root / _PASS):
                    cache._pass(keep)
        finally:
            with self.lock:
                self.running = False
                self.idle.notify_all()


_passes = _Passes()
