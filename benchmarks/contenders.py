"""The worker side of `pipeline bench`: contenders in their own OS process, driven by stdin.

    python benchmarks/contenders.py SPEC.json     # started by benchmarks/bench.py

The worker builds the contenders its spec names, takes one warm-up batch of each and prints
`{"ready": true}`. Then, one JSON command per stdin line, one JSON answer per stdout line
(after PREFIX):

* `{"run": NAME, "steps": n, "pace": s, "seconds": t}`: at least n batches of contender NAME,
  and more until t seconds have passed (so fast contenders are timed as long). With `pace` > 0 the
  consumer sleeps s seconds after each batch (a training step the device is busy with), so
  a prefetching pipeline is ahead and the time inside `next()` is what the training thread
  pays. Answers wall seconds, seconds inside `next()` (wall, and CPU of the consumer
  thread), tokens, the CPU seconds of this process and all its children (Grain's
  `mp_prefetch` workers) at the start and the end, and the feeds' threads live at the start.
* `{"restore": STEP}`: the documented restore path to the first global batch (ours: a fresh
  `DataFeed`, `CheckpointManager.restore` of a `DataRestore` item, `next()`; Grain: a fresh
  iterator, `set_state`, `next()`, the global arrays), after one untimed warm-up; ours also
  with `"mixes": N`, a checkpoint whose ledger records N `set_mix` calls.
* `{"padding": NAME, "steps": n}`: the padding fraction of n more batches of contender NAME,
  counted from its global arrays (the packed-SFT rows).
* `{"close": NAME}`: close contender NAME (a feed's reader threads and prefetch), so that it
  reads nothing beside the next run.
* `{"quit": true}`.

A spec with `processes` > 1 joins a localhost `jax.distributed` job first (the scale rows).
Every contender ends where a trainer starts: the six MaxText fields as global `jax.Array`s over
the process's simulated CPU devices (except the host-only rows: `Plan.batch` and the host
limits); the transfer limit ends there too, from fields read before the clock starts.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psutil

from pipeline.read.batch import FIELDS

PREFIX = "bench-answer "


def cpu_seconds() -> float:
    """User + system CPU of this process (`time.process_time`: nanoseconds, where psutil's
    are 10 ms ticks, and the clock `run` pauses by) and of its children, live or exited."""
    me = psutil.Process()
    times = me.cpu_times()
    total = time.process_time() + times.children_user + times.children_system
    for child in me.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += child_times.user + child_times.system
    return total


def feed_threads() -> int:
    """Live threads of this process's feeds (readers, host-stop watch, verify: all named
    `pipeline-`): a feed left open reads on beside the next contender's run."""
    return sum(thread.name.startswith("pipeline-") for thread in threading.enumerate())


# -- the data: one config for ours, the same stores and weights for Grain ------------------------


def data_config(spec: dict[str, Any], **feed: str):
    """The bench's data config; `feed` overrides its feed options (`verify="off"`: the A/B of
    the block checksums' cost, docs/token-store.md; `expand="device"`: of the on-device
    expansion, docs/benchmarks.md)."""
    from pipeline.config import parse_config

    raw = spec["config"]
    if feed:
        raw = {**raw, "feed": {**raw.get("feed", {}), **feed}}
    return parse_config(raw, origin="bench.yaml")


def mesh():
    """Every device of this process on one `data` axis (all of the job's, in a scale run)."""
    import jax
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()), ("data",))


# -- ours ---------------------------------------------------------------------------------------


