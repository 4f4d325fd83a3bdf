"""Which host holds the job back: per-host time to batch, the slowest host, and an opt-in
readiness barrier.

Every step's collectives wait for the last host, so one slow loader slows (or, before its first
batch, silently stalls) a job of hundreds. Two signals name it:

* **Time to batch.** Every `feed.stats_window` steps each process hands the median time its
  reader tasks took per step over the window (`FeedStats.time_to_batch_s`) to the process's
  watcher thread (`pipeline.feed.watcher`), which publishes it to the coordination service's
  key-value store that `jax.distributed.initialize` started, under `pipeline/ttb/<lane>/<process
  index>` (lane: the feed's rank among the process's feeds with statistics, the same on every
  process: feeds start in one order). Only process 0 reads every host's figure back: once after
  publishing its own, then again now and then while the window is open (`Peers.settle`, at
  `Peers.read_at`: the watcher's loop schedules each read as it does a stop poll, so none is a
  wait and the stop polls keep their period). The window closes when every host's figure is
  of it (the host named is that window's slowest) or `WINDOW_WAIT_S` after it opened (a host
  still without one is that far behind: the one furthest behind is named); a feed's close
  gives its open windows their verdict with one read.
  Process 0 logs one INFO line per window and publishes the verdict in the stop directory
  (`VERDICT`), which the other processes' watchers read with their next stop poll. The slowest
  host and its time are in `FeedStats` (so Prometheus). Per feed and window (at most one a
  poll period): one small RPC on each process; process 0 also reads the directory (O(processes)
  values; again while a figure of the window is missing, a dozen times at most) and writes
  the verdict. None of it on the training thread: `next()` only hands the
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
"""How long process 0 keeps a window open for the other hosts' figures of it (they reach it
within a step of one another: every step ends in a collective), reading them again now and
then (`READ_AGAIN_S`); a host still without one after that is named the slowest."""
READ_AGAIN_S = (0.01, 0.25)
"""Process 0's gaps between two reads of a window's figures: the first, doubling up to the
second (the first read and a dozen more at most a window); each a read on the watcher thread,
never a wait."""
READY = "pipeline/ready/"
"""Key-value directory of the readiness barriers: `<n>/<process index>`."""

_barriers = itertools.count()  # the same sequence on every process: feeds start in one order
_lanes = itertools.count()  # likewise, for the feeds that publish their time to batch


class Slowest(NamedTuple):
    """The slowest host's process index and time to batch (seconds per step)."""

    process: int
    seconds: float


