"""The process's one bound on open shards, across every store, sized from its open-file limit.

An open shard holds a file descriptor: its ArrayRecord reader's, or its flat sidecar's memory
map (Python's `mmap` keeps a duplicate of the descriptor until the map is closed), and a
mapping. Each store bounds its own open shards (`ShardReaders.max_open`), but a mixture of
hundreds of stores would still open hundreds of times that many: 256 sources of 8 shards hit
a `ulimit -n` of 1,024 within 40 steps ("Too many open files"). So every store's shards also
count against one process-wide bound, `OpenShards.limit`, and the least recently used shard of
any store is closed first beyond it.

The limit is a quarter of the soft `RLIMIT_NOFILE`: an open shard holds up to two descriptors
(a flat shard read through ArrayRecord too, by `read_shard_tokens`, has both), and half the
limit is left to JAX, checkpoints, sockets and the user's own files; at most `MAX_OPEN_FILES`,
or $PIPELINE_MAX_OPEN_FILES. Before sizing
it, the soft limit is raised to the hard limit where the process may (on Linux any process
may raise its soft limit up to its hard one), and the raise is logged once: an image whose
default soft limit is 1,024 then keeps more shards open, a process whose hard limit is 1,024
stays correct (it reopens shards more often).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import resource
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeline.errors import StoreError

log = logging.getLogger("pipeline")

MAX_OPEN_FILES = 16384  # the default's cap: a quarter of Linux's default vm.max_map_count
MIN_OPEN_FILES = 8  # the least the bound allows, whatever the limit (a read opens one shard)
OPEN_FILES_ENV = "PIPELINE_MAX_OPEN_FILES"  # overrides the bound sized from the limit


class Owner(Protocol):
    """What the pool needs of a store's shards (`ShardReaders`)."""

    def evict(self, shard: int) -> bool:
        """Close the shard if no thread is reading it now; whether it did."""
        ...


@dataclass
class _Owned:
    """One owner's place in the pool: the owner (weakly: a store nobody closed is still
    collected, and its shards leave the pool then), its own bound and its open shards."""

    serial: int
    owner: weakref.ref[Owner]
    max_open: int
    shards: OrderedDict[int, None]  # open, least recently used first


