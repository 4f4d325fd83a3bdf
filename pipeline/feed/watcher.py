"""One watcher thread per process, for all its feeds: the coordinator's polls, the stores'
re-checks and the stragglers' time to batch, none of them on the training thread.

A process may hold several feeds at once (training, eval sets, a restored feed beside a running
one). Each feed attaches a `HostStop` to the process's `Watcher`, whose one daemon thread,
`pipeline-feed-watch`, does for all of them together, at steady state:

* every `poll_period`: one read of the published stops (`host_stop.PREFIX`), one RPC to the
  coordinator whatever the number of feeds; a peer's stop fails every feed of the process;
* every `STORE_CHECK_S`: each store open in any feed checked once (a store shared by feeds,
  `shared_stores`, is one check), a cloud store only by the process `checks_remote` picks;
* when a feed's stats window ends (`stragglers.Peers.offer` wakes the thread), that feed's
  time-to-batch exchange (`Peers.exchange`), at most once per feed and poll period; on process
  0, while a window waits for other hosts' figures, one read of them at each `Peers.read_at`
  (`Peers.settle`). Nothing here waits for another host: each turn is a few RPCs at most.

So the training thread's `next()` reads one attribute (`HostStop.check`) and at a window's end
hands a figure over; it never waits on the coordinator at steady state (the opt-in readiness
barrier after the first batch, `set_mix`'s agreement and a failing `next()`'s publish do, by
design). The thread lives while a feed is attached; the last feed's `close` ends it (and flushes
that feed's last window). A feed collected unclosed is let go by the thread itself at its next
turn (`HostStop.abandon`). The periods are the smallest of the attached feeds' (they come from
the environment: normally one value per job).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import jax

from pipeline.errors import FeedError, StoreError
from pipeline.feed.host_stop import (
    PREFIX,
    Periods,
    checks_remote,
    coordination_client,
    end_process,
    first_poll_offset,
    poll_period,
    stopped,
)
from pipeline.feed.stragglers import Peers
from pipeline.read.plan import Plan
from pipeline.store.token_store import TokenStore
from pipeline.urls import is_url

log = logging.getLogger("pipeline")

_lock = threading.Lock()
_current: Watcher | None = None  # the process's watcher while a feed is attached


class HostStop:
    """One feed's side of the process's watcher: what it found for this feed, and the publish
    of this feed's fatal error to the other processes."""

    def __init__(
        self, plan: Callable[[], Plan | None], periods: Periods, peers: Peers | None = None
    ) -> None:
        """`plan` gives the feed's plan now (None: the feed is gone), whose stores are those
        open now: a switch or a later stage opens more of them. `peers`: the feed's time to
        batch, exchanged by the watcher thread."""
        self.plan, self.periods, self.peers = plan, periods, peers
        self.failure: str | None = None  # what `check()` raises, set by the watcher thread
        self._closed = False
        self.abandoned = False  # the feed was collected unclosed: the watcher thread detaches it
        self._watcher = _attach(self)

    def check(self) -> None:
        """Raise what the watcher found; `next()` calls it every step (one attribute read)."""
        if self.failure is not None:
            self._watcher.raised = True
            raise FeedError(self.failure)

    def publish(self, line: str) -> None:
        """Tell every other process that this one stops with `line` (once per process)."""
        self._watcher.publish(line)

    def close(self, wait: bool = True) -> None:
        """Detach; with `wait`, hand over the feed's last time-to-batch window first and join
        the thread if this was the process's last feed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if wait and self.peers is not None:
            self.peers.exchange(final=True)  # one read of the other hosts' figures at most
        _detach(self, wait)

    def abandon(self) -> None:
        """The feed's finalizer: it was collected without `close`. The garbage collector runs
        finalizers at any allocation on any thread, also inside the watcher's locks, so this
        takes no lock and waits for nothing: the watcher thread detaches the feed."""
        self.abandoned = True


def _attach(feed: HostStop) -> Watcher:
    global _current
    with _lock:
        if _current is None:
            _current = Watcher(feed)
        else:
            _current.add(feed)
        return _current


def _detach(feed: HostStop, wait: bool) -> None:
    global _current
    watcher = feed._watcher
    with _lock:
        last = watcher.remove(feed)
        if last and _current is watcher:
            _current = None
    if last:
        watcher.stop(wait)


class Watcher:
    """The process's watcher thread and the stop state its feeds share."""

    def __init__(self, first: HostStop) -> None:
        self._client = coordination_client()
        self._index, self._processes = jax.process_index(), jax.process_count()
        self._feeds: list[HostStop] = []
        self._feeds_lock = threading.Lock()
        self._wake = threading.Event()
        self._done = False
        self.raised = False  # this process's training thread raised a stop: nothing to end
        self._published = False
        self._peer_line: str | None = None  # a peer's stop, once seen
        self._peer_seen: float | None = None
        self.add(first)
        self._thread = threading.Thread(target=self._run, name="pipeline-feed-watch", daemon=True)
        self._thread.start()

    def add(self, feed: HostStop) -> None:
        with self._feeds_lock:
            self._feeds.append(feed)
        if self._peer_line is not None:  # the session's data has ended: a new feed stops too
            feed.failure = self._peer_line
        if feed.peers is not None:
            feed.peers.wake = self._wake.set
        self._wake.set()  # its periods may be shorter

    def remove(self, feed: HostStop) -> bool:
        """Detach `feed`; True when it was the last (then none is attached again: `_attach`
        starts a new watcher)."""
        with self._feeds_lock:
            self._feeds = [f for f in self._feeds if f is not feed]
            last = not self._feeds
        self._wake.set()  # an abandoned feed may be the last one left now
        return last

    def stop(self, wait: bool) -> None:
        self._done = True
        self._wake.set()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def publish(self, line: str) -> None:
        """This process stops with `line`: tell the others, unless a peer's stop is the cause
        (they know it) or it was told already."""
        self.raised = True
        if self._client is None or self._published or self._peer_seen is not None:
            return
        self._published = True
        try:
            self._client.key_value_set(f"{PREFIX}{self._index}", line, allow_overwrite=True)
        except Exception as error:  # the coordinator may be gone already: JAX reports that
            log.warning("could not tell the other hosts why this one stops: %s", error)

    def _periods(self, feeds: list[HostStop]) -> tuple[float, float, float]:
        """(poll period, store check period, grace) of the attached feeds: the shortest."""
        poll_s = min(f.periods.poll_s for f in feeds)
        store_check_s = min(f.periods.store_check_s for f in feeds)
        grace_s = min(f.periods.grace_s for f in feeds)
        return poll_period(poll_s, self._processes), store_check_s, grace_s

    def _run(self) -> None:
        with self._feeds_lock:
            poll_s = self._periods(self._feeds)[0]
        start = time.monotonic()
        last_check = start
        last_poll = start + first_poll_offset(poll_s, self._index, self._processes) - poll_s
        exchanged: dict[int, float] = {}  # id(peers) -> when it last exchanged
        while not self._done:
            with self._feeds_lock:
                feeds = list(self._feeds)
            for gone in [f for f in feeds if f.abandoned]:
                gone.close(wait=False)  # here, not in its finalizer: see `HostStop.abandon`
                feeds.remove(gone)
            if not feeds:  # the last one left: `stop` follows
                return
            poll_s, store_check_s, grace_s = self._periods(feeds)
            now = time.monotonic()
            if now >= last_check + store_check_s:
                last_check = now
                self._check_stores(feeds)
            due = [last_check + store_check_s]
            if self._client is not None and not self.raised:
                if self._peer_seen is None:
                    if now >= last_poll + poll_s:
                        last_poll = now
                        self._check_peers(feeds, now)
                    due.append(last_poll + poll_s)
                elif now - self._peer_seen >= grace_s:
                    # the training thread did not come back to `next()`: it waits in a
                    # collective for the stopped host, and would stop later with JAX's message
                    end_process(self._peer_line or "")
                else:
                    due.append(self._peer_seen + grace_s)
            for peers in (f.peers for f in feeds if f.peers is not None):
                if peers.pending:
                    after = exchanged.get(id(peers), -math.inf) + poll_s
                    if now >= after:
                        exchanged[id(peers)] = now
                        peers.exchange()
                    else:
                        due.append(after)
                read_at = peers.read_at
                if read_at is not None and time.monotonic() >= read_at:
                    peers.settle()  # process 0: one read of the others' figures, never a wait
                    read_at = peers.read_at
                if read_at is not None:
                    due.append(read_at)
            self._wake.wait(max(0.0, min(due) - time.monotonic()))
            self._wake.clear()

    def _check_stores(self, feeds: list[HostStop]) -> None:
        """Check each store of the attached feeds once; a replaced one fails every feed that
        reads it, named by that feed's config key (`Plan.store_message`)."""
        found: dict[int, StoreError | None] = {}
        for feed in feeds:
            plan = feed.plan()
            if plan is None or feed.failure is not None:
                continue
            for store in plan.stores():
                if id(store) not in found:
                    found[id(store)] = self._check(store)
                error = found[id(store)]
                if error is not None:
                    feed.failure = plan.store_message(store, error)
                    break

    def _check(self, store: TokenStore) -> StoreError | None:
        if is_url(store.path) and not checks_remote(
            store.fingerprint, self._index, self._processes
        ):
            return None  # another process checks it and publishes what it finds
        try:
            store.check_unchanged()
        except StoreError as error:
            return error
        return None

    def _check_peers(self, feeds: list[HostStop], now: float) -> None:
        try:
            stops = self._client.key_value_dir_get(PREFIX)
        except Exception:  # a lost coordinator is JAX's to report
            return
        polled = dict(stops)
        for feed in feeds:
            if feed.peers is not None:
                feed.peers.heard(polled)
        peers = [(index, line) for index, line in stopped(polled) if index != self._index]
        if not peers:
            return
        index, line = peers[0]
        self._peer_seen, self._peer_line = now, f"host {index}: {line}"
        for feed in feeds:
            if feed.failure is None:
                feed.failure = self._peer_line
        log.error("%s", self._peer_line)
