"""Profile one DataFeed step: the reader thread's task and the training thread's `next()`.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python benchmarks/profile_feed.py --store python-code [--steps 200] [--top 14]

Same store, config and mesh as `pipeline bench` (8 simulated devices, 32 x 2048). First the
task a reader thread runs per step (`step_task.read_step`: `Plan.read` of the process's rows and one
transfer call, as a feed that logs events runs it) is run in the main thread under cProfile, so
the profile sees it; then the training thread's `next(feed)` with a 30 ms simulated step
between calls (the prefetch is ahead), also under cProfile (the thread CPU per step it prints
includes the profiler's overhead; the trainer's drop of the previous step's arrays is timed
apart: the feed holds them until a reader thread frees them, so it should cost ~nothing); then
the first step of fresh feeds, each the only feed of the
process, so its stores open cold (what a restore in a new process waits for once Orbax is
done; a feed built beside another one shares its open stores: `pipeline.feed.shared_stores`).
First it prints CPU ms per step of the parts, without the profiler, in interleaved rounds
(medians): among them the reader task run inline and `DataFeed`'s free-running `next()`, whose
difference is what handing each step from the reader thread to the training thread costs.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench  # benchmarks/bench.py, beside this file

ROUNDS = 5  # of each part, interleaved; medians


def cpu_ms(call, steps: int) -> tuple[float, float]:
    """(process CPU ms, voluntary context switches) per call: a thread that blocks, on a lock,
    the GIL or a queue, switches once; work done in one thread switches never."""
    import jax

    call(0)
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    start = time.process_time()
    for step in range(1, steps + 1):
        out = call(step)
    jax.block_until_ready(out)
    cpu = (time.process_time() - start) / steps * 1e3
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - switches
    return cpu, switches / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--top", type=int, default=14, help="profile rows to print")
    args = parser.parse_args()
    args.steps = max(args.steps, 200)

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipeline.config import parse_config
    from pipeline.feed.data_feed import DataFeed
    from pipeline.feed.step_task import read_rows, read_step

    config = parse_config(bench.config_mapping(bench.resolve_sources(args), args), origin="bench")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    with DataFeed(config, mesh) as feed:
        plan, geometry = feed.plan, feed._geometry_at(0)
        scheduled = feed._scheduled
        host = read_rows(plan, 0, geometry.rows, (), False).batch
        parts = {
            "Plan.draws": lambda s: plan.draws(s, geometry.rows),
            "Plan.read (draws + read + fields)": lambda s: (
                read_rows(plan, s, geometry.rows, (), False).batch
            ),
            "one transfer of the six fields": lambda s: geometry.to_global(host),
            "the reader task (read_step), run inline": lambda s: (
                read_step(plan, s, geometry, (), True, scheduled).batch
            ),
            # the same task in the feed's reader thread, handed over to this one
            "DataFeed next(), free-running": lambda s: next(feed),
        }
        rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in parts}
        for _ in range(ROUNDS):  # interleaved, so the load moves every part alike
            for name, call in parts.items():
                rounds[name].append(cpu_ms(call, args.steps))
        for name, values in rounds.items():
            cpu, switches = (statistics.median(v) for v in zip(*values))
            print(f"{name}: {cpu:.2f} ms CPU, {switches:.1f} voluntary context switches per step")
        handover = statistics.median(
            a[0] - b[0] for a, b in zip(rounds["DataFeed next(), free-running"],
                                        rounds["the reader task (read_step), run inline"])
        )  # fmt: skip
        print(
            f"the hand-over between the reader thread and this one: {handover:.2f} ms CPU per "
            "step (DataFeed's next() less the same task run inline, median of the rounds)"
        )

        profile = cProfile.Profile()
        profile.enable()
        for step in range(1, args.steps + 1):
            batch = read_step(plan, step, geometry, (), True, scheduled).batch
        jax.block_until_ready(batch)
        profile.disable()
        print(f"\nthe reader task, {args.steps} steps:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)

        batch = next(feed)
        jax.block_until_ready(batch)
        profile = cProfile.Profile()
        inside = dropping = 0.0
        for _ in range(args.steps):
            time.sleep(args.pace_ms / 1e3)
            start = time.thread_time()
            profile.enable()
            new = next(feed)
            profile.disable()
            inside += time.thread_time() - start
            start = time.thread_time()
            batch = new  # the previous step's arrays go: JAX frees their device buffers
            dropping += time.thread_time() - start
        jax.block_until_ready(batch)
        per_step, drop = inside / args.steps * 1e3, dropping / args.steps * 1e3
        print(
            f"the training thread's next(), {args.steps} steps, {per_step:.3f} ms thread CPU; "
            f"dropping the previous step's arrays, {drop:.3f} ms"
        )
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)

    # What a restore in a new process waits for after Orbax: a fresh feed's first step, cold.
    walls = []
    for _ in range(6):
        start = time.perf_counter()
        with DataFeed(config, mesh, step=10**6) as feed:
            jax.block_until_ready(next(feed))
            walls.append(time.perf_counter() - start)
    print(
        "a fresh feed, the only one of the process (cold stores): DataFeed(config, mesh, "
        f"step=10**6) to its first global batch, median of 5 after a warm-up: "
        f"{statistics.median(walls[1:]) * 1e3:.1f} ms"
    )
    profile = cProfile.Profile()
    for fresh in range(5):
        with DataFeed(config, mesh) as feed:
            geometry = feed._geometry_at(10**6)
            scheduled = feed._scheduled
            if fresh:
                profile.enable()
            jax.block_until_ready(read_step(feed.plan, 10**6, geometry, (), True, scheduled).batch)
            profile.disable()
    print("the first step of a fresh feed (4 fresh feeds, after one warm-up):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
