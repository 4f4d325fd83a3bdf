"""The JAX feed: the plan's rows of each step as global `jax.Array`s sharded over a mesh.

    feed = DataFeed(load_config("data.yaml"), mesh, batch_axes=("data", "fsdp"))
    for batch in feed:            # dict of the six MaxText fields (pipeline.read.batch.FIELDS)
        state = train_step(state, batch)

Every field of step `s` has global shape [global_batch_size, seq_len] (the batch of step `s`
when `global_batch_size` is a schedule: see "Batch-size schedules" below) and sharding
`NamedSharding(mesh, PartitionSpec(batch_axes, None))`. With `grad_accum > 1` a field is
[grad_accum, global_batch_size // grad_accum, seq_len], sharded `PartitionSpec(None,
batch_axes, None)`: micro-batch g (`batch[k][g]`) holds rows `micro_batch_rows(..., g)` of the
step, the consecutive slices the plan defines, and every device holds its share of every
micro-batch, so a `lax.scan` over axis 0 needs no communication.

Which rows a process computes is read off the sharding: `addressable_devices_indices_map` gives
each local device's slice of the global array, and the process reads exactly the union of those
rows (no host reads a row that none of its devices holds). Any mesh layout and any batch axes
work, including meshes where devices also replicate the batch over a model axis.

Reading, host assembly and the device transfer run ahead in reader threads: at most `prefetch`
steps are in flight, each one task (`min(threads, prefetch)` persistent threads fed by a queue,
`pipeline.feed.readers`, work on different steps; `threads: auto`, the default, is one thread
when every store planned at the start is local, 4 when one is remote: `reader_count`). A task
(`pipeline.feed.step_task`) reads the step's local rows with one `Plan.read` and transfers
every field as `jax.make_array_from_process_local_data` would, without its per-array Python
(`pipeline.feed.placer`; `feed: {expand: device}`: the rows' compact form, expanded to the six
fields on the devices, `pipeline.feed.expand`), so `next()` in the training thread only hands
over arrays that are already on the devices (prefetched batches occupy device
memory, as with any device prefetch). The rows of a step are a pure function of (ledger, step,
row), so the result never depends on depth, threads, timing or restart history; `seek` only
moves the step. Over stores in buckets, one more thread fetches the blocks of the steps after
those read ahead (`pipeline.feed.fetch_ahead`).
An error `next()` raises stops every other process too, with the same line
(`pipeline.feed.host_stop`); the process's one watcher thread (`pipeline.feed.watcher`) polls
for the peers' stops, re-checks that each store is still the one opened and exchanges the
stragglers' figures, for all the process's feeds, so `next()` makes no RPC at steady state.

Batch-size schedules: when the step's batch changes (`global_batch_size: {step: {0: 64, 2000:
128}}`, or a ledger switch to another batch), the feed builds the step's arrays with the new
global shape, and a `jax.jit`-compiled step function traces and compiles once more for that
shape (once per distinct size, then cached). `feed.shape(step)` says the shape ahead of time,
e.g. to compile every size before training. Every scheduled size is checked against the mesh
when the feed is built, so a size the batch axes cannot split stops the run before step 0.

Opt-in extras (docs/observability.md): per-row `provenance` fields (`source`, `epoch`,
`window`: [global_batch_size] int32, sharded like the rows), `stats()` (pipeline.feed.stats)
and a Prometheus endpoint (`metrics_port`, pipeline.feed.metrics).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pipeline.config import DataConfig
from pipeline.config.parse import MAX_THREADS, PROVENANCE, is_count, is_thread_count, last_step
from pipeline.errors import FeedError, PipelineError, StoreError
from pipeline.feed import expand, fetch_ahead, shared_stores
from pipeline.feed.geometry import Geometry, geometry
from pipeline.feed.host_stop import stop_periods
from pipeline.feed.mix_agreement import check_same_call
from pipeline.feed.readers import Readers, reader_count
from pipeline.feed.stats import FeedStats, Recorder
from pipeline.feed.step_task import read_step
from pipeline.feed.store_check import BackgroundVerify, verify_share
from pipeline.feed.stragglers import Peers, wait_until_ready
from pipeline.feed.watcher import HostStop
from pipeline.plan.draws import DrawSummary
from pipeline.plan.ledger import Ledger, MixEntry, quantize
from pipeline.plan.report import ScheduledSources, batch_span
from pipeline.plan.sources import plan_stores
from pipeline.read import objective
from pipeline.read.plan import Plan
from pipeline.store.store_set import StoreSet

if TYPE_CHECKING:
    from pipeline.feed.metrics import MetricsServer

log = logging.getLogger("pipeline")


def _plan_on_every_process(config: DataConfig) -> Plan:
    """Plan from the config's stores' metadata (`plan_stores`: a local store is opened at its
    first draw, shared with the process's other feeds: `shared_stores`); if any process cannot,
    every process raises (none hangs), having handed back every store it opened (a bucket's,
    or one a best-fit layout read)."""
    plan, error = None, None
    held = shared_stores.store_set(config.feed.check_reads)
    try:
        stores = plan_stores(config, held.open_now)  # a bucket's stores: opened now, kept
        plan = Plan.from_config(config, stores, held)
        if config.feed.verify == "open":
            verify_share(plan)
    except PipelineError as failure:
        error = failure
        shared_stores.release_all(held)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.asarray(multihost_utils.process_allgather(np.array([error is not None])))
        others = [int(i) for i in np.flatnonzero(failed.reshape(-1)) if i != jax.process_index()]
        if others and error is None:
            raise FeedError(
                f"{config.origin}: process(es) {others} cannot open the data (see their "
                "logs); every process stops before the first step"
            )
    if error is not None:
        raise error
    return plan


def _plan_of(feed: weakref.ref[DataFeed]) -> Plan | None:
    """A feed's current plan (None once the feed is collected); a weak reference, so that the
    watcher thread does not keep a forgotten feed alive."""
    live = feed()
    return live._plan if live is not None else None


class DataFeed:
    """An iterator of global batches (dicts of `jax.Array`) for steps `step`, `step + 1`, ..."""

    def __init__(
        self,
        config_or_plan: DataConfig | Plan,
        mesh: Mesh,
        batch_axes: str | tuple[str, ...] = ("data",),
        *,
        step: int = 0,
        prefetch: int | None = None,
        threads: int | str | None = None,
        log_events: bool = True,
        provenance: Sequence[str] | None = None,
        metrics_port: int | None = None,
        stats: bool = True,
    ) -> None:
        # first, every argument and $PIPELINE_STOP_*_S: a bad one fails before any store is
        # acquired or collective run
        periods = stop_periods()
        if isinstance(config_or_plan, Plan):
            self.config = config_or_plan.config
        elif isinstance(config_or_plan, DataConfig):
            self.config = config_or_plan
        else:
            raise FeedError(
                f"DataFeed takes a DataConfig or a Plan, got {type(config_or_plan).__name__}"
            )
        self.mesh = mesh
        self.batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        self._check_axes()
        self.prefetch = self.config.feed.prefetch if prefetch is None else prefetch
        self.threads = self.config.feed.threads if threads is None else threads
        # the bounds of the config's feed.prefetch and feed.threads, for the arguments too
        counts = f"an integer from 1 to {MAX_THREADS:,}"
        if not is_count(self.prefetch, MAX_THREADS):
            raise FeedError(f"DataFeed prefetch: expected {counts}, got {self.prefetch!r}")
        if not is_thread_count(self.threads, MAX_THREADS):
            raise FeedError(f"DataFeed threads: expected {counts} or auto, got {self.threads!r}")
        self.provenance = tuple(self.config.feed.provenance if provenance is None else provenance)
        if any(name not in PROVENANCE for name in self.provenance):
            raise FeedError(f"provenance: expected names from {PROVENANCE}, got {provenance!r}")
        # epoch rollovers and stage changes, one line each; input-bound warnings
        self.log_events = log_events
        # a plan of the config opens its stores shared: released, not closed, by close()
        self._shared = not isinstance(config_or_plan, Plan)
        self._plan = _plan_on_every_process(self.config) if self._shared else config_or_plan
        self._scheduled = ScheduledSources(self._plan)  # for the event log, in the readers
        # close() hands the shared stores back; so does collecting a feed never closed
        shared = self._plan.store_set if self._shared else StoreSet()
        self._release = weakref.finalize(self, shared_stores.release_all, shared)
        # decided once, from the stores planned now: a later switch to a remote store keeps it
        remote = (
            bool(self.config.in_buckets) if self._shared else fetch_ahead.in_buckets(self._plan)
        )
        self.reader_threads = reader_count(self.threads, self.prefetch, remote)
        self._ahead = fetch_ahead.FetchAhead.of(self, remote, self.config.feed.remote.fetch_ahead)
        self._geometries: dict[tuple[int, int], Geometry] = {}
        # (plan, first step, end step, geometry): the steps known to share one geometry, so
        # that next() finds a step's geometry with two comparisons (`_geometry_at`)
        self._span: tuple[Plan | None, int, float, Geometry | None] = (None, 0, 0, None)
        for _, size in self.config.batch_sizes:  # every scheduled size, before any step
            self._geometry(size, self.config.seq_len)
        self._readers: Readers | None = None
        self._queued = self._step = self._check_step(step)  # steps [_step, _queued) handed out
        self._served: tuple[jax.Array, ...] = ()  # the last next()'s, freed by a reader thread
        self._last: DrawSummary | None = None  # the previous step's (None: just started)
        self._epochs: dict[str, int] = {}  # highest epoch of each source drawn since then
        self._mixed: frozenset[str] = frozenset()  # sources scheduled at the previous step
        self._closed = False
        self._adopted: tuple[str, ...] = ()  # a restore's events: log_restore_events
        self._opened = time.perf_counter()
        self._awaiting_peers = self.config.feed.ready_timeout_s is not None
        peers = Peers(warn=log_events) if stats else None  # exchanged by the watcher thread
        self._host_stop = HostStop(partial(_plan_of, weakref.ref(self)), periods, peers)
        weakref.finalize(self, self._host_stop.abandon)  # a feed never closed
        background = self.config.feed.verify == "background"
        self._verifier = BackgroundVerify(self._plan) if background else None
        options = self.config.feed
        self._stats = (
            Recorder(jax.process_index(), self.prefetch, options.input_bound_share,
                     options.stats_window, warn=log_events, peers=peers)
            if stats else None
        )  # fmt: skip
        self._metrics: MetricsServer | None = None
        port = options.metrics_port if metrics_port is None else metrics_port
        if port is not None:
            self._serve_metrics(port)

    # -- public API ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step the next `next()` returns."""
        return self._step

    @property
    def plan(self) -> Plan:
        """The data plan the feed serves (its ledger, stores and draws)."""
        return self._plan

    @property
    def ledger(self) -> Ledger:
        """The ledger in force: what a checkpoint saves with the step (`DataSave`)."""
        return self._plan.ledger

    def source_names(self, step: int | None = None) -> tuple[str, ...]:
        """What the `source` field of `step` (default: the next step) indexes."""
        return self._plan.segment_plan_at(self._step if step is None else step).config.source_names

    def stats(self) -> FeedStats:
        """A snapshot of what this process's feed served and how long it took."""
        if self._stats is None:
            raise FeedError("this DataFeed keeps no statistics (built with stats=False)")
        return self._stats.snapshot(self._plan, self._step)

    def sharding(self, step: int | None = None) -> NamedSharding:
        """The sharding of every field of `step` (default: the next step)."""
        return self._geometry_at(self._step if step is None else step).sharding

    def shape(self, step: int | None = None) -> tuple[int, ...]:
        """The global shape of every field of `step` (default: the next step)."""
        return self._geometry_at(self._step if step is None else step).shape

    def seek(self, step: int) -> None:
        """Continue at `step`: O(1), drops any prefetched work."""
        self._ensure_open()
        self._step = self._check_step(step)
        self._drop_pending()
        self._last = None
        if self._stats is not None:
            self._stats.restart()

    def set_mix(
        self,
        weights: Mapping[str, float] | None,
        step: int,
        *,
        objective: Mapping[str, float] | None = None,
    ) -> None:
        """From `step` on (`step >= feed.step`), the stage in force at `step` takes `weights`
        (by source name; absent sources get 0) until the next call, the end of that stage or
        the next ledger segment (docs/mixtures.md, "Adaptive mixtures"); `objective`, likewise,
        its objective weights (the batch's `loss_weights`, "Objective weights"). Either may be
        None (not changed), not both.

        The weights are quantized (`ledger.quantize`: integers in units of 2^-20 of their
        total) and recorded in the ledger, so the checkpoint's data state carries the call and
        every step replays exactly; batches already read ahead from `step` on are read again.
        Every process must make the same calls: each call is compared with the peers'
        (`mix_agreement`), and a difference stops every process with one line.
        """
        self._ensure_open()
        step = self._check_step(step)
        if step < self._step:
            raise FeedError(
                f"set_mix at step {step}: the feed has already served it; the next step is "
                f"{self._step}"
            )
        if weights is None and objective is None:
            raise FeedError(f"set_mix at step {step}: give weights, an objective, or both")
        plan, entries, where = self._plan, [], f"set_mix at step {step}"
        if weights is not None:  # a call the plan cannot take raises here
            entries.append(MixEntry(step, quantize(weights, where)))
            plan = plan.with_mix(entries[-1])
        if objective is not None:
            entries.append(MixEntry(step, quantize(objective, f"{where}: objective")))
            plan = plan.with_objective(entries[-1])
        for entry in entries:
            check_same_call(entry)
        if step < self._queued:
            self._drop_pending()  # read ahead under the old weights: read again, in order
        self._plan = plan
        self._scheduled = ScheduledSources(plan)

    def start_prefetch(self) -> None:
        """Start reading the next `prefetch` steps now rather than at the first `next()`.

        A restore calls it as soon as the data state is adopted, so the first batch is being
        read while the checkpoint manager restores the rest of the checkpoint.
        """
        self._ensure_open()
        self._fill()

    @property
    def prefetched(self) -> tuple[tuple[int, bool], ...]:
        """(step, read) of each step being read ahead: submitted to the reader threads and not
        yet returned by `next()`, in order; `read` once its global arrays are built. After a
        restore, the restored step is here before the first `next()`."""
        readers = self._readers
        return tuple(
            (step, readers is not None and readers.done(step))
            for step in range(self._step, self._queued)
        )

    def state(self) -> dict[str, Any]:
        """The whole data state, small and JSON-able: the next step and the ledger."""
        return {"step": self._step, "ledger": self._plan.ledger.to_json()}

    @property
    def expands_on_device(self) -> bool:
        """Whether the next step's rows travel in their compact form and the devices build the
        six fields (`feed.expand` of the config in force, `pipeline.feed.expand`)."""
        return expand.on_device(self.config.feed.expand, self._geometry_at(self._step))

    def adopt(self, ledger: Ledger, step: int, events: Sequence[str] = ()) -> None:
        """Follow `ledger` (a restored, reconciled one) from `step` on; the runtime settings
        (`feed:`) stay the config in force's, never the ledger's recorded defaults. `events`
        (the restore's lines: its switch or skip, the state restored) wait for
        `log_restore_events`: an Orbax item restored after this one may still fail, and a run
        that did not switch (or restore) must not say it did."""
        self._ensure_open()
        self._adopted = tuple(events)
        self._plan = Plan(ledger, self._plan.store_set, exclude_files=self._plan.exclude_files)
        self._scheduled = ScheduledSources(self._plan)
        self.seek(step)

    def close(self) -> None:
        """Stop and join the reader threads and close the stores' readers. Idempotent."""
        if self._closed:
            return
        self._closed, self._served = True, ()  # a closed feed holds no arrays
        if self._metrics is not None:
            self._metrics.close()
        if self._verifier is not None:
            self._verifier.close()
        self._host_stop.close()
        self._drop_pending()
        if self._readers is not None:
            self._readers.close(wait=True)
        self._ahead.close()
        self._release()
        for store in [] if self._shared else self._plan.stores():
            try:
                store.close()
            except StoreError as error:  # a reader of a damaged file may fail to close
                log.warning("%s", error)

    def __iter__(self) -> DataFeed:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        self._ensure_open()
        try:
            return self._next()
        except FeedError as error:  # fatal to the job: tell the other hosts why (host_stop)
            self._host_stop.publish(str(error))
            raise

    def log_restore_events(self) -> None:
        """Log the last restore's lines (`adopt`), once: at the first `next()` (the whole
        restore succeeded), or at a save before it, whose checkpoint records them."""
        for line in self._adopted:
            log.info("%s", line)
        self._adopted = ()

    def _next(self) -> dict[str, jax.Array]:
        self.log_restore_events()
        self._host_stop.check()  # a peer's stop, or a store replaced under the feed
        if self._verifier is not None:
            self._verifier.check()
        entered, entered_cpu = time.perf_counter(), time.thread_time()
        step = self._step
        self._fill()
        ready = self._readers.finished()
        try:
            rows = self._readers.take(step)
        except PipelineError as error:
            self._drop_pending()
            raise FeedError(f"step {step}: cannot read the batch: {error}") from error
        except Exception as error:
            self._drop_pending()
            raise FeedError(
                f"step {step}: a reader thread failed: {type(error).__name__}: {error}"
            ) from error
        self._step = step + 1
        if self._awaiting_peers:  # feed.ready_timeout_s: every host's first batch, or a line
            self._awaiting_peers = False
            wait_until_ready(self.config.feed.ready_timeout_s, time.perf_counter() - self._opened)
        if rows.events is not None:
            self._log_events(step, *rows.events)
        self._fill()
        self._ahead.follow(self._plan, self._queued, lambda s: self._geometry_at(s).rows)
        batch = rows.batch
        if objective.SOURCE in batch:  # here, in step order: it reduces across processes
            sources = len(self._plan.segment_plan_at(step).config.source_names)
            batch = expand.weigh(batch, self._geometry_at(step).sharding, sources)
        self._served = tuple(batch.values())
        if self._stats is not None:
            cpu = time.thread_time() - entered_cpu
            self._stats.served(step, rows.read, entered, time.perf_counter(), ready, cpu)
        return batch

    def __enter__(self) -> DataFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- geometry ----------------------------------------------------------------------------

    def _check_axes(self) -> None:
        names = tuple(self.mesh.axis_names)
        unknown = [axis for axis in self.batch_axes if axis not in names]
        if unknown or not self.batch_axes or len(set(self.batch_axes)) != len(self.batch_axes):
            sizes = ", ".join(f"{n}={self.mesh.shape[n]}" for n in names)
            raise FeedError(
                f"batch_axes {self.batch_axes}: each must be a distinct axis of the mesh "
                f"(mesh axes: {sizes})"
            )

    def _geometry_at(self, step: int) -> Geometry:
        plan, first, end, geometry = self._span
        if plan is self._plan and first <= step < end:
            return geometry
        segment, end = batch_span(self._plan, step)
        geometry = self._geometry(segment.batch_size(step), segment.config.seq_len)
        self._span = (self._plan, step, end, geometry)
        return geometry

    def _geometry(self, global_batch_size: int, seq_len: int) -> Geometry:
        key = (global_batch_size, seq_len)
        if key not in self._geometries:
            self._geometries[key] = geometry(
                self.mesh, self.batch_axes, self.config.grad_accum, global_batch_size, seq_len
            )
        return self._geometries[key]

    # -- prefetch ----------------------------------------------------------------------------

    def _fill(self) -> None:
        if self._readers is None:
            self._readers = Readers(self.reader_threads, "pipeline-feed")
            weakref.finalize(self, self._readers.close, wait=False)  # a forgotten feed's stop
        measure = self._stats is not None
        scheduled = self._scheduled if self.log_events else None
        while self._queued < self._step + self.prefetch:
            step = self._queued
            geometry = self._geometry_at(step)  # also builds the segment in this thread
            task = partial(
                read_step, self._plan, step, geometry, self.provenance, measure, scheduled,
                self.config.feed.expand, self._ahead.draws,
            )  # fmt: skip
            self._readers.submit(step, task, self._served)
            self._queued, self._served = step + 1, ()

    def _drop_pending(self) -> None:
        self._queued = self._step
        if self._readers is not None:
            self._readers.drop()

    # -- events ------------------------------------------------------------------------------

    def _log_events(self, step: int, summary: DrawSummary, mixed: frozenset[str]) -> None:
        """Stage starts, epoch rollovers, and sources joining or leaving the mixture.

        A source joins or leaves when its scheduled share starts or stops, not when a step
        happens to draw none of its rows (a small weight skips steps); an epoch rollover is
        the first draw of a higher epoch than any drawn before.
        """
        last, self._last = self._last, summary
        previous, self._mixed = self._mixed, mixed
        if last is None:
            log.info(
                "feed starts at step %d: stage %s; epochs %s; reader threads %d (threads: %s); %s",
                step,
                summary.stage_label,
                summary.epochs_label,
                self.reader_threads,
                self.threads,
                expand.describe(self.config.feed.expand, self._geometry_at(step)),
            )
            self._epochs = dict(summary.epochs)
            return
        if summary == last and mixed == previous:  # most steps: nothing starts or ends
            return
        for _, name in sorted(summary.stages - last.stages):
            log.info("step %d: stage %s starts", step, name)
        for name in sorted(mixed - previous):
            log.info("step %d: source %s joins the mixture", step, name)
        for name in sorted(previous - mixed):
            log.info("step %d: source %s leaves the mixture", step, name)
        known = self._epochs  # a step of a big mixture draws dozens: sort only the rollovers
        rolled = sorted((n, e) for n, e in summary.epochs.items() if e > known.get(n, e))
        for name, epoch in rolled:
            log.info("step %d: source %s starts epoch %d", step, name, epoch)
        known.update([(n, e) for n, e in summary.epochs.items() if n not in known] + rolled)

    def _serve_metrics(self, port: int) -> None:
        from pipeline.feed.metrics import serve

        if self._stats is None:
            raise FeedError("metrics_port: the metrics are the statistics; stats=False has none")
        try:
            self._metrics = serve(self.stats, port)
        except FeedError:
            self.close()  # the stores opened for this feed
            raise

    # -- checks ------------------------------------------------------------------------------

    def _check_step(self, step: int) -> int:
        """`step` as an int, refused unless within what int64 lane positions address."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise FeedError(f"step: expected an integer >= 0, got {step!r}")
        limit = last_step(self.config.batch_sizes)
        if step > limit:
            raise FeedError(
                f"step: expected an integer in 0..{limit} (the last step a batch of "
                f"{max(size for _, size in self.config.batch_sizes):,} rows can address), "
                f"got {step}"
            )
        return int(step)

    def _ensure_open(self) -> None:
        if self._closed:
            raise FeedError("the feed is closed; create a new DataFeed to continue")
