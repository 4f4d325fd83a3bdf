"""A candidate for batch assembly off the training process's interpreter lock, measured against
`DataFeed`: a producer process that reads each step's rows into shared memory.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/producer_ab.py --store python-code --rounds 5

The producer (a spawned process) opens the same plan and, for steps 0, 1, ... in order (the plan
is known, so it runs ahead without coordination), reads the six fields (`Plan.read`) into a free
slot of a ring of `SLOTS` in one `multiprocessing.shared_memory` block and sends the slot's
number down a pipe. In the training process a reader thread transfers each slot's fields
(`Geometry.to_global`, the feed's own transfer, on numpy views of the slot: no copy on the host)
and queues the arrays; `next()` takes them from the queue and hands the slot of the step before
back (on CPU devices `device_put` aliases the host buffer: a slot is free only once the trainer
dropped the arrays made from it, as `next()` assumes here). Against `DataFeed(config, mesh)` in
the same rounds, alternating: CPU per step of the training process (free-running, `--steps`), of
the producer (what it reports), the training thread's CPU per `next()` and its wall time with a
`--pace-ms` step between calls. The first steps' arrays are compared with `Plan.read`'s, so a
transfer that aliased a slot reused later would show. A benchmark, not a feed: no seek,
`set_mix`, switch or restore.
"""

from __future__ import annotations

import argparse
import multiprocessing
import queue
import statistics
import sys
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # benchmarks/bench.py, beside this file

SLOTS = 4  # the producer's ring: one being read, two transferred ahead, one the trainer's
FIELD_COUNT = 6


def produce(config: dict, rows: list[int], name: str, steps: int, pipe) -> None:
    """The producer process: steps 0..steps-1 into the ring, then its CPU seconds."""
    from pipeline.config import parse_config
    from pipeline.read.batch import FIELDS
    from pipeline.read.plan import Plan

    plan = Plan.from_config(parse_config(config, origin="producer_ab"))
    memory = shared_memory.SharedMemory(name)
    shape = (SLOTS, FIELD_COUNT, len(rows), config["seq_len"])
    ring = np.ndarray(shape, np.int32, buffer=memory.buf)
    start = time.process_time()
    for step in range(steps):
        slot = pipe.recv()  # a free slot
        host = plan.read(plan.draws(step, np.asarray(rows)))
        for k, field in enumerate(FIELDS):
            np.copyto(ring[slot, k], host[field])
        pipe.send((step, slot))
    pipe.send(time.process_time() - start)
    del ring
    memory.close()


class Producer:
    """The training process's side: the ring, the producer and one transfer thread."""

    def __init__(self, config: dict, geometry, steps: int) -> None:
        self.geometry, self.seq_len = geometry, config["seq_len"]
        rows = geometry.rows.tolist()
        shape = (SLOTS, FIELD_COUNT, len(rows), self.seq_len)
        self.memory = shared_memory.SharedMemory(create=True, size=int(np.prod(shape)) * 4)
        self.ring = np.ndarray(shape, np.int32, buffer=self.memory.buf)
        self.pipe, theirs = multiprocessing.Pipe()
        spawn = multiprocessing.get_context("spawn")
        args = (config, rows, self.memory.name, steps, theirs)
        self.process = spawn.Process(target=produce, args=args, daemon=True)
        self.process.start()
        self.ready: queue.Queue = queue.Queue(maxsize=2)
        self.steps, self.producer_cpu = steps, 0.0
        for slot in range(SLOTS):
            self.pipe.send(slot)
        self.held: int | None = None  # the slot of the arrays `next()` last returned
        self.owed = steps - SLOTS  # slots the producer still waits for (then it stops)
        self.thread = threading.Thread(target=self._transfer, daemon=True)
        self.thread.start()

    def _transfer(self) -> None:
        import jax

        from pipeline.read.batch import FIELDS

        for _ in range(self.steps):
            _, slot = self.pipe.recv()
            arrays = self.geometry.to_global(dict(zip(FIELDS, self.ring[slot])))
            self.ready.put((slot, jax.block_until_ready(arrays)))
        self.producer_cpu = self.pipe.recv()

    def __next__(self) -> dict:
        slot, arrays = self.ready.get(timeout=120)
        if self.held is not None and self.owed > 0:  # the trainer is done with the step before
            self.pipe.send(self.held)
            self.owed -= 1
        self.held = slot
        return arrays

    def close(self) -> None:
        self.thread.join(timeout=120)
        self.process.join(timeout=120)
        del self.ring
        self.memory.close()
        self.memory.unlink()