class OpenShards:
    """The open shards of every store of the process, least recently used first, bounded by
    `limit` in all and by each owner's `max_open`. `touch` marks a shard used and closes, via
    its owner's `evict`, those beyond either bound; a shard its owner cannot close right now
    (a thread is reading it) stays open and is closed by a later touch."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[tuple[int, int], None] = OrderedDict()  # (owner, shard)
        self._owners: dict[int, _Owned] = {}
        self._serials = itertools.count()
        # owners closed, and owners collected, to forget at the next call: a finalizer (of a
        # store, or of a feed that closes its stores) runs when the garbage collector does,
        # possibly in a thread that holds `_lock`, which it must not wait for
        self._closed: collections.deque[int] = collections.deque()
        self._dead: collections.deque[int] = collections.deque()

    def register(self, owner: Owner, max_open: int) -> int:
        """A new owner, bounded by `max_open` shards of its own: its number, for `touch`,
        `forget` and `clear`."""
        serial = next(self._serials)
        dead = self._dead  # told by the owner's weak reference, which its entry keeps alive
        ref = weakref.ref(owner, lambda _, serial=serial: dead.append(serial))  # not a
        with self._lock:  # `weakref.finalize`: ~4 us of each store's open
            self._reap()
            self._owners[serial] = _Owned(serial, ref, max_open, OrderedDict())
        return serial

    def touch(self, serial: int, shard: int) -> None:
        """Mark the owner's shard most recently used; close the least recently used shards
        beyond the owner's bound, then beyond the process's."""
        self.touch_many(((serial, shard),))

    def touch_many(self, keys: Sequence[tuple[int, int]]) -> None:
        """`touch` of several (owner, shard) keys, in order, under one lock: a step of a big
        mixture reads dozens of shards of dozens of stores. None of `keys` is closed."""
        with self._lock:
            if self._dead or self._closed:
                self._reap()
            over = False
            for key in keys:
                owned = self._owners[key[0]]
                if key in self._open:
                    self._open.move_to_end(key)
                    owned.shards.move_to_end(key[1])
                else:
                    self._open[key] = None
                    owned.shards[key[1]] = None
                # an owner over its bound (a shard that was being read) tries again
                over = over or len(owned.shards) > owned.max_open
            if not over and len(self._open) <= self.limit:  # the read path's common case
                return
            closing = self._victims(set(keys))
        for owner, owner_serial, victim in closing:
            if owner is None or owner.evict(victim):
                self.forget(owner_serial, victim)

    def _victims(self, kept: set[tuple[int, int]]) -> list[tuple[Owner | None, int, int]]:
        """The least recently used shards beyond each owner's bound, then beyond the
        process's, none of `kept` (call with `_lock` held): (owner, its number, shard)."""
        victims = []
        for serial in {serial for serial, _ in kept}:
            owned = self._owners[serial]
            mine = len(owned.shards) - owned.max_open
            if mine > 0:
                own = ((serial, s) for s in owned.shards if (serial, s) not in kept)
                victims += itertools.islice(own, mine)
        over = len(self._open) - len(victims) - self.limit
        if over > 0:
            chosen = set(victims)
            others = (k for k in self._open if k not in kept and k not in chosen)
            victims += itertools.islice(others, over)
        return [(self._owners[s].owner(), s, victim) for s, victim in victims]

    def forget(self, serial: int, shard: int) -> None:
        """The owner closed the shard."""
        with self._lock:
            self._open.pop((serial, shard), None)
            owned = self._owners.get(serial)
            if owned is not None:
                owned.shards.pop(shard, None)

    def clear(self, serial: int) -> None:
        """The owner closed every shard (forgotten at the next call: no lock taken here)."""
        self._closed.append(serial)

    def open_count(self) -> int:
        """Shards open now, in every store."""
        with self._lock:
            self._reap()
            return len(self._open)

    def _reap(self) -> None:
        """Forget the shards of the closed owners, and the collected owners (call with `_lock`
        held)."""
        while self._closed:
            owned = self._owners.get(self._closed.popleft())
            for shard in owned.shards if owned is not None else ():
                self._open.pop((owned.serial, shard), None)
            if owned is not None:
                owned.shards.clear()
        while self._dead:
            owned = self._owners.pop(self._dead.popleft(), None)
            for shard in owned.shards if owned is not None else ():
                self._open.pop((owned.serial, shard), None)


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit where allowed (logged once, by the
    caller's first pool); returns (soft before, soft now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY:
        target = _nr_open(hard)
    else:
        target = hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # not allowed here: keep the soft limit
            return soft, soft
        return soft, target
    return soft, soft


def _nr_open(hard: int) -> int:
    """The most a process may set its open-file limit to, when the hard limit is unlimited."""
    try:
        with open("/proc/sys/fs/nr_open") as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def limit_from(soft: int) -> int:
    """The bound for a soft open-file limit `soft`, or $PIPELINE_MAX_OPEN_FILES."""
    text = os.environ.get(OPEN_FILES_ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise StoreError(f"${OPEN_FILES_ENV}: expected a number of files >= 1, got {text!r}")
        return int(text)
    return max(MIN_OPEN_FILES, min(MAX_OPEN_FILES, soft // 4))


_POOL: OpenShards | None = None
_POOL_LOCK = threading.Lock()


def pool() -> OpenShards:
    """The process's pool: made at the first store's open, after raising the soft limit."""
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                before, soft = raise_soft_limit()
                made = OpenShards(limit_from(soft))
                said = f"RLIMIT_NOFILE {soft:,}"
                if soft > before:
                    said = f"raised the soft RLIMIT_NOFILE from {before:,} to {soft:,} (hard limit)"
                # a line where the process's limit changed; where it did not, nothing to tell
                log.log(
                    logging.INFO if soft > before else logging.DEBUG,
                    "open files: %s; at most %d shards stay open at once across all stores ($%s)",
                    said,
                    made.limit,
                    OPEN_FILES_ENV,
                )
                _POOL = made
    return _POOL
