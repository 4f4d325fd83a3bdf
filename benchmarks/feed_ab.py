"""A/B of the feed users run, `DataFeed(config, mesh)`, between code versions or settings.

    .venv/bin/python benchmarks/feed_ab.py --store python-code --threads 4 --threads auto
    .venv/bin/python benchmarks/feed_ab.py --store mixture --root /tmp/before --root .
    .venv/bin/python benchmarks/feed_ab.py --store synthetic --restore --root /tmp/before --root .

A variant is a source checkout (`--root`, put first on PYTHONPATH; default: this one) with a
`feed.threads` value (`--threads`; default: the config's own). Every variant runs once per
round, each in a fresh process, in an order that alternates between rounds, so load on a shared
machine hits them alike; the bench's config and mesh (8 simulated devices, 32 x 2048 by default).

A round: 20 warm-up steps, `--steps` free-running `next()` calls (process CPU and wall per step,
ending with `block_until_ready`), then `--paced` calls each after a `--pace-ms` sleep (a
simulated training step; the prefetch is ahead): process CPU per paced step, the median wall
time of `next()` and the training thread's mean CPU in it (`feed.stats().next_cpu_s`). With
`--restore`, a round is instead a restore in a new process: a checkpoint
of step `--at` saved by a process of its own, then, in a fresh one (JAX, Orbax and `pipeline`
imported, untimed), `DataFeed`, the documented `CheckpointManager.restore(...,
Composite(data=DataRestore(feed)))` and the first `next()`, wall time. Prints medians (range)
per variant and how many rounds the last beat the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # benchmarks/bench.py, beside this file

WARMUP = 20
CHILD = "--child"
RUN_KEYS = ("cpu_ms", "wall_ms", "paced_cpu_ms", "next_ms", "next_cpu_ms")
RESTORE_KEYS = ("restore_ms",)


def measure(spec: dict) -> dict[str, float]:
    """One round of one variant, in this (fresh) process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed

    config = parse_config(spec["config"], origin="feed_ab.yaml")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    options = {} if spec["threads"] is None else {"threads": spec["threads"]}
    if spec["restore"] is not None:
        return restore(config, mesh, options, spec["restore"], Path(spec["checkpoint"]))
    with DataFeed(config, mesh, **options) as feed:
        for _ in range(WARMUP):
            batch = next(feed)
        jax.block_until_ready(batch)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(spec["steps"]):
            batch = next(feed)
        jax.block_until_ready(batch)
        steps = spec["steps"]
        result = {
            "cpu_ms": (time.process_time() - cpu) / steps * 1e3,
            "wall_ms": (time.perf_counter() - wall) / steps * 1e3,
        }
        walls, cpu = [], time.process_time()
        threads = next_cpu_s(feed)
        for _ in range(spec["paced"]):
            time.sleep(spec["pace_ms"] / 1e3)
            start = time.perf_counter()
            batch = next(feed)
            walls.append(time.perf_counter() - start)
        jax.block_until_ready(batch)
        result["paced_cpu_ms"] = (time.process_time() - cpu) / spec["paced"] * 1e3
        result["next_ms"] = statistics.median(walls) * 1e3
        result["next_cpu_ms"] = (next_cpu_s(feed) - threads) / spec["paced"] * 1e3
    return result


def next_cpu_s(feed) -> float:
    """The training thread's CPU seconds in `next()` so far (NaN: a checkout from before
    `feed.stats()` counted it)."""
    stats = feed.stats()
    return stats.next_cpu_s.sum if hasattr(stats, "next_cpu_s") else float("nan")


def restore(config, mesh, options: dict, step: int, directory: Path) -> dict[str, float]:
    """Save the data state of `step` under an empty `directory` (the round's first process),
    or restore it (the second: a new process, as after a restart)."""
    import jax
    import orbax.checkpoint as ocp

    from pipeline.feed.checkpoint import DataRestore, DataSave
    from pipeline.feed.data_feed import DataFeed

    mngr = ocp.CheckpointManager(directory)
    if mngr.latest_step() is None:
        with DataFeed(config, mesh, step=step, **options) as feed:
            mngr.save(step, args=ocp.args.Composite(data=DataSave(feed)))
        mngr.wait_until_finished()
        mngr.close()
        return {}
    start = time.perf_counter()
    feed = DataFeed(config, mesh, **options)
    mngr.restore(step, args=ocp.args.Composite(data=DataRestore(feed)))
    jax.block_until_ready(next(feed))
    took = time.perf_counter() - start
    feed.close()
    mngr.close()
    return {"restore_ms": took * 1e3}


def run_child(root: Path, spec: dict, devices: int, script: str = __file__) -> dict[str, float]:
    """`script --child spec` in a fresh process over the checkout `root`: its last line."""
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    out = subprocess.run(
        [sys.executable, script, CHILD, json.dumps(spec)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_threads(value: str) -> int | str:
    return value if value == "auto" else int(value)


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--root", type=Path, action="append", help="source checkout (repeatable)")
    parser.add_argument("--threads", type=parse_threads, action="append", help="repeatable")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--paced", type=int, default=150, help="paced next() calls per round")
    parser.add_argument("--restore", action="store_true", help="time a restore instead")
    parser.add_argument("--at", type=int, default=10**6, help="the restored step")
    parser.set_defaults(steps=600, pace_ms=10.0)
    args = parser.parse_args()
    roots = [r.resolve() for r in args.root or [Path(__file__).resolve().parents[1]]]
    variants = [(root, threads) for root in roots for threads in args.threads or [None]]
    config = bench.config_mapping(bench.resolve_sources(args), args)
    spec = {"config": config, "steps": args.steps, "paced": args.paced,
            "pace_ms": args.pace_ms, "restore": args.at if args.restore else None}  # fmt: skip
    results: list[list[dict[str, float]]] = [[] for _ in variants]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = list(range(len(variants)))
            for index in order[::-1] if round_ % 2 else order:
                root, threads = variants[index]
                child = {**spec, "threads": threads, "checkpoint": f"{tmp}/{round_}-{index}"}
                if args.restore:  # saved by a process of its own, untimed
                    run_child(root, child, args.devices)
                results[index].append(run_child(root, child, args.devices))
    keys = RESTORE_KEYS if args.restore else RUN_KEYS
    names = [f"{root.name} threads={threads or 'default'}" for root, threads in variants]
    print(
        f"{args.store}, {args.rows} x {args.seq_len}, {args.devices} devices, {args.rounds} "
        "rounds, medians (range); last / first: rounds the last variant's figure is lower"
    )
    print("| ms | " + " | ".join(names) + " | last / first |")
    print("| --- |" + " ---: |" * (len(names) + 1))
    for key in keys:
        cells = []
        for runs in results:
            values = [run[key] for run in runs]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        wins = sum(b[key] < a[key] for a, b in zip(results[0], results[-1]))
        print(f"| {key} | " + " | ".join(cells) + f" | {wins} / {args.rounds} |")


if __name__ == "__main__":
    main()
