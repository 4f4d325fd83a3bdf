"""Fetching the blocks of the steps after those being read, for stores in buckets.

The plan says which rows every step reads. While the reader threads read steps t..t+p-1
(`feed.prefetch`: p), one thread per feed downloads what steps t+p..t+p+k-1 will read
(`feed.fetch_ahead`: k; their shards' indexes and their sidecars' blocks, `Plan.pieces`) into
the process's memory and the host cache (`remote_reads`), so that a step's reader finds its
blocks held and waits on no request.

* **Bounded.** One pass at a time, over the steps handed over since the last (k at the first
  pass, then about one a step), with at most `PARALLEL` requests in flight: a pass takes a
  small part of the client's pool of connections (`urls.CONNECTIONS`), so the readers' own
  requests never queue behind it.
* **Checked, never trusted.** The thread only fills memory: a block it fetches is checked
  against the store's CRC32Cs like any other (`RemoteFlat.block`).
* **Errors surface at the step that needs the block.** A pass that fails (a bucket that does
  not answer, a damaged block) leaves the block missing; the reader of the step that needs it
  runs the same fetch again (`fetch_blocks`) and stops that step with its line if the error
  persists. An error in finding a step's pieces that is not the data's (a bug) is kept and
  raised by the feed's next `next()`.
* **Stops with the feed.** `close` wakes the thread and joins it once its pass ends (every
  request is bounded by `feed.read_timeout_s`); it starts with the first pass handed over.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pipeline.errors import PipelineError
from pipeline.store.piece_reads import fetch_blocks
from pipeline.urls import is_url

if TYPE_CHECKING:
    from pipeline.plan.draws import Draws
    from pipeline.read.plan import Plan

PARALLEL = 32
"""Requests in flight at once from one pass."""
KEPT = 4
"""Steps' draws kept for their readers (`FetchAhead.draws`), in `feed.fetch_ahead`s."""
log = logging.getLogger("pipeline")


def in_buckets(plan: Plan) -> bool:
    """Whether any of the stores of `plan` is in a bucket (asked once a feed: a fetcher and
    more reader threads for it, `FetchAhead.of`, `readers.reader_count`). A plan made from one
    config knows it from the config without a look at each of hundreds of stores
    (`DataConfig.in_buckets`); a plan given to the feed, from its stores."""
    return any(is_url(meta.path) for meta in plan.store_set.metas())


class FetchAhead:
    """The fetching thread of one feed: `steps` steps after the last one handed to readers."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self._plan: Plan | None = None  # the plan the steps handed over are drawn from
        self._end = 0  # steps [.., _end) have been handed over
        self._queued = 0  # `queued` of the last `follow`
        self._wanted: list[tuple[Plan, int, np.ndarray]] = []  # (plan, step, rows) to fetch
        self._failure: BaseException | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        # the draws each pass found, (step, rows) -> (plan, draws), for the step's reader
        # (`draws`); the oldest dropped beyond `KEPT` steps (a seek leaves some untaken)
        self._found: OrderedDict[tuple[int, bytes], tuple[Plan, Draws]] = OrderedDict()

    @staticmethod
    def of(feed: object, remote: bool, steps: int) -> FetchAhead:
        """The fetcher of `feed`: one that fetches nothing (and starts no thread) when none of
        its stores is in a bucket (`remote`). Collecting a feed never closed stops it."""
        ahead = FetchAhead(steps if remote else 0)
        weakref.finalize(feed, ahead.close, wait=False)
        return ahead

    def follow(self, plan: Plan, queued: int, rows: Callable[[int], np.ndarray]) -> None:
        """Steps before `queued` are handed to the readers: hand the thread those up to
        `queued + steps` not yet handed over (`rows(step)`: this process's rows of it). A new
        `plan` (a mix set, a ledger adopted) or a `queued` that jumped (a seek) starts over at
        `queued`, forgetting what was handed over. The feed calls it once its first step is
        read, so that the first step's requests wait for no other."""
        if not self.steps:  # local stores, or `fetch_ahead: 0`: nothing to do in next()
            return
        if self._failure is not None:
            raise self._failure
        if plan is not self._plan or not self._queued <= queued <= self._end:
            self._plan, self._end = plan, queued
            with self._wake:
                self._wanted.clear()
        self._queued = queued
        first, end = max(self._end, queued), queued + self.steps
        if first >= end:
            return
        wanted = [(plan, step, rows(step)) for step in range(first, end)]
        self._end = end
        with self._wake:
            if self._closed:
                return
            self._wanted += wanted
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pipeline-fetch-ahead", daemon=True
                )
                self._thread.start()
            self._wake.notify()

    def draws(self, plan: Plan, step: int, rows: np.ndarray) -> Draws:
        """`plan.draws(step, rows)`: the thread's, when a pass has found them (taken, with the
        pieces it found of them, `Draws.found`, which the reader then copies), else drawn
        now. A step's reader draws once what the thread drew, instead of drawing it again."""
        if self.steps:
            with self._wake:
                found = self._found.pop((step, rows.tobytes()), None)
            if found is not None and found[0] is plan:
                return found[1]
        return plan.draws(step, rows)

    def close(self, wait: bool = True) -> None:
        """Stop the thread once its pass ends (joined when `wait`). Idempotent."""
        with self._wake:
            self._closed = True
            self._wanted.clear()
            self._found.clear()
            self._wake.notify()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._wanted and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                wanted, self._wanted = self._wanted, []
            try:
                pieces = []
                for plan, step, rows in wanted:
                    draws = plan.draws(step, rows)
                    pieces += plan.pieces(draws)
                    self._keep(plan, step, rows, draws)
            except PipelineError:  # the reader of that step meets it again, and raises it
                continue
            except Exception as error:  # a bug: the feed's next next() raises it
                self._failure = error
                return
            try:
                fetch_blocks(pieces, PARALLEL)
            except Exception as error:  # the reader of the step that needs the block runs
                log.debug("fetch ahead: %s", error)  # the same fetch again, and raises it

    def _keep(self, plan: Plan, step: int, rows: np.ndarray, draws: Draws) -> None:
        with self._wake:
            self._found[step, rows.tobytes()] = (plan, draws)
            while len(self._found) > KEPT * max(1, self.steps):
                self._found.popitem(last=False)
