"""Which host holds the job back: per-host time to batch, the slowest host, and an opt-in
readiness barrier.

Every step's collectives wait for the last host, so one slow loader slows (or, before its first
batch, silently stalls) a job of hundreds. Two signals name it:

* **Time to batch.** Every `feed.stats_window` steps each process hands the median time its
  reader tasks took per step over the window (`FeedStats.time_to_batch_s`) to the process's
  watcher thread (`pipeline.feed.watcher`), which publishes it to the coordination service's
  key-value store that `jax.distributed.initialize` started, under `pipeline/ttb/<lane>/<process
  index>` (lane: the feed's rank among the process's feeds with statistics, the same on every
  process: feeds start in one order). Only process 0 reads every host's figure back (waiting,
  for at most `WINDOW_WAIT_S`, until each is of the same window, so the host it names is the
  slowest of that window), logs one INFO line and publishes the verdict in the stop directory
  (`VERDICT`), which the other processes' watchers read with their next stop poll. The slowest
  host and its time are in `FeedStats` (so Prometheus). Per feed and window (at most one a
  poll period): one small RPC on each process; process 0 also reads the directory (O(processes)
  values) and writes the verdict. None of it on the training thread: `next()` only hands the
  figure over (`Peers.offer`).
* **Readiness barrier** (`feed.ready_timeout_s: T`, off by default). After its first batch each
  process writes `pipeline/ready/<n>/<process index>` (n counts the feeds that wait, in the
  order each process starts them: the same on every process) and waits up to T seconds for
  every other host's; a host missing by then is named in one line (`FeedError`) instead of a
  silent hang in the first step's collective.

In one process there is no coordination service: the host is its own slowest and nothing waits.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from pipeline.errors import FeedError
from pipeline.feed.host_stop import PREFIX, coordination_client

log = logging.getLogger("pipeline")

TIME_TO_BATCH = "pipeline/ttb/"
"""Key-value directory of each process's latest time to batch, `<lane>/<process index>`:
`<last step> <seconds>`."""
VERDICT = f"{PREFIX}slowest-"
"""Key of process 0's verdict, + `<lane>`: `<process index> <seconds>`. In the stop directory,
which every process's watcher reads each poll period anyway, so a verdict costs the other
processes no RPC (the stop's reader takes only process indices: `host_stop.stopped`)."""
WINDOW_WAIT_S = 2.0
"""How long process 0's watcher thread waits at a window's end for the other hosts' figures of
that window (they reach it within a step of one another: every step ends in a collective), so
that the slowest host it names is this window's."""
READY = "pipeline/ready/"
"""Key-value directory of the readiness barriers: `<n>/<process index>`."""

_barriers = itertools.count()  # the same sequence on every process: feeds start in one order
_lanes = itertools.count()  # likewise, for the feeds that publish their time to batch


class Slowest(NamedTuple):
    """The slowest host's process index and time to batch (seconds per step)."""

    process: int
    seconds: float


class Peers:
    """One feed's time to batch, exchanged with the other hosts by the process's watcher
    thread: `offer` on the training thread (no RPC), `exchange` on the watcher's."""

    def __init__(self, warn: bool = True) -> None:
        """`warn`: process 0 logs each window's slowest host."""
        self._client = coordination_client()
        self._index = jax.process_index()
        self._lane = next(_lanes) if self._client is not None else 0
        self._warn = warn
        self._lock = threading.Lock()  # one exchange at a time: the watcher's or a close's
        self._pending: tuple[int, int, float] | None = None  # (first, last step, seconds)
        self._own: Slowest | None = None  # this host's latest published figure
        self._verdict: Slowest | None = None  # process 0's latest, as the stop poll read it
        self.slowest = Slowest(-1, 0.0)  # the latest known; read by `FeedStats`
        self.wake: Callable[[], None] = lambda: None  # the watcher's, once attached

    @property
    def shared(self) -> bool:
        """Whether there are other hosts to compare with."""
        return self._client is not None

    @property
    def pending(self) -> bool:
        """Whether a window's figure waits for `exchange`."""
        return self._pending is not None

    def offer(self, first_step: int, last_step: int, seconds: float) -> None:
        """This host's time to batch over the window of steps `first_step..last_step`; in one
        process it is the slowest at once, otherwise the watcher thread exchanges it."""
        if self._client is None:
            self.slowest = Slowest(self._index, seconds)
            return
        self._pending = (first_step, last_step, seconds)  # a later window replaces it
        self.wake()

    def exchange(self) -> None:
        """Publish the pending figure and learn the slowest host (see module); process 0 may
        wait up to `WINDOW_WAIT_S` for the others' figures of the window."""
        with self._lock:
            figure, self._pending = self._pending, None
            if figure is None:
                return
            try:
                self.slowest = self._exchange(*figure)
            except Exception as error:  # a lost coordinator is JAX's to report
                log.warning("could not exchange the time to batch with the other hosts: %s", error)

    def _exchange(self, first_step: int, last_step: int, seconds: float) -> Slowest:
        mine = f"{last_step} {seconds!r}"
        self._client.key_value_set(
            f"{TIME_TO_BATCH}{self._lane}/{self._index}", mine, allow_overwrite=True
        )
        if self._index != 0:
            self._own = Slowest(self._index, seconds)
            return self._best()
        published = self._published(seconds)
        deadline, delay = time.monotonic() + WINDOW_WAIT_S, 0.01
        while min(step for step, _ in published.values()) < last_step:
            if time.monotonic() > deadline:
                break
            time.sleep(delay)
            delay = min(2 * delay, 0.25)  # a dozen reads at most
            published = self._published(seconds)
        process = max(published, key=lambda p: (published[p][1], -p))
        slowest = Slowest(process, published[process][1])
        self._client.key_value_set(
            f"{VERDICT}{self._lane}", f"{slowest.process} {slowest.seconds!r}",
            allow_overwrite=True,
        )  # fmt: skip
        if self._warn:
            log.info(
                "steps %d..%d: time to batch %.1f ms on host 0; slowest host %d: %.1f ms "
                "(median reader time per step)",
                first_step, last_step, seconds * 1e3, slowest.process, slowest.seconds * 1e3,
            )  # fmt: skip
        return slowest

    def heard(self, polled: dict[str, str]) -> None:
        """The stop directory as the watcher's poll read it: process 0's verdict, if any."""
        value = polled.get(f"{VERDICT}{self._lane}")
        if self._index == 0 or value is None:
            return
        process, seconds = value.split()
        self._verdict = Slowest(int(process), float(seconds))
        self.slowest = self._best()

    def _best(self) -> Slowest:
        """The slower of process 0's latest verdict about another host and this host's own
        latest figure (the verdict may be a window old)."""
        own, verdict = self._own, self._verdict
        other = verdict is not None and verdict.process != self._index
        if other and (own is None or verdict.seconds > own.seconds):
            return verdict
        return own or verdict or Slowest(-1, 0.0)

    def _published(self, seconds: float) -> dict[int, tuple[int, float]]:
        """Every host's latest `(last step, seconds)`; a host that has published none counts
        as step -1."""
        published = {p: (-1, 0.0) for p in range(jax.process_count())}
        published[self._index] = (1 << 62, seconds)
        directory = f"{TIME_TO_BATCH}{self._lane}/"
        for name, value in self._client.key_value_dir_get(directory):
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
