"""The open shards of a store: their ArrayRecord readers, a bound on how many stay open, retries.

A feed that reads every shard of a large corpus over an epoch would otherwise keep a reader (and
its chunk index), the indexes and the sidecar map of every shard it ever read: host memory would
grow with the corpus. `ShardReaders` keeps at most `max_open` shards open per store, and every
store's shards count against the process's one bound (`open_shards`, sized from its open-file
limit), the least recently read closed first beyond either; it serialises each shard's reader
and first use behind the shard's own lock, and retries a read that failed transiently on a
fresh reader. What a shard's first use checks and keeps is the store's (`TokenStore`,
`shard_check`); this module opens, bounds, retries and closes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from array_record.python.array_record_module import ArrayRecordReader

from pipeline.errors import StoreError
from pipeline.store.open_shards import pool
from pipeline.store.retry import RetryPolicy, is_transient

# Random access: no readahead, no reader-side parallelism (the feed parallelises itself). The
# chunk index stays in memory (~12 B per record, read with the footer in one request): an
# "offloaded" index costs a second read per record, a second round trip on gs://. What bounds
# it is the number of open readers (`max_open_shards`), not the corpus.
READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0,index_storage_option:in_memory"
# Open shard readers (and their indexes) kept per store; the least recently read is closed.
MAX_OPEN_SHARDS = 256
MAX_OPEN_ENV = "PIPELINE_MAX_OPEN_SHARDS"  # overrides MAX_OPEN_SHARDS
T = TypeVar("T")


def default_max_open() -> int:
    """$PIPELINE_MAX_OPEN_SHARDS, else `MAX_OPEN_SHARDS`."""
    text = os.environ.get(MAX_OPEN_ENV, "").strip()
    if not text:
        return MAX_OPEN_SHARDS
    if not text.isdigit() or int(text) < 1:
        raise StoreError(f"${MAX_OPEN_ENV}: expected a number of shards >= 1, got {text!r}")
    return int(text)


class Vanished(StoreError):
    """A shard file deleted while its reader was being opened (a cache's eviction pass): its
    copy can be taken again and opened, where another unreadable file is the store's fault."""


def open_reader(path: Path) -> ArrayRecordReader:
    """A reader of the shard file at `path` (on local disk: a cloud shard is read from its
    checked local copy, `remote_shards`). A file that cannot be opened (permission denied) is
    refused by its OS error: ArrayRecord's reader would read it as a shard of no records, and
    so would it one deleted before it opens it by its path: the file is held open meanwhile,
    and `Vanished` raised unless it is still there once ArrayRecord holds it."""
    try:
        with open(path, "rb") as held:
            try:
                reader, failure = ArrayRecordReader(str(path), READER_OPTIONS), None
            except Exception as error:  # ArrayRecord raises plain RuntimeErrors
                reader, failure = None, error
            if os.fstat(held.fileno()).st_nlink == 0:  # ArrayRecord may have opened nothing
                if reader is not None:
                    with contextlib.suppress(RuntimeError):
                        reader.close()
                raise Vanished(f"{path}: cannot read: the file was deleted while it was opened")
    except FileNotFoundError as error:
        raise Vanished(f"{path}: cannot read: {error.strerror}") from None
    except OSError as error:
        raise StoreError(f"{path}: cannot read: {error.strerror or error}") from None
    if reader is None:
        raise StoreError(f"{path}: not a readable ArrayRecord shard: {failure}") from None
    return reader


class ShardReaders:
    """The readers, locks and open-shard bound of one store's `count` shards.

    `new_reader(shard)` opens a shard's reader; `first_read(shard)` runs the store's checks
    before each read (its first-use checks and those of its records), with the shard's lock
    held; `on_drop(shard)` is called whenever the shard's reader is dropped (when the shard is
    closed as the least recently read, after a failed read attempt, and by `close`), for the
    store to forget what the shard's first use opened and checked. `name` names a shard's file
    in errors.
    """

    def __init__(
        self,
        count: int,
        max_open: int,
        retry: RetryPolicy,
        *,
        new_reader: Callable[[int], ArrayRecordReader],
        first_read: Callable[[int], None],
        on_drop: Callable[[int], None],
        name: Callable[[int], Path],
    ) -> None:
        self.max_open = max_open
        self.retry = retry
        self.locks = [threading.Lock() for _ in range(count)]
        self._readers: list[ArrayRecordReader | None] = [None] * count
        self._pool = pool()  # the order and bounds of the open shards (`open_shards`)
        self._serial = self._pool.register(self, max_open)
        self._new_reader, self._first_read = new_reader, first_read
        self._on_drop, self._name = on_drop, name

    def read(self, shard: int, read: Callable[[ArrayRecordReader], T], records: str) -> T:
        """`read(reader)` under the shard's lock, after `first_read(shard)`, retried by the
        policy (a failed attempt drops the reader, so the next one starts afresh); a failure
        names the file and the `records` read."""

        def attempt() -> T:
            try:
                return read(self._reader(shard))
            except Exception:
                self._drop(shard)
                raise

        self.touch(shard)  # before opening: the bound holds while this one opens
        with self.locks[shard]:
            self._first_read(shard)
            try:
                result = self.retry.call(attempt)
            except Exception as error:  # ArrayRecord raises plain RuntimeErrors
                tries = f" ({self.retry.attempts} tries)" if is_transient(error) else ""
                raise StoreError(
                    f"{self._name(shard)}: cannot read records {records}{tries}: {error}"
                ) from error
        return result

    def take(self, shard: int) -> ArrayRecordReader:
        """The shard's reader, a new one if it has none, taken out (call with the shard's lock
        held): `put` it back once its records are checked."""
        reader, self._readers[shard] = self._reader(shard), None
        return reader

    def put(self, shard: int, reader: ArrayRecordReader) -> None:
        """Keep `reader` as the shard's (call with its lock held)."""
        self._readers[shard] = reader

    def touch(self, shard: int) -> None:
        """Mark the shard most recently read; close the least recently read shards beyond this
        store's bound and the process's (`open_shards`; one that another thread is reading
        right now is skipped and closed later)."""
        self._pool.touch(self._serial, shard)

    def key(self, shard: int) -> tuple[int, int]:
        """The shard's key in the process's pool, for `OpenShards.touch_many`, which marks the
        shards of many stores used under one lock."""
        return self._serial, shard

    def evict(self, shard: int) -> bool:
        """Close the shard (`open_shards` asks), unless a thread holds its lock; whether it
        did."""
        lock = self.locks[shard]
        if not lock.acquire(blocking=False):
            return False
        try:
            self._drop(shard)
        finally:
            lock.release()
        return True

    def close(self) -> None:
        """Close every open shard reader; a reader of a damaged file may fail to close."""
        self._pool.clear(self._serial)
        failures = []
        for shard, lock in enumerate(self.locks):
            with lock:
                reader = self._forget(shard)
                try:
                    if reader is not None:
                        reader.close()
                except RuntimeError as error:
                    failures.append(f"{self._name(shard)}: {error}")
        if failures:
            raise StoreError("cannot close " + "; ".join(failures))

    def _reader(self, shard: int) -> ArrayRecordReader:
        """The shard's reader; call with the shard's lock held, after its first use."""
        reader = self._readers[shard]
        if reader is None:
            reader = self._new_reader(shard)
            self._readers[shard] = reader
        return reader

    def _drop(self, shard: int) -> None:
        """Forget the shard's reader and indexes (call with its lock held); a reader of a
        damaged or vanished file may fail to close, which changes nothing here."""
        reader = self._forget(shard)
        if reader is not None:
            with contextlib.suppress(RuntimeError):
                reader.close()

    def _forget(self, shard: int) -> ArrayRecordReader | None:
        """Forget the shard's reader and what its first use opened and checked, so that its next
        use opens and checks it again (call with its lock held); returns its reader, to close."""
        reader, self._readers[shard] = self._readers[shard], None
        self._on_drop(shard)
        return reader