def run(name: str, config: dict, mesh, geometry, args) -> dict[str, float]:
    """One round of one variant: free-running, then paced."""
    import jax

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed

    total = 20 + args.steps + args.paced
    feed = (
        Producer(config, geometry, total)
        if name == "producer"
        else DataFeed(parse_config(config, origin="producer_ab"), mesh, log_events=False)
    )
    for _ in range(20):
        batch = next(feed)
    jax.block_until_ready(batch)
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(args.steps):
        batch = next(feed)
    jax.block_until_ready(batch)
    result = {
        "training process CPU ms per step": (time.process_time() - cpu) / args.steps * 1e3,
        "wall ms per step": (time.perf_counter() - wall) / args.steps * 1e3,
    }
    walls, threads = [], []
    for _ in range(args.paced):
        time.sleep(args.pace_ms / 1e3)
        start, thread = time.perf_counter(), time.thread_time()
        batch = next(feed)
        threads.append(time.thread_time() - thread)
        walls.append(time.perf_counter() - start)
    jax.block_until_ready(batch)
    result["paced next() wall ms"] = statistics.median(walls) * 1e3
    result["paced next() thread CPU ms"] = statistics.median(threads) * 1e3
    feed.close()
    if name == "producer":  # its CPU over all its steps, per step
        result["producer CPU ms per step"] = feed.producer_cpu / total * 1e3
    return result


def check(config: dict, geometry) -> None:
    """The producer's first steps equal `Plan.read`'s (nothing aliased a reused slot)."""
    import jax

    from pipeline.config import parse_config
    from pipeline.read.batch import FIELDS
    from pipeline.read.plan import Plan

    plan = Plan.from_config(parse_config(config, origin="producer_ab"))
    steps = 2 * SLOTS + 2
    producer = Producer(config, geometry, steps)
    got = [jax.device_get(next(producer)) for _ in range(steps)]
    producer.close()
    for step, arrays in enumerate(got):
        want = plan.read(plan.draws(step, geometry.rows))
        if not all(np.array_equal(arrays[k], want[k]) for k in FIELDS):
            raise SystemExit(f"step {step}: the producer's arrays differ from Plan.read's")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--paced", type=int, default=100)
    parser.set_defaults(steps=300, pace_ms=10.0)
    args = parser.parse_args()
    import jax
    from jax.sharding import Mesh

    from pipeline.feed.geometry import geometry

    config = bench.config_mapping(bench.resolve_sources(args), args)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    place = geometry(mesh, ("data",), 1, args.rows, args.seq_len)
    check(config, place)
    names = ("DataFeed", "producer")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[::-1] if round_ % 2 else names:
            results[name].append(run(name, config, mesh, place, args))
    print(f"{args.store}, {args.rows} x {args.seq_len}, {len(jax.devices())} devices, "
          f"{args.rounds} rounds, medians (range)")  # fmt: skip
    print("| ms | " + " | ".join(names) + " |\n| --- | ---: | ---: |")
    for key in dict.fromkeys(k for runs in results.values() for r in runs for k in r):
        cells = []
        for name in names:
            values = [r[key] for r in results[name] if key in r]
            cells.append(
                f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"
                if values else "-"
            )  # fmt: skip
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