class _Window(NamedTuple):
    """A window of process 0's whose verdict waits for other hosts' figures."""

    first: int
    last: int
    seconds: float
    deadline: float  # time.monotonic() after which a host without a figure of it is named


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
        self._open: list[_Window] = []  # process 0's windows awaiting figures, oldest first
        self._read_at, self._delay = 0.0, READ_AGAIN_S[0]  # process 0's next read, then gap
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

    @property
    def read_at(self) -> float | None:
        """When process 0's watcher reads the figures again (`settle`; `time.monotonic()`):
        None unless a window waits for other hosts' figures."""
        return self._read_at if self._open else None

    def exchange(self, final: bool = False) -> None:
        """Publish the pending figure and learn the slowest host (see module); on process 0 the
        window stays open until every host's figure of it is in (`settle`). `final`: the feed
        closes; process 0 gives every open window its verdict now, with one read."""
        with self._lock:
            figure, self._pending = self._pending, None
            self._talk(figure, settle=figure is not None or final, final=final)

    def settle(self) -> None:
        """Process 0, at `read_at`: one read of every host's figure (one RPC, no wait); the
        verdict of each open window that is complete or `WINDOW_WAIT_S` old."""
        with self._lock:
            self._talk(None, settle=True, final=False)

    def _talk(self, figure: tuple[int, int, float] | None, settle: bool, final: bool) -> None:
        try:
            if figure is not None:
                self._publish(*figure)
            if settle and self._open:
                self._settle(final)
        except Exception as error:  # a lost coordinator is JAX's to report
            self._open.clear()  # no verdict to wait for: nothing left to read again
            log.warning("could not exchange the time to batch with the other hosts: %s", error)

    def _publish(self, first_step: int, last_step: int, seconds: float) -> None:
        self._client.key_value_set(
            f"{TIME_TO_BATCH}{self._lane}/{self._index}", f"{last_step} {seconds!r}",
            allow_overwrite=True,
        )  # fmt: skip
        if self._index != 0:
            self._own = Slowest(self._index, seconds)
            self.slowest = self._best()
            return
        now = time.monotonic()
        if not self._open:
            self._delay = READ_AGAIN_S[0]
        self._open.append(_Window(first_step, last_step, seconds, now + WINDOW_WAIT_S))

    def _settle(self, final: bool) -> None:
        """One read of every host's figure; each open window that has them all, is past its
        deadline or (`final`) closes, gets its verdict; the latest is published."""
        published, now = self._published(), time.monotonic()
        verdict, still = None, []
        for window in self._open:
            missing = [p for p, (step, _) in published.items() if step < window.last]
            late = now >= window.deadline
            if missing and not (late or final):
                still.append(window)
                continue
            verdict = self._judge(window, published, missing, late)
        self._open = still
        if still:  # soon, then less often: the others publish within a step of this host
            self._read_at = min(now + self._delay, still[0].deadline)
            self._delay = min(2 * self._delay, READ_AGAIN_S[1])
        if verdict is None:
            return
        self._client.key_value_set(
            f"{VERDICT}{self._lane}", f"{verdict.process} {verdict.seconds!r}",
            allow_overwrite=True,
        )  # fmt: skip
        self.slowest = verdict

    def _judge(
        self, window: _Window, published: dict[int, tuple[int, float]], missing: list[int],
        late: bool,
    ) -> Slowest:  # fmt: skip
        """The window's slowest host, logged. Past the deadline a host without a figure of the
        window is that far behind: the one furthest behind is named, with its latest figure (0
        if none). Else the longest time among every host's latest figure (when the feed closes,
        a host's may be of an earlier window: the line names those)."""
        figures = {**published, self._index: (window.last, window.seconds)}
        if late and missing:
            process = min(missing, key=lambda p: (figures[p][0], p))
            seconds = figures[process][1]
            slowest = (
                f"no figure of these steps within {WINDOW_WAIT_S:g} s (missing: "
                f"{hosts(missing)}; its latest {seconds * 1e3:.1f} ms)"
            )
        else:
            process = max(figures, key=lambda p: (figures[p][1], -p))
            seconds = figures[process][1]
            slowest = f"{seconds * 1e3:.1f} ms (median reader time per step)"
            if missing:
                slowest += f"; the feed closed before the figure of {hosts(missing)}"
        if self._warn:
            log.info(
                "steps %d..%d: time to batch %.1f ms on host 0; slowest host %d: %s",
                window.first, window.last, window.seconds * 1e3, process, slowest,
            )  # fmt: skip
        return Slowest(process, seconds)

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

    def _published(self) -> dict[int, tuple[int, float]]:
        """Every other host's latest `(last step, seconds)` (one read); a host that has
        published none counts as step -1."""
        published = {p: (-1, 0.0) for p in range(jax.process_count()) if p != self._index}
        directory = f"{TIME_TO_BATCH}{self._lane}/"
        for name, value in self._client.key_value_dir_get(directory):
            step, figure = value.split()
            process = int(name.rsplit("/", 1)[-1])
            if process != self._index:
                published[process] = (int(step), float(figure))
        return published


def hosts(processes: list[int]) -> str:
    """`host 3`, `hosts 1, 2`, `hosts 1, ..., 10 and 5 more`: for one line."""
    listed = ", ".join(map(str, processes[:10]))
    listed += f" and {len(processes) - 10} more" if len(processes) > 10 else ""
    return f"host{'s' if len(processes) > 1 else ''} {listed}"


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
    raise FeedError(
        f"feed.ready_timeout_s: {hosts(missing)} of "
        f"{jax.process_count()} produced no first batch within {timeout_s:g} s of host "
        f"{jax.process_index()}'s ({first_batch_s:.1f} s after its feed opened): a slow or "
        "stuck loader there (docs/observability.md)"
    )
