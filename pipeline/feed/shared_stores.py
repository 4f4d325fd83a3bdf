"""Open token stores shared by the feeds of one process.

A feed built while another feed of the same process reads the same store (a restored feed
beside a running one, a train and an eval feed, the benchmark's restore) takes that feed's open
`TokenStore`, with the shards it has already opened and checked, their memory maps and readers,
instead of opening and checking them again: the first batch of the new feed waits for no shard
open. A store is shared only while every file is as the holder found it: `acquire` opens the
store afresh (its manifest, as any open does) and compares (`TokenStore.same_as`: the manifest,
and the identities of the files of the shards the holder has used); a replaced store is opened
anew. The last feed to `release` a store closes it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from pipeline.errors import StoreError
from pipeline.store.formats import open_store
from pipeline.store.meta import StoreMeta
from pipeline.store.store_set import StoreSet
from pipeline.store.token_store import TokenStore

log = logging.getLogger("pipeline")

_lock = threading.Lock()
_latest: dict[object, TokenStore] = {}  # path -> the store a new feed may share
_users: dict[int, int] = {}  # id(store) -> feeds holding it


def acquire(
    path: str | Path, check_reads: bool = True, known: StoreMeta | None = None
) -> TokenStore:
    """The open store at `path`: the one another feed holds if its files are unchanged (and it
    checks its reads as `check_reads` says); `known`: its metadata as the plan read it
    (`TokenStore`)."""
    fresh = open_store(path, check_reads=check_reads, known=known)
    with _lock:
        held = _latest.get(fresh.path)
        if held is not None and held.same_as(fresh):
            _users[id(held)] += 1
            return held
        _latest[fresh.path] = fresh  # a changed store's feeds keep theirs until they release
        _users[id(fresh)] = 1
    return fresh


def store_set(check_reads: bool) -> StoreSet:
    """An empty set for a feed's plan, opening through `acquire` and handing back a store it
    refuses through `release`."""
    return StoreSet(check_reads=check_reads, opener=acquire, release=release)


def release_all(stores: StoreSet) -> None:
    """Hand the stores a feed's plans opened back (`release`): the last user closes one."""
    for store in stores.stores():
        try:
            release(store)
        except StoreError as error:  # a reader of a damaged file may fail to close
            log.warning("%s", error)


def release(store: TokenStore) -> None:
    """One feed is done with `store`; the last one closes it."""
    if _release_count(store):
        store.close()


def holds(store: TokenStore) -> bool:
    """Whether `store` came from `acquire` and is not yet released by all its feeds."""
    with _lock:
        return id(store) in _users


def _release_count(store: TokenStore) -> bool:
    """Drop one feed of `store`; True when it was the last."""
    with _lock:
        left = _users.get(id(store), 0) - 1
        if left > 0:
            _users[id(store)] = left
            return False
        _users.pop(id(store), None)
        if _latest.get(store.path) is store:
            del _latest[store.path]
        return True
