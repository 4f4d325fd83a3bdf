"""One process of a localhost multi-process JAX job, driven by tests/test_multihost.py.

    python -m tests.multihost_worker SPEC.json PROCESS_ID

SPEC holds the coordinator port, the process count, the data config (a parse_config mapping)
and a list of tasks:

* {"kind": "checksums", "name", "mesh": [shape, names], "batch_axes", "steps"}: feed the steps,
  reduce each global batch to per-row checksums in a jitted function, gather them and the
  fields (with the config's `feed.provenance` fields); process 0 writes OUT/<name>.npz.
  With `"stats": true`, every process writes its last `FeedStats` to OUT/<name>-stats-<id>.json;
  with `"config"` (a config mapping), the task feeds that config instead of the spec's. Steps
  that follow each other are fed without a seek; every process writes the most file
  descriptors it held after a step, and its bound on open shards, to OUT/<name>-files-<id>.json.
* {"kind": "open", "missing_on": P}: process P's config names a store that does not exist;
  every process tries to build a feed and writes the error it got to OUT/open-<id>.txt.
* {"kind": "disagree", "odd_one": P, "skip": bool, "name"}: every process restores a data
  state, process P a state one step ahead of the others' (with "skip": the same state, skipping
  3 steps); each writes the error it got to OUT/<name, default disagree>-<id>.txt.
* {"kind": "train", "ckpt", "log", "steps", "save_every", "kill_at", "kill_mode"}: a train-like
  loop that restores the latest complete checkpoint (model state + data state), consumes the
  feed, saves asynchronously every `save_every` steps, and process 0 appends one line per step
  (step, per-row checksums, model value) to `log`. With `kill_at`, every process SIGKILLs itself
  at that step, either after logging it ("step") or right after starting a save ("save").
  With `skip_steps`, its restore skips that many steps; with `config` (a config mapping), the
  feed follows that config instead of the spec's; with `switch_to` (a config mapping), the feed
  follows that config and its restore declares the switch; with `mix_every`, it calls
  `feed.set_mix(mix_weights(step), step)` at every multiple of it (process `mix_odd_one`, if
  given, with the weights of step + 1).
* {"kind": "stop", "fault": "replace" | "read" | "verify", "faulty": P, "out"}: train until
  the feed stops. After 3 steps every process writes OUT/ready-<id> and waits for OUT/go (the
  test replaces the store in between, "replace"); with "read", process P's ArrayRecord reads
  fail from then on (a persistent fault: every retry fails too); with "verify", the test
  damaged P's share of the store before the launch, for the config's background verification
  to find. A PipelineError is printed as the CLI prints it, "error: <line>", exit status 2.
* {"kind": "straggle", "slow": P, "delay", "first_delay", "steps"}: process P's reader tasks
  sleep `delay` seconds each (`first_delay` for its first step); every process trains `steps`
  steps in lockstep (a collective each), logging at INFO, and writes its last `FeedStats` to
  OUT/straggle-<id>.json. A PipelineError exits as in "stop".
* {"kind": "rpcs", "steps", "warmup", "pace"}: every process counts the key-value calls it
  makes to JAX's coordination service (`CountingClient` in place of the client), opens two
  feeds (a training feed and a second one, stepped every other step, as an eval feed is),
  trains `steps` steps in lockstep (a collective each, then a `pace` s sleep) and writes the
  calls (method, key, thread, time), the steady part's start and end (after `warmup` steps) and
  the time each steady `next()` of the training feed took to OUT/rpcs-<id>.json.
* {"kind": "maxtext", "data_yaml", "ckpt", "steps"}: MaxText's adapter on a ('data', 'fsdp') mesh
  of every device: `steps` batches, then the `iter` item saved as MaxText versions before the
  shared-state path do (Grain's PyGrainCheckpointHandler: one file per process) at checkpoint
  `steps - 1` (MaxText saves checkpoint s after training step s).

A spec's `"nofile": N` sets the process's open-file limits, soft and hard, to N at its start.

Run with JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=K.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from array_record.python.array_record_module import ArrayRecordReader
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pipeline.store.shard_readers as shard_readers
from pipeline.config import parse_config
from pipeline.errors import PipelineError
from pipeline.feed.checkpoint import DataRestore, DataSave
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.restore import current_state, restore_state
from pipeline.plan.ledger import Ledger
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store.open_shards import pool as open_shards_pool
from tests.gcs_emulator import ENDPOINTS, point_at


def row_checksums(batch: dict[str, jax.Array]) -> jax.Array:
    """Per-row sum of every field weighted by (position + 1) and (field index + 1)."""
    total = 0
    for index, field in enumerate(FIELDS):
        values = batch[field].astype(jnp.int32)
        weights = jnp.arange(1, values.shape[-1] + 1, dtype=jnp.int32) * (index + 1)
        total = total + (values * weights).sum(-1)
    return total


def make_mesh(shape: list[int], names: list[str]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), tuple(names))


def gather(array: jax.Array) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def checksums(spec: dict, config, task: dict, out: Path) -> None:
    if task.get("config"):  # this task's own config, in place of the spec's
        config = parse_config(task["config"], origin="multihost.yaml")
    if task.get("ledger"):  # or the plan of a ledger (a DataFeed takes either)
        config = Plan(Ledger.from_json(task["ledger"]))
    mesh = make_mesh(*task["mesh"])
    checksum = jax.jit(row_checksums)
    result: dict[str, np.ndarray] = {}
    most_files = 0
    with DataFeed(config, mesh, tuple(task["batch_axes"]), prefetch=2, threads=2) as feed:
        for step in task["steps"]:
            if step != feed.step:
                feed.seek(step)
            batch = next(feed)
            most_files = max(most_files, len(os.listdir("/proc/self/fd")))
            result[f"checksum_{step}"] = gather(checksum(batch))
            for field in (*FIELDS, *feed.provenance, "loss_weights"):
                if field in batch:  # loss_weights: with an objective
                    result[f"{field}_{step}"] = gather(batch[field])
        if task.get("stats"):
            stats = json.dumps(feed.stats().to_json())
            (out / f"{task['name']}-stats-{jax.process_index()}.json").write_text(stats)
    files = {"most": most_files, "bound": open_shards_pool().limit}
    (out / f"{task['name']}-files-{jax.process_index()}.json").write_text(json.dumps(files))
    if jax.process_index() == 0:
        np.savez(out / f"{task['name']}.npz", **result)


def open_feed(spec: dict, task: dict, out: Path) -> None:
    raw = json.loads(json.dumps(spec["config"]))
    if jax.process_index() == task["missing_on"]:
        first = sorted(raw["sources"])[0]
        raw["sources"][first]["path"] = str(out / "no-such-store")
    mesh = make_mesh([jax.device_count()], ["data"])
    try:
        DataFeed(parse_config(raw, origin="multihost.yaml"), mesh).close()
        message = "no error"
    except PipelineError as error:
        message = f"{type(error).__name__}: {error}"
    (out / f"open-{jax.process_index()}.txt").write_text(message)


def disagree(config, task: dict, out: Path) -> None:
    mesh = make_mesh([jax.device_count()], ["data"])
    with DataFeed(config, mesh) as feed:
        state, skip = current_state(feed), 0
        if jax.process_index() == task["odd_one"]:
            if task.get("skip"):
                skip = 3
            else:
                state = dataclasses.replace(state, step=state.step + 1)
        try:
            restore_state(
                feed, dataclasses.replace(state, origin="data_state.json"), skip_steps=skip
            )
            message = "no error"
        except PipelineError as error:
            message = f"{type(error).__name__}: {error}"
    (out / f"{task.get('name', 'disagree')}-{jax.process_index()}.txt").write_text(message)


def train(spec: dict, config, task: dict) -> None:
    mesh = make_mesh([jax.device_count()], ["data"])
    replicated = NamedSharding(mesh, PartitionSpec())
    checksum = jax.jit(row_checksums)

    @jax.jit
    def step_fn(w, batch):
        sums = checksum(batch)
        return w + (sums.sum() % 9973).astype(jnp.float32), sums

    options = ocp.CheckpointManagerOptions(
        save_interval_steps=task["save_every"], enable_async_checkpointing=True
    )
    log = Path(task["log"])
    if task.get("switch_to"):
        config = parse_config(task["switch_to"], origin="switched.yaml")
    elif task.get("config"):
        config = parse_config(task["config"], origin="multihost.yaml")
    with (
        DataFeed(config, mesh) as feed,
        ocp.CheckpointManager(task["ckpt"], options=options) as mngr,
    ):
        w = jax.device_put(jnp.zeros((), jnp.float32), replicated)
        latest = mngr.latest_step()
        if latest is not None:
            abstract = jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated)
            restored = mngr.restore(
                latest,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore({"w": abstract}),
                    data=DataRestore(
                        feed,
                        saved_after_step=True,
                        skip_steps=task.get("skip_steps", 0),
                        switch=bool(task.get("switch_to")),
                    ),
                ),
            )
            w = restored["state"]["w"]
        while feed.step < task["steps"]:
            step = feed.step
            if task.get("mix_every") and step % task["mix_every"] == 0:
                odd = task.get("mix_odd_one") == jax.process_index()
                feed.set_mix(mix_weights(step + odd), step=step)
            batch = next(feed)
            w, sums = step_fn(w, batch)
            sums = gather(sums)
            if jax.process_index() == 0:
                line = {"step": step, "sums": sums.tolist(), "w": float(w), "procs": spec["n"]}
                with open(log, "a") as f:
                    f.write(json.dumps(line) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            # The checkpoint labelled `step` holds the state after training on step `step`;
            # its data state's step is step + 1, the next batch to train on.
            saving = mngr.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave({"w": w}), data=DataSave(feed)),
            )
            if task.get("kill_at") == step and (task["kill_mode"] == "step" or saving):
                multihost_utils.sync_global_devices(f"kill {step}")
                os.kill(os.getpid(), signal.SIGKILL)
        mngr.wait_until_finished()


def mix_weights(step: int) -> dict[str, float]:
    """The weights the train task sets (`mix_every`): a fixed function of the step."""
    return {"code": 1.0 + step % 3, "docs": 0.5 + 0.25 * (step % 2)}


class FailingReader:
    """A real ArrayRecord reader whose reads fail once `FAILING` is set (a persistent fault)."""

    FAILING = threading.Event()

    def __init__(self, path: str, options: str) -> None:
        self.real = ArrayRecordReader(path, options)

    def read(self, *args):
        if self.FAILING.is_set():
            raise RuntimeError("UNAVAILABLE: injected persistent fault")
        return self.real.read(*args)

    def num_records(self) -> int:
        return self.real.num_records()

    def close(self) -> None:
        self.real.close()


def stop(config, task: dict, out: Path) -> None:
    mesh = make_mesh([jax.device_count()], ["data"])
    faulty = task["fault"] == "read" and jax.process_index() == task["faulty"]
    if faulty:
        shard_readers.ArrayRecordReader = FailingReader
    total = jax.jit(lambda batch: row_checksums(batch).sum())  # a cross-process reduction
    with DataFeed(config, mesh) as feed:
        for step in range(100_000):
            float(total(next(feed)))  # waits for every process's rows
            if step == 2:
                (out / f"ready-{jax.process_index()}").touch()
                while not (out / "go").exists():
                    time.sleep(0.05)
                if faulty:
                    FailingReader.FAILING.set()


def straggle(config, task: dict, out: Path) -> None:
    import logging

    from pipeline.read.plan import Plan

    logging.basicConfig(level=logging.INFO, format="%(message)s", force=True)
    if jax.process_index() == task["slow"]:
        read, delays = Plan.read, [task["first_delay"]]

        def slow_read(plan, *args, **kwargs):  # inside the reader task's timing
            time.sleep(delays.pop() if delays else task["delay"])
            return read(plan, *args, **kwargs)

        Plan.read = slow_read
    mesh = make_mesh([jax.device_count()], ["data"])
    checksum = jax.jit(row_checksums)
    with DataFeed(config, mesh, prefetch=1, threads=1) as feed:
        for _ in range(task["steps"]):
            gather(checksum(next(feed)))  # every host waits for the slowest, as in training
        stats = feed.stats().to_json()
    (out / f"straggle-{jax.process_index()}.json").write_text(json.dumps(stats))


class CountingClient:
    """JAX's coordination client, forwarding every call and recording each key-value one as
    (method, key, calling thread's name, `time.monotonic()`)."""

    COUNTED = frozenset(
        f"{kind}{suffix}"
        for kind in ("key_value_set", "key_value_dir_get", "key_value_try_get",
                     "blocking_key_value_get")
        for suffix in ("", "_bytes")
    ) | {"key_value_delete", "key_value_increment", "wait_at_barrier"}  # fmt: skip

    def __init__(self, real) -> None:
        self.real = real
        self.calls: list[tuple[str, str, str, float]] = []

    def __getattr__(self, name: str):
        method = getattr(self.real, name)
        if name not in self.COUNTED:
            return method

        def counted(key, *args, **kwargs):
            self.calls.append((name, key, threading.current_thread().name, time.monotonic()))
            return method(key, *args, **kwargs)

        return counted


def rpcs(config, task: dict, out: Path) -> None:
    from jax._src import distributed

    mesh = make_mesh([jax.device_count()], ["data"])  # the backend takes the real client
    client = distributed.global_state.client = CountingClient(distributed.global_state.client)
    total = jax.jit(lambda batch: row_checksums(batch).sum())  # a cross-process reduction
    waits, start = [], None
    with DataFeed(config, mesh) as train, DataFeed(config, mesh, log_events=False) as other:
        for step in range(task["steps"]):
            if step == task["warmup"]:
                start = time.monotonic()
            entered = time.perf_counter()
            batch = next(train)
            if start is not None:
                waits.append(time.perf_counter() - entered)
            float(total(batch))
            if step % 2 == 0:
                float(total(next(other)))
            time.sleep(task["pace"])
        end = time.monotonic()
    result = {"calls": client.calls, "start": start, "end": end, "waits": waits}
    (out / f"rpcs-{jax.process_index()}.json").write_text(json.dumps(result))
    distributed.global_state.client = client.real


def maxtext(task: dict) -> None:
    import grain.python as grain

    from pipeline.maxtext.adapter import create_data_iterator
    from tests.test_maxtext import maxtext_config

    devices = np.array(jax.devices()).reshape(2, -1)
    config = maxtext_config(Path(task["data_yaml"]), eval_interval=-1)
    train, _ = create_data_iterator(config, Mesh(devices, ("data", "fsdp")))
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    handlers = {"iter": grain.PyGrainCheckpointHandler()}
    try:
        with ocp.CheckpointManager(task["ckpt"], options=options, item_handlers=handlers) as mngr:
            for _ in range(task["steps"]):
                next(train)
            save = grain.PyGrainCheckpointSave(train.local_iterator)
            # MaxText's numbering: checkpoint s is saved after training step s
            mngr.save(task["steps"] - 1, args=ocp.args.Composite(iter=save))
    finally:
        train.close()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    process_id = int(sys.argv[2])
    if spec.get("nofile"):  # hard too: the pool's raise of the soft limit cannot undo it
        resource.setrlimit(resource.RLIMIT_NOFILE, (spec["nofile"], spec["nofile"]))
    if ENDPOINTS in os.environ:  # a Cloud Storage emulator port per process (tests/gcs_emulator.py)
        point_at(os.environ[ENDPOINTS].split(",")[process_id])
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{spec['port']}",
        num_processes=spec["n"],
        process_id=process_id,
        initialization_timeout=60,
    )
    config = parse_config(spec["config"], origin="multihost.yaml")
    out = Path(spec["out"])
    for task in spec["tasks"]:
        if task["kind"] == "checksums":
            checksums(spec, config, task, out)
        elif task["kind"] == "open":
            open_feed(spec, task, out)
        elif task["kind"] == "disagree":
            disagree(config, task, out)
        elif task["kind"] == "maxtext":
            maxtext(task)
        elif task["kind"] == "rpcs":
            rpcs(config, task, out)
        elif task["kind"] in ("stop", "straggle"):
            try:
                (stop if task["kind"] == "stop" else straggle)(config, task, out)
            except PipelineError as error:
                print(f"error: {error}", file=sys.stderr, flush=True)
                sys.exit(error.exit_code)
        else:
            train(spec, config, task)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
