"""Which host holds the job back: per-host time to batch, the slowest host, and an opt-in
readiness barrier.

Every step's collectives wait for the last host, so one slow loader slows (or, before its first
batch, silently stalls) a job of hundreds. Two signals name it:

* **Time to batch.** Every `feed.stats_window` steps each process publishes the median time its
  reader tasks took per step over the window (`FeedStats.time_to_batch_s`) to the coordination
  service's key-value store that `jax.distributed.initialize` started, under
  `pipeline/ttb/<process index>`, and reads every host's latest value back: the slowest host
  and its time are in `FeedStats` (so Prometheus) and in one INFO line of process 0 per window.
  Two small RPCs per window, from the training thread after the window's last step; process 0,
  which logs, reads again (bounded by `WINDOW_WAIT_S`) until every host's figure is of the same
  window, so the host it names is the slowest of that window, not of the one before.
* **Readiness barrier** (`feed.ready_timeout_s: T`, off by default). After its first batch each
  process writes `pipeline/ready/<n>/<process index>` (n counts the feeds that wait, in the
  order each process starts them: the same on every process) and waits up to T seconds for
  every other host's; a host missing by then is named in one line (`FeedError`) instead of a
  silent hang in the first step's collective.

In one process there is no coordination service: the host is its own slowest and nothing waits.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, NamedTuple

import jax

from pipeline.errors import FeedError
from pipeline.feed.host_stop import coordination_client

TIME_TO_BATCH = "pipeline/ttb/"
"""Key-value directory of each process's latest time to batch: `<last step> <seconds>`."""
WINDOW_WAIT_S = 2.0
"""How long process 0 waits at a window's end for the other hosts' figures of that window (they
reach it within a step of one another: every step ends in a collective), so that the slowest
host it names is this window's."""
READY = "pipeline/ready/"
"""Key-value directory of the readiness barriers: `<n>/<process index>`."""

_barriers = itertools.count()  # the same sequence on every process: feeds start in one order


class Slowest(NamedTuple):
    """The slowest host's process index and time to batch (seconds per step)."""

    process: int
    seconds: float


class Peers:
    """This process's view of every host's time to batch."""

    def __init__(self) -> None:
        self._client = coordination_client()
        self._index = jax.process_index()

    @property
    def shared(self) -> bool:
        """Whether there are other hosts to compare with."""
        return self._client is not None

    def publish(self, last_step: int, seconds: float) -> Slowest:
        """Publish this host's time to batch over the window ending at `last_step`; return the
        slowest host's latest, this one included."""
        if self._client is None:
            return Slowest(self._index, seconds)
        key = f"{TIME_TO_BATCH}{self._index}"
        self._client.key_value_set(key, f"{last_step} {seconds!r}", allow_overwrite=True)
        published = self._published(seconds)
        if self._index == 0:  # the host that logs waits for this window's figure of every host
            deadline = time.monotonic() + WINDOW_WAIT_S
            while min(step for step, _ in published.values()) < last_step:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
                published = self._published(seconds)
        process = max(published, key=lambda p: (published[p][1], -p))
        return Slowest(process, published[process][1])

    def _published(self, seconds: float) -> dict[int, tuple[int, float]]:
        """Every host's latest `(last step, seconds)`; a host that has published none counts
        as step -1."""
        published = {p: (-1, 0.0) for p in range(jax.process_count())}
        published[self._index] = (1 << 62, seconds)
        for name, value in self._client.key_value_dir_get(TIME_TO_BATCH):
            step, figure = value.split()
            process = int(name.rsplit("/", 1)[-1])
            if process != self._index:
                published[process] = (int(step), float(figure))
        return published


def wait_until_ready(timeout_s: float, first_batch_s: float) -> None:
    """Mark this process ready and wait up to `timeout_s` for every other host's mark;
    FeedError naming the hosts still missing then. `first_batch_s`: how long this host's
    first batch took, for the line."""
    client: Any = coordination_client()
    if client is None:
        return
    directory = f"{READY}{next(_barriers)}/"
    client.key_value_set(f"{directory}{jax.process_index()}", "ready")
    deadline = time.monotonic() + timeout_s
    for process in range(jax.process_count()):
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            client.blocking_key_value_get(f"{directory}{process}", left_ms)
        except Exception:  # JAX raises its own error type on a timeout
            break
    else:
        return
    ready = {int(name.rsplit("/", 1)[-1]) for name, _ in client.key_value_dir_get(directory)}
    missing = [p for p in range(jax.process_count()) if p not in ready]
    if not missing:  # the last one arrived just now
        return
    hosts = ", ".join(map(str, missing[:10]))
    hosts += f" and {len(missing) - 10} more" if len(missing) > 10 else ""
    raise FeedError(
        f"feed.ready_timeout_s: host{'s' if len(missing) > 1 else ''} {hosts} of "
        f"{jax.process_count()} produced no first batch within {timeout_s:g} s of host "
        f"{jax.process_index()}'s ({first_batch_s:.1f} s after its feed opened): a slow or "
        "stuck loader there (docs/observability.md)"
    )
