"""The feed's full store verification policy (`feed: {verify: off | read | open | background}`).

Every reader always checks the cheap facts when a store opens and a shard's identity when the
shard is first used, and, unless `verify: off`, each block of a flat sidecar on its first read
(docs/token-store.md). The full pass (`open`, `background`) reads every byte: each process checks
its share of each store's shards (shard i on process i mod process_count), so the hosts
together read each store once.

* `open`: before the first step; a failure stops every process (it runs where the feed opens
  its stores, whose errors are gathered across processes).
* `background`: in a daemon thread while training; a failure is raised by the next `next()`.
"""

from __future__ import annotations

import logging
import threading

import jax

from pipeline.errors import FeedError, PipelineError, StoreError
from pipeline.read.plan import Plan

log = logging.getLogger("pipeline")


def verify_share(plan: Plan, stop: threading.Event | None = None) -> None:
    """Checksum and record-check this process's share of every shard of the plan's stores; a
    failure names the store's source by its config key (`Plan.store_message`). A store not
    opened yet (a feed opens a store at its first draw) is opened here."""
    index, count = jax.process_index(), jax.process_count()
    for meta in plan.store_set.metas():
        try:
            store = plan.store(meta)
            for shard in range(index, store.num_shards, count):
                if stop is not None and stop.is_set():
                    return
                store.verify([shard])
        except StoreError as error:
            raise StoreError(plan.store_message(meta, error)) from error


class BackgroundVerify:
    """Runs `verify_share` in a daemon thread; `check()` raises what it found."""

    def __init__(self, plan: Plan) -> None:
        self._stop = threading.Event()
        self._error: PipelineError | None = None
        self._thread = threading.Thread(
            target=self._run, args=(plan,), name="pipeline-verify", daemon=True
        )
        self._thread.start()

    def _run(self, plan: Plan) -> None:
        try:
            verify_share(plan, self._stop)
        except PipelineError as error:
            self._error = error
            return
        if not self._stop.is_set():
            log.info("background store verification passed (this process's shards)")

    def check(self) -> None:
        if self._error is not None:
            raise FeedError(f"background store verification failed: {self._error}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
