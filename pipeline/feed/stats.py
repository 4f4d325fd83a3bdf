"""Feed statistics: what the feed served, how long reads took, how long the consumer waited.

The feed calls this module at three points: each step's reader task counts its rows, tokens
and bytes per source (`StepRead.of`, in the reader thread), each `next()` hands the step's
counts and its own timing to `Recorder.served` (a few additions in the consumer thread), and
`seek` calls `Recorder.restart`. Percentiles, ledger totals and epochs are computed only when
asked for (`DataFeed.stats()`, a Prometheus scrape), so a step costs tens of microseconds
(`pipeline bench` measures it).

A step is *input-bound* when the consumer spent more than `input_bound_share` of the step
(the time between two `next()` returns) inside `next()`. Every `stats_window` steps served,
if any of them was input-bound, one warning line says how many, with the figures.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.feed.stragglers import Peers, Slowest
from pipeline.plan.draws import Draws
from pipeline.plan.ledger import Ledger
from pipeline.plan.plan import SegmentPlan
from pipeline.read.plan import Plan
from pipeline.store.remote_reads import downloaded

log = logging.getLogger("pipeline")

RECENT_STEPS = 1024
"""How many recent steps the p50/p99 figures are taken over."""


@dataclass(frozen=True)
class StepRead:
    """One step's reader task: (source, rows, tokens, token bytes) of each source it read
    rows of, and when it ran. Counted in the reader thread, so `next()` only adds."""

    served: tuple[tuple[str, int, int, int], ...]
    started: float
    finished: float

    @classmethod
    def of(cls, plan: Plan, draws: Draws, started: float) -> StepRead:
        rows = np.bincount(draws.source, minlength=len(draws.source_names))
        return cls.counted(plan.segment_plan(draws.segment_index), rows, started)

    @classmethod
    def counted(
        cls, segment: SegmentPlan, rows: np.ndarray, started: float, finished: float | None = None
    ) -> StepRead:
        """`rows` [source index of the segment] read from `started` to `finished` (now)."""
        length, names = segment.config.seq_len, segment.config.source_names
        drawn = np.flatnonzero(rows)  # the sources read, not every source of the mix
        layouts = segment.layouts  # by name: laid out when asked (`lazy_layouts`)
        served = tuple(
            (names[k], n, n * length, n * (length + 1) * layouts[names[k]].meta.dtype.itemsize)
            for k, n in zip(drawn.tolist(), rows[drawn].tolist())
        )
        return cls(served, started, time.perf_counter() if finished is None else finished)


@dataclass(frozen=True)
class Quantiles:
    """A duration per step: median and 99th percentile of recent steps, sum and count of all."""

    p50: float
    p99: float
    sum: float
    count: int


@dataclass(frozen=True)
class FeedStats:
    """A snapshot of one process's feed (docs/observability.md lists every field)."""

    process_index: int
    step: int  # the step the next `next()` returns
    steps: int  # steps served by this feed
    rows: dict[str, int]  # this process's rows per source, served by this feed
    tokens: dict[str, int]  # rows x seq_len
    bytes_read: dict[str, int]  # token bytes of the windows read (seq_len + 1 per row)
    ledger_rows: dict[str, int]  # the whole job's rows per source since the ledger began
    ledger_tokens: dict[str, int]
    epochs: dict[str, int]  # the epoch each source's next window comes from
    prefetch: int  # steps read ahead at most
    prefetch_ready: int  # steps already read when the last next() began
    read_s: Quantiles  # reader time per step: the step's reader task, start to end
    wait_s: Quantiles  # time the consumer spent inside next() per step
    next_cpu_s: Quantiles  # the consumer thread's CPU time inside next() per step
    last_wait_s: float
    input_bound_steps: int
    time_to_batch_s: float  # median reader time per step over the last window (0: none yet)
    slowest_process: int  # the host with the longest latest time to batch (-1: none yet)
    slowest_time_to_batch_s: float  # its time to batch
    # bytes this process downloaded from object storage (all its feeds and stores), and per
    # token this feed served (pipeline.store.remote_reads)
    downloaded_bytes: int = 0
    downloaded_per_token: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Recorder:
    """Accumulates one feed's figures; thread-safe (a scrape reads while the feed runs)."""

    def __init__(
        self,
        process_index: int,
        prefetch: int,
        share: float,
        window: int,
        warn: bool,
        peers: Peers | None = None,
    ) -> None:
        self.process_index, self.prefetch, self.share = process_index, prefetch, share
        self.window, self.warn, self.peers = window, warn, peers
        self._time_to_batch = 0.0
        self._slowest = Slowest(-1, 0.0)  # without peers: this host, once a window is done
        self._lock = threading.Lock()
        self._steps = self._bound = self._ready = 0
        self._rows: collections.Counter[str] = collections.Counter()
        self._tokens: collections.Counter[str] = collections.Counter()
        self._bytes: collections.Counter[str] = collections.Counter()
        self._read = collections.deque(maxlen=RECENT_STEPS)
        self._wait = collections.deque(maxlen=RECENT_STEPS)
        self._cpu = collections.deque(maxlen=RECENT_STEPS)
        self._sums = [0.0, 0.0, 0.0]  # read, wait, cpu
        self._previous: float | None = None  # when the last next() returned
        self._recent: list[tuple[int, bool, float, float, float, int]] = []

    def restart(self) -> None:
        """After a seek the time since the last step is no step time."""
        self._previous = None

    def served(
        self, step: int, task: StepRead, entered: float, left: float, ready: int, cpu: float = 0.0
    ) -> None:
        """Step `step` was returned by a next() that ran from `entered` to `left`
        (`time.perf_counter()`) and took `cpu` seconds of its thread's CPU (what the feed
        takes from a trainer's thread), with `ready` prefetched steps already read when it
        began."""
        wait = left - entered
        read = task.finished - task.started
        step_s = None if self._previous is None else left - self._previous
        self._previous = left
        bound = step_s is not None and wait > self.share * step_s
        with self._lock:
            self._steps += 1
            self._bound += bound
            self._ready = ready
            for name, rows, tokens, size in task.served:
                self._rows[name] += rows
                self._tokens[name] += tokens
                self._bytes[name] += size
            self._read.append(read)
            self._wait.append(wait)
            self._cpu.append(cpu)
            self._sums[0] += read
            self._sums[1] += wait
            self._sums[2] += cpu
        if step_s is not None:
            self._recent.append((step, bound, wait, step_s, read, ready))
        if len(self._recent) >= self.window:
            self._report(self._recent)
            self._compare(self._recent)
            self._recent = []

    def snapshot(self, plan: Plan, step: int) -> FeedStats:
        with self._lock:
            rows, tokens, size = dict(self._rows), dict(self._tokens), dict(self._bytes)
            read, wait, sums = list(self._read), list(self._wait), list(self._sums)
            cpu = list(self._cpu)
            steps, bound, ready = self._steps, self._bound, self._ready
            time_to_batch, slowest = self._time_to_batch, self._slowest
        if self.peers is not None:
            slowest = self.peers.slowest
        segment = plan.segment_plan_at(step)
        counters = segment.counters_at(step)  # windows per lane, carried across switches
        drawn = ledger_totals(plan.ledger, plan.ledger.segment_index(step), counters)
        return FeedStats(
            process_index=self.process_index,
            step=step,
            steps=steps,
            rows=rows,
            tokens=tokens,
            bytes_read=size,
            ledger_rows={n: rows for n, (rows, _) in drawn.items()},
            ledger_tokens={n: tokens for n, (_, tokens) in drawn.items()},
            epochs={n: segment.layouts[n].epoch_of(c) for n, c in counters.items()},
            prefetch=self.prefetch,
            prefetch_ready=ready,
            read_s=_quantiles(read, sums[0], steps),
            wait_s=_quantiles(wait, sums[1], steps),
            next_cpu_s=_quantiles(cpu, sums[2], steps),
            last_wait_s=wait[-1] if wait else 0.0,
            input_bound_steps=bound,
            time_to_batch_s=time_to_batch,
            slowest_process=slowest.process,
            slowest_time_to_batch_s=slowest.seconds,
            downloaded_bytes=downloaded(),
            downloaded_per_token=downloaded() / max(1, sum(tokens.values())),
        )

    def _compare(self, recent: list[tuple[int, bool, float, float, float, int]]) -> None:
        """This host's time to batch over the window, handed to `peers` (the watcher thread
        publishes it and learns the slowest host's: no RPC here)."""
        seconds = float(np.median([r[4] for r in recent]))
        with self._lock:
            self._time_to_batch = seconds
            if self.peers is None:
                self._slowest = Slowest(self.process_index, seconds)
        if self.peers is not None:
            self.peers.offer(recent[0][0], recent[-1][0], seconds)

    def _report(self, recent: list[tuple[int, bool, float, float, float, int]]) -> None:
        bound = [r for r in recent if r[1]]
        if not bound or not self.warn:
            return
        _, _, wait, step_s, read, ready = (np.median([r[i] for r in bound]) for i in range(6))
        log.warning(
            "steps %d..%d: input-bound on %d of %d steps: next() took %.1f ms of a %.1f ms step "
            "(%.0f%%, limit %.0f%%), reads %.1f ms per step, %d of %d prefetched steps ready "
            "(median of the input-bound steps); see docs/observability.md",
            recent[0][0], recent[-1][0], len(bound), len(recent), wait * 1e3, step_s * 1e3,
            100 * wait / step_s, 100 * self.share, read * 1e3, ready, self.prefetch,
        )  # fmt: skip


def _quantiles(values: list[float], total: float, count: int) -> Quantiles:
    if not values:
        return Quantiles(0.0, 0.0, 0.0, 0)
    p50, p99 = np.percentile(values, [50, 99]).tolist()
    return Quantiles(p50, p99, total, count)


def ledger_totals(
    ledger: Ledger, index: int, counters: dict[str, int]
) -> dict[str, tuple[int, int]]:
    """Per source, (rows, target tokens) the whole job drew from it before the counters
    `counters` of segment `index`: each segment's share of the counter (since the counter last
    started at 0) times that segment's `lanes` (and `seq_len`), so a switch that changed them
    counts each part in its own geometry. O(segments)."""
    out = {}
    for name, counter in counters.items():
        rows = tokens = 0
        for segment in reversed(ledger.segments[: index + 1]):
            start = segment.counters[name]
            lanes, seq_len = segment.config["lanes"], segment.config["seq_len"]
            rows += (counter - start) * lanes
            tokens += (counter - start) * lanes * seq_len
            if not start:
                break
            counter = start
        out[name] = (rows, tokens)
    return out