def recorded_mixes(ledger, calls: int, step: int):
    """`ledger` with `calls` `set_mix` entries spread evenly over steps [0, step) (`step` >=
    `calls`), each weighting its sources 1:2:3... in a rotating order, as a run that steers
    its mixture every `step // calls` steps records them."""
    from pipeline.plan.ledger import Ledger
    from pipeline.plan.mix_table import MIX_UNIT, MixTable

    names = sorted(ledger.last.config["sources"])
    weights = 1 + (np.arange(calls)[:, None] + np.arange(len(names))) % max(len(names), 2)
    units = weights * MIX_UNIT // weights.sum(axis=1, keepdims=True)  # as `quantize` makes them
    return Ledger(ledger.segments, MixTable(names, np.arange(calls) * (step // calls), units))


class Feed:
    """`DataFeed(config, mesh)` with its defaults: what a JAX user writes; `stats=False` is the
    A/B for the statistics' cost, `verify="off"` for the block checksums', `expand="device"`
    for the on-device expansion's."""

    def __init__(self, spec: dict[str, Any], stats: bool = True, **feed: str) -> None:
        from pipeline.feed.data_feed import DataFeed

        self.spec = spec
        self.mesh = mesh()
        self.iterator = DataFeed(data_config(spec, **feed), self.mesh, stats=stats)
        self.managers: dict[int, Any] = {}

    def __next__(self):
        return next(self.iterator)

    def restore(self, step: int, directory: Path, mixes: int = 0) -> dict[str, float]:
        """Seconds of: a fresh DataFeed, Orbax's restore of its data item, the first batch; and
        the bytes of the data state restored. `mixes`: the checkpoint's ledger records that
        many `set_mix` calls (`recorded_mixes`)."""
        import jax
        import orbax.checkpoint as ocp

        from pipeline.feed.checkpoint import DataRestore, DataSave
        from pipeline.feed.data_feed import DataFeed
        from pipeline.plan.data_state import FILENAME, ITEM

        config = data_config(self.spec)
        where = directory / (f"ours-{step}" + (f"-mixes-{mixes}" if mixes else ""))
        if (step, mixes) not in self.managers:  # the trainer's manager, made once (untimed)
            mngr = ocp.CheckpointManager(where)
            with DataFeed(config, self.mesh, step=step) as feed:
                if mixes:
                    feed.adopt(recorded_mixes(feed.ledger, mixes, step), step)
                mngr.save(step, args=ocp.args.Composite(data=DataSave(feed)))
            mngr.wait_until_finished()
            self.managers[(step, mixes)] = mngr
        mngr = self.managers[(step, mixes)]
        times = {}
        start = time.perf_counter()
        feed = DataFeed(config, self.mesh)
        times["construct"] = time.perf_counter() - start
        mngr.restore(step, args=ocp.args.Composite(data=DataRestore(feed)))
        times["orbax_restore"] = time.perf_counter() - start - times["construct"]
        jax.block_until_ready(next(feed))
        times["total"] = time.perf_counter() - start
        times["first_next"] = times["total"] - times["construct"] - times["orbax_restore"]
        if feed.step != step + 1 or len(feed.ledger.mixes) != mixes:
            raise RuntimeError(
                f"restored feed is at step {feed.step} with {len(feed.ledger.mixes)} set_mix "
                f"calls, expected {step + 1} and {mixes}"
            )
        feed.close()
        times["state_bytes"] = (where / str(step) / ITEM / FILENAME).stat().st_size
        return times

    def close(self) -> None:
        self.iterator.close()
        for mngr in self.managers.values():
            mngr.close()


class MaxText(Feed):
    """`pipeline.maxtext.create_data_iterator(config, mesh)`, as MaxText calls it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import yaml

        from pipeline.maxtext.adapter import create_data_iterator

        self.spec = spec
        self.mesh = mesh()
        self.managers = {}
        path = Path(spec["tmp"]) / "maxtext-data.yaml"
        path.write_text(yaml.safe_dump(spec["config"]))
        devices = self.mesh.devices.size
        config = SimpleNamespace(
            dataset_type="grain",
            per_device_batch_size=spec["config"]["global_batch_size"] / devices,
            max_target_length=spec["config"]["seq_len"],
            data_sharding=[["data"]],
            steps=10**9,
            eval_interval=-1,
            eval_per_device_batch_size=0.0,
            expansion_factor_real_data=-1,
            gradient_accumulation_steps=1,
            enable_data_shuffling=True,
            pipeline_data_config=str(path),
        )
        self.iterator, _ = create_data_iterator(config, self.mesh)


class PlanBatch:
    """`Plan.batch(step, rows)`: the host work alone, no devices (`flat=False`: ArrayRecord)."""

    def __init__(self, spec: dict[str, Any], flat: bool = True) -> None:
        from pipeline.read.plan import Plan
        from pipeline.store.token_store import TokenStore

        plan = Plan.from_config(data_config(spec))
        if not flat:
            plan = Plan(plan.ledger, [TokenStore(s.path, flat=False) for s in plan.stores()])
        self.plan, self.step = plan, 0
        self.rows = np.arange(spec["config"]["global_batch_size"])

    def __next__(self):
        batch = self.plan.batch(self.step, self.rows)
        self.step += 1
        return batch

    def close(self) -> None:
        for store in self.plan.stores():
            store.close()


class FormatLimit(PlanBatch):
    """ArrayRecord reads of exactly the records `Plan.batch` needs for the same steps, and
    nothing else: one `read(list)` per shard (batched) or one `read(i, i + 1)` per record.
    The record lists are computed before the clock starts (`prepare`)."""

    def __init__(self, spec: dict[str, Any], batched: bool) -> None:
        from array_record.python.array_record_module import ArrayRecordReader

        from pipeline.store.token_store import READER_OPTIONS

        super().__init__(spec)
        self.batched = batched
        self.layouts = self.plan.segment_plan(0).layouts
        self.stores = {name: self.plan.store(layout.meta) for name, layout in self.layouts.items()}
        self.readers = {
            name: [
                ArrayRecordReader(str(store.shard_file(s)), READER_OPTIONS)
                for s in range(store.num_shards)
            ]
            for name, store in self.stores.items()
        }
        self.queue: list[list[tuple[Any, list[int]]]] = []

    def prepare(self, steps: int) -> None:
        for _ in range(steps):
            draws = self.plan.draws(self.step + len(self.queue), self.rows)
            needed: dict[tuple[str, int], set[int]] = {}
            for s, epoch, start in zip(draws.source, draws.epoch, draws.start):
                name = draws.source_names[int(s)]
                layout = self.layouts[name]
                for shard, lo, hi in layout.pieces(
                    int(epoch), int(start), int(start) + layout.seq_len + 1
                ):
                    offsets = self.stores[name].record_offsets(shard)
                    first = int(np.searchsorted(offsets, lo, side="right")) - 1
                    last = int(np.searchsorted(offsets, hi, side="left"))
                    needed.setdefault((name, shard), set()).update(range(first, last))
            self.queue.append(
                [(self.readers[n][shard], sorted(r)) for (n, shard), r in needed.items()]
            )

    def __next__(self):
        for reader, records in self.queue.pop(0):
            if self.batched:
                reader.read(records)
            else:
                for record in records:
                    reader.read(record, record + 1)
        self.step += 1


def fresh_copy(host: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """New buffers for `host`'s fields, each field the same view into its copy: `Plan.read`'s
    fields are strided views sharing three [rows, seq_len + 1] buffers, which JAX must copy,
    where contiguous copies might be aliased (a transfer cheaper than the feed's)."""
    copies: dict[int, np.ndarray] = {}
    fresh = {}
    for name, view in host.items():
        base = view if view.base is None else view.base  # the compact form's tokens: their own
        if not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
            raise TypeError(f"field {name} is not a view of a contiguous array")
        if id(base) not in copies:
            copies[id(base)] = base.copy()
        offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        fresh[name] = np.ndarray(view.shape, view.dtype, copies[id(base)], offset, view.strides)
    return fresh


class TransferLimit:
    """The feed's transfer alone: its own call (`_Geometry.to_global`, what its reader threads
    run), sharding and local rows, on one step's six fields from `Plan.batch`, read once. What
    any loader ending in these global arrays pays per step, whatever its host work.

    `form`: of the compact form instead (`Plan.read_compact`: tokens + boundaries): `compact`
    its transfer alone (`Geometry.place`), `expanded` that and the on-device expansion
    (`expand.to_global`, what `feed: {expand: device}` runs).

    The feed transfers fresh arrays every step (`Plan.read` allocates them), so each step here
    transfers a fresh copy (`fresh_copy`), never the same arrays again. The copies are made
    with the clock paused (`prepare`, like FormatLimit's record lists), since in the feed that
    writing is `Plan.read`'s work; made ahead, they are colder in cache than the feed's
    just-written arrays, so the row errs dear, not cheap. The previous step's arrays are
    dropped when the next ones arrive, as in a trainer (`run`)."""

    def __init__(self, spec: dict[str, Any], form: str = "six") -> None:
        from pipeline.feed import expand
        from pipeline.feed.data_feed import DataFeed

        with DataFeed(data_config(spec), mesh()) as feed:
            self.geometry = feed._geometry_at(0)
            draws = feed.plan.draws(0, self.geometry.rows)
            self.host = feed.plan.read(draws) if form == "six" else feed.plan.read_compact(draws)
        places = {"six": self.geometry.to_global, "compact": self._compact,
                  "expanded": partial(expand.to_global, self.geometry)}  # fmt: skip
        self.place = places[form]
        self.queue: list[dict[str, np.ndarray]] = []

    def prepare(self, steps: int) -> None:
        self.queue += [fresh_copy(self.host) for _ in range(steps)]

    def __next__(self):
        return self.place(self.queue.pop(0))

    def _compact(self, host: dict[str, np.ndarray]) -> dict[str, Any]:
        """The compact form's global arrays (no `inputs`: `run` counts the step's tokens)."""
        return dict(zip(host, self.geometry.place(list(host.values()), [])[0]))

    def close(self) -> None:
        pass


class CopyLimit:
    """`np.copyto` of as many token bytes as a batch holds, between two buffers."""

    def __init__(self, spec: dict[str, Any]) -> None:
        size = spec["config"]["global_batch_size"] * (spec["config"]["seq_len"] + 1)
        self.src = np.ones(size, np.dtype(spec["itemsize_dtype"]))
        self.dst = np.empty_like(self.src)

    def __next__(self):
        np.copyto(self.dst, self.src)

    def close(self) -> None:
        pass


# -- Grain --------------------------------------------------------------------------------------


class Decode:
    """Record bytes -> int32 tokens (a class, so that `mp_prefetch` workers can unpickle it)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = np.dtype(dtype)

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        return {"tokens": np.frombuffer(record, dtype=self.dtype).astype(np.int32)}


class Fields:
    """Packed [rows, seq_len + 1] tokens -> the six MaxText fields; a document starts after
    every eod (what a MaxText user derives from eod-separated packing), built by the same
    `pipeline.read.batch.fields` our rows use, so both sides do the same host work here."""

    def __init__(self, eod: int) -> None:
        self.eod = eod

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from pipeline.read.batch import fields

        tokens = batch["tokens"]
        rows, cols = np.nonzero(tokens[:, :-1] == self.eod)
        return fields(tokens, rows, cols + 1)


def grain_dataset(spec: dict[str, Any]):
    """ArrayRecordDataSource per store -> shuffle -> repeat -> [mix] -> decode ->
    to_iter_dataset(ReadOptions) -> ConcatThenSplit -> batch -> fields [-> mp_prefetch]."""
    import grain
    from grain.experimental import ConcatThenSplitIterDataset

    from pipeline.store.token_store import TokenStore

    parts, weights = [], []
    for name, source in sorted(spec["config"]["sources"].items()):
        store = TokenStore(source["path"])
        files = [str(store.shard_file(s)) for s in range(store.num_shards)]
        ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
        parts.append(ds.shuffle(seed=1).repeat().map(Decode(store.dtype.name)))
        weights.append(spec["config"]["mix"][name])
        eod = store.eod_id
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
    options = spec["grain"]
    read = grain.ReadOptions(num_threads=options["threads"], prefetch_buffer_size=options["buffer"])
    seq_len, rows = spec["config"]["seq_len"], spec["config"]["global_batch_size"]
    it = ConcatThenSplitIterDataset(ds.to_iter_dataset(read), length_struct={"tokens": seq_len + 1})
    return in_workers(it.batch(rows).map(Fields(eod)), options["workers"])


def in_workers(it, workers: int):
    """`it` read ahead in `workers` Grain `mp_prefetch` processes (0: `it` itself)."""
    if not workers:
        return it
    import grain
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # Grain's workers read absl flags; no absl app here
    return it.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))


class Grain:
    """Grain's packed pipeline, then the same global arrays as ours (one call for six fields)."""

    build = staticmethod(grain_dataset)  # spec -> the dataset; the packed-SFT rows' differs

    def __init__(self, spec: dict[str, Any]) -> None:
        from jax.sharding import NamedSharding, PartitionSpec

        self.spec = spec
        self.dataset = self.build(spec)
        self.iterator = iter(self.dataset)
        sharding = NamedSharding(mesh(), PartitionSpec("data", None))
        shape = (spec["config"]["global_batch_size"], spec["config"]["seq_len"])
        self.shardings = dict.fromkeys(FIELDS, sharding)
        self.shapes = dict.fromkeys(FIELDS, shape)

    def to_global(self, batch: dict[str, np.ndarray]):
        import jax

        return jax.make_array_from_process_local_data(self.shardings, batch, self.shapes)

    def __next__(self):
        return self.to_global(next(self.iterator))

    def restore(self, step: int, directory: Path) -> dict[str, float]:
        """A fresh dataset and iterator, `set_state` to step `step`, the first global batch.

        Grain's state k batches in cannot be reached by iterating, so it is built from a real
        `get_state()` template: `next_index` = the documents k batches consume on average
        (k * rows * (seq_len + 1) / mean document length), an empty packing remainder. That
        is a valid state at a packing boundary, so `set_state` replays nothing.
        """
        import jax

        template = iter(self.dataset).get_state()
        state = json.loads(json.dumps(template))
        state["parent_state"]["next_index"] = round(step * self.spec["docs_per_batch"])
        state["remainder_slices"] = template["remainder_slices"]  # keep the tuples
        start = time.perf_counter()
        iterator = iter(self.build(self.spec))  # a restarted job builds its pipeline anew
        iterator.set_state(state)
        jax.block_until_ready(self.to_global(next(iterator)))
        seconds = time.perf_counter() - start
        iterator.close()  # its prefetch would run on beside the next restores
        return {"total": seconds}

    def close(self) -> None:
        """Close the iterator, then collect it: `close` stops Grain's prefetch (its worker
        processes too) but leaves the elements it already took in a reference cycle, whose
        shared memory (`mp_prefetch`'s batches) only their deletion unlinks, and Grain deletes
        them in a thread pool that exit stops: the resource tracker would find them leaked."""
        import gc

        self.iterator.close()
        del self.iterator
        try:  # Grain's internals: no public way to wait for its unlinks
            from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

            pool = SharedMemoryArray._del_thread_pool
            SharedMemoryArray._disable_async_del()  # unlink in this thread from here on
        except (ImportError, AttributeError):  # another Grain: at worst the exit warning
            pool = None
        gc.collect()
        if pool is not None:  # and wait for the unlinks already handed to the pool
            pool.close()
            pool.join()


class SftSplit:
    """A document's record -> inputs / targets truncated to seq_len (picklable for workers)."""

    def __init__(self, dtype: str, seq_len: int) -> None:
        self.dtype, self.seq_len = np.dtype(dtype), seq_len

    def __call__(self, record: bytes) -> dict[str, np.ndarray]:
        tokens = np.frombuffer(record, dtype=self.dtype).astype(np.int32)[: self.seq_len + 1]
        return {"inputs": tokens[:-1], "targets": tokens[1:]}


class PackedFields:
    """Grain's packer keys -> the six MaxText fields (as MaxText's Grain pipeline renames)."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        renamed = {"inputs_segment_ids": "inputs_segmentation", "inputs_positions":
                   "inputs_position", "targets_segment_ids": "targets_segmentation",
                   "targets_positions": "targets_position"}  # fmt: skip
        return {renamed.get(key, key): value for key, value in batch.items()}


def grain_sft_dataset(spec: dict[str, Any]):
    """One record per document -> shuffle -> repeat -> split -> to_iter_dataset(ReadOptions) ->
    First/BestFitPack (bins = rows, as MaxText sets it) -> batch -> fields [-> mp_prefetch]."""
    import grain
    import grain.experimental as gx

    from pipeline.store.token_store import TokenStore

    (source,) = spec["config"]["sources"].values()
    store = TokenStore(source["path"])
    options, seq_len = spec["grain"], spec["config"]["seq_len"]
    rows = spec["config"]["global_batch_size"]
    files = [str(store.shard_file(s)) for s in range(store.num_shards)]
    ds = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(files))
    ds = ds.shuffle(seed=1).repeat().map(SftSplit(store.dtype.name, seq_len))
    read = grain.ReadOptions(num_threads=options["threads"], prefetch_buffer_size=options["buffer"])
    pack = {"first_fit": gx.FirstFitPackIterDataset, "best_fit": gx.BestFitPackIterDataset}
    it = pack[options["packer"]](ds.to_iter_dataset(read), num_packing_bins=rows,
                                 length_struct={"inputs": seq_len, "targets": seq_len})  # fmt: skip
    return in_workers(it.batch(rows).map(PackedFields()), options["workers"])


class GrainSft(Grain):
    """Grain's packer -> the same global arrays."""

    build = staticmethod(grain_sft_dataset)


def grain_view_dataset(spec: dict[str, Any]):
    """Our plan's rows through Grain (docs/jax-integration.md, "Using the Grain view"):
    `host_dataset(plan)` -> `.batch(rows)` -> `to_iter_dataset()` -> `mp_prefetch`."""
    from pipeline.feed.grain_source import host_dataset
    from pipeline.read.plan import Plan

    plan = Plan.from_config(data_config(spec))
    rows = spec["config"]["global_batch_size"]
    return in_workers(host_dataset(plan).batch(rows).to_iter_dataset(), spec["grain"]["workers"])


class GrainView(Grain):
    """The Grain view of our plan -> the same global arrays (Grain's, as its other rows)."""

    build = staticmethod(grain_view_dataset)


KINDS = {
    "feed": Feed,
    "feed_nostats": lambda spec: Feed(spec, stats=False),
    "feed_unchecked": lambda spec: Feed(spec, verify="off"),
    "feed_device": lambda spec: Feed(spec, expand="device"),
    "maxtext": MaxText,
    "plan": PlanBatch,
    "plan_arrayrecord": lambda spec: PlanBatch(spec, flat=False),
    "format_per_record": lambda spec: FormatLimit(spec, batched=False),
    "format_batched": lambda spec: FormatLimit(spec, batched=True),
    "copy": CopyLimit,
    "transfer": TransferLimit,
    "transfer_compact": lambda spec: TransferLimit(spec, "compact"),
    "transfer_expanded": lambda spec: TransferLimit(spec, "expanded"),
    "grain": Grain,
    "grain_sft": GrainSft,
    "grain_view": GrainView,
}


# -- the worker loop ----------------------------------------------------------------------------


def run(
    contender,
    steps: int,
    pace: float,
    tokens_per_step: int,
    processes: int,
    seconds: float = 0.0,
) -> dict[str, float]:
    """At least `steps` batches, and more until `seconds` have passed. A limit contender's
    inputs (record lists, fresh fields) are made in batches of `steps` with the clock paused:
    their wall time is left out, their CPU (`paused_cpu`, by `time.process_time`: `prepare`
    starts no children, and psutil's ~1.3 ms per call would leak into the row) answered apart."""
    import jax

    inside = inside_cpu = paused = paused_cpu = 0.0
    threads = feed_threads()
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    batch, tokens, done = None, 0, 0
    while done < steps or time.perf_counter() - start - paused < seconds:
        if getattr(contender, "queue", None) == []:
            before, before_cpu = time.perf_counter(), time.process_time()
            contender.prepare(steps)
            paused += time.perf_counter() - before
            paused_cpu += time.process_time() - before_cpu
        done += 1
        before, before_cpu = time.perf_counter(), time.thread_time()
        batch = next(contender)
        inside += time.perf_counter() - before
        inside_cpu += time.thread_time() - before_cpu
        # a process's share of the global arrays' tokens; the host limits and the compact
        # transfer make no six fields
        counted = batch is None or "inputs" not in batch
        tokens += tokens_per_step if counted else batch["inputs"].size // processes
        if pace:
            time.sleep(pace)
    jax.block_until_ready(batch)
    wall = time.perf_counter() - start - paused
    return {
        "steps": done,
        "wall": wall,
        "next": inside,
        "next_cpu": inside_cpu,
        "tokens": tokens,
        "cpu_start": cpu_start,
        "cpu_end": cpu_seconds(),
        "paused_cpu": paused_cpu,
        "feed_threads": threads,
    }


def padding(contender, steps: int) -> float:
    """The share of padding slots (input segment id 0) in `steps` more batches of a
    single-process contender, counted from the global arrays it serves: apart from the timed
    rounds, so that counting costs no row. Grain's packers give inputs and targets the same
    segment ids."""
    slots = padded = 0
    for _ in range(steps):
        segments = np.asarray(next(contender)["inputs_segmentation"])
        slots += segments.size
        padded += int((segments == 0).sum())
    return padded / slots


def answer(value: dict[str, Any]) -> None:
    """One answer line; libraries may print other lines to stdout, the driver skips them."""
    print(PREFIX + json.dumps(value), flush=True)


def serve(spec: dict[str, Any], contenders: dict[str, Any]) -> None:
    """Warm every contender up, answer ready, then answer stdin's commands until quit."""
    processes = spec.get("processes", 1)
    tokens_per_step = spec["config"]["global_batch_size"] // processes * spec["config"]["seq_len"]
    for contender in contenders.values():
        run(contender, 1, 0.0, tokens_per_step, processes)  # open files, start threads
    answer({"ready": True})
    with tempfile.TemporaryDirectory() as tmp:
        for line in sys.stdin:
            command = json.loads(line)
            if "quit" in command:
                break
            if "close" in command:
                contenders.pop(command["close"]).close()
                answer({"closed": command["close"]})
                continue
            if "padding" in command:
                contender = contenders[command["padding"]]
                result = {"padding": padding(contender, command["steps"])}
            elif "restore" in command:
                contender = contenders[command["name"]]
                mixes = {"mixes": command["mixes"]} if "mixes" in command else {}  # ours only
                contender.restore(command["restore"], Path(tmp), **mixes)  # warm: files, caches
                result = contender.restore(command["restore"], Path(tmp), **mixes)
            else:
                contender = contenders[command["run"]]
                steps, pace, seconds = command["steps"], command["pace"], command.get("seconds", 0)
                result = run(contender, steps, pace, tokens_per_step, processes, seconds)
            result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            answer(result)


def main() -> None:
    # A contender runs free, so every feed step is input-bound by design: the feed's warning
    # about it (every 100 steps) would flood the bench's output. Errors still print.
    logging.getLogger("pipeline").setLevel(logging.ERROR)
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("processes", 1) > 1:
        import jax

        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{spec['port']}",
            num_processes=spec["processes"],
            process_id=spec["process_id"],
            initialization_timeout=120,
        )
    contenders: dict[str, Any] = {}
    try:
        for name, kind in spec["contenders"].items():
            contenders[name] = KINDS[kind](spec)
        serve(spec, contenders)
    finally:  # on an error too: Grain's mp_prefetch processes and shared memory, our threads
        for contender in contenders.values():
            contender.close()
    if spec.get("processes", 1) > 1:
        import jax

        jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
