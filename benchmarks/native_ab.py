"""A step's windows assembled in compiled code (numba, nogil) against the Python path, in DataFeed.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/native_ab.py --store python-code --rounds 6 [--expand device]

Three variants of `DataFeed(config, mesh)` (the bench's config and mesh, as `feed_ab.py`
measures them: free-running CPU and wall per step, then paced steps), each round in a fresh
process, in an order that alternates between rounds:

* `python`: the feed as it is;
* `native`: the step's copy and boundaries (`pipeline.read.windows._assemble`) by
  `native_read.assemble`, one compiled call that releases the interpreter lock;
* `free`: `Plan.read` returns fields read once beforehand: a read that costs nothing, so the
  bound of any faster read (what is left is the draws, the transfer and the feed's own work).

Before the rounds, it checks that the compiled path gives every field of `--check` steps bit
for bit (six fields and the compact form), and measures in this process `Plan.read` per step
both ways (interleaved, CPU), then in fresh processes the cost of the compiled path elsewhere:
importing numba, and the first read with an empty compile cache and with a warm one.
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
import feed_ab

CHILD = feed_ab.CHILD
VARIANTS = ("python", "native", "free")
FIRST_READ = """
import time, sys
start = time.perf_counter()
import numba
imported = time.perf_counter()
sys.path.insert(0, {here!r})
import native_read
from pipeline.config import parse_config
from pipeline.read.plan import Plan
plan = Plan.from_config(parse_config({config!r}, origin="native_ab"))
draws = plan.draws(0)
plan.read(draws)
python = time.perf_counter()
native_read.use()
plan.read(plan.draws(1))
print(imported - start, time.perf_counter() - python)
"""


def measure(spec: dict) -> dict[str, float]:
    """One round of one variant, in this (fresh) process."""
    if spec["variant"] == "native":
        import native_read

        native_read.use()
    elif spec["variant"] == "free":
        from pipeline.read.plan import Plan

        read = Plan._read
        done: dict[bool, dict] = {}

        def prepared(self, draws, packed):
            if packed not in done:
                done[packed] = read(self, draws, packed)
            return dict(done[packed])

        Plan._read = prepared
    return feed_ab.measure(spec)


def plan_parts(config: dict, steps: int, check: int, rounds: int) -> dict[str, float]:
    """Bit-identity of the compiled path over `check` steps, then `Plan.read`'s CPU per step
    both ways (interleaved rounds, medians)."""
    import native_read
    import numpy as np

    from pipeline.config import parse_config
    from pipeline.read import windows
    from pipeline.read.plan import Plan

    plan = Plan.from_config(parse_config(config, origin="native_ab"))
    python = windows._assemble
    native_read.use()
    native = windows._assemble

    def reads(assemble, first: int, count: int, compact: bool = False) -> list[dict]:
        windows._assemble = assemble
        return [
            plan.read_compact(draws) if compact else plan.read(draws)
            for draws in map(plan.draws, range(first, first + count))
        ]

    for compact in (False, True):
        for a, b in zip(reads(python, 0, check, compact), reads(native, 0, check, compact)):
            assert a.keys() == b.keys(), (a.keys(), b.keys())
            for name, values in a.items():
                assert values.dtype == b[name].dtype and np.array_equal(values, b[name]), name
    times: dict[str, list[float]] = {"python": [], "native": []}
    for round_ in range(rounds):
        order = ["python", "native"][:: -1 if round_ % 2 else 1]
        for name in order:
            start = time.process_time()
            reads(python if name == "python" else native, check + round_ * steps, steps)
            times[name].append((time.process_time() - start) / steps * 1e3)
    windows._assemble = python
    return {f"plan_read_{name}_ms": statistics.median(values) for name, values in times.items()}


def first_reads(config: dict) -> dict[str, float]:
    """In fresh processes: numba's import, and the first compiled read past a Python one with
    an empty compile cache, then with the cache that run left."""
    here = str(Path(__file__).resolve().parent)
    code = FIRST_READ.format(here=here, config=config)
    result = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, JAX_PLATFORMS="cpu")
        for name in ("cold", "warm"):
            out = subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
            )
            imported, first = map(float, out.stdout.split())
            result["numba_import_s"] = imported
            result[f"first_read_{name}_cache_s"] = first
    return result


def main() -> None:
    if sys.argv[1:2] == [CHILD]:
        print(json.dumps(measure(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--paced", type=int, default=50, help="paced next() calls per round")
    parser.add_argument("--check", type=int, default=50, help="steps checked bit for bit")
    parser.add_argument(
        "--expand", choices=("host", "device"), help="feed.expand (default: the config's, auto)"
    )
    parser.set_defaults(steps=600, pace_ms=10.0)
    args = parser.parse_args()
    config = bench.config_mapping(bench.resolve_sources(args), args)
    if args.expand:  # device: the compact form is transferred (its assembly is compiled too)
        config["feed"] = {**config.get("feed", {}), "expand": args.expand}
    parts = {**plan_parts(config, 200, args.check, 5), **first_reads(config)}
    spec = {"config": config, "steps": args.steps, "paced": args.paced, "pace_ms": args.pace_ms,
            "restore": None, "threads": None}  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    root = Path(__file__).resolve().parents[1]
    for round_ in range(args.rounds):
        for name in VARIANTS[:: -1 if round_ % 2 else 1]:
            variant = {**spec, "variant": name}
            results[name].append(feed_ab.run_child(root, variant, args.devices, __file__))
    tokens = args.rows * args.seq_len
    print(
        f"{args.store}, {args.rows} x {args.seq_len}, {args.devices} devices, {args.rounds} "
        f"rounds, expand: {args.expand or 'auto'}, medians (range), load average "
        f"{os.getloadavg()[0]:.1f}; bit for bit over "
        f"{args.check} steps (six fields and compact form)"
    )
    print("| ms per step | " + " | ".join(VARIANTS) + " | python / native |")
    print("| --- |" + " ---: |" * (len(VARIANTS) + 1))
    for key in feed_ab.RUN_KEYS:
        cells = []
        for name in VARIANTS:
            values = [run[key] for run in results[name]]
            cells.append(f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})")
        ratios = [a[key] / b[key] for a, b in zip(results["python"], results["native"])]
        print(f"| {key} | " + " | ".join(cells) + f" | {statistics.median(ratios):.2f}x |")
    for name in VARIANTS:
        cpu = statistics.median(run["cpu_ms"] for run in results[name])
        wall = statistics.median(run["wall_ms"] for run in results[name])
        print(f"{name}: {cpu / tokens * 1e3:.4f} CPU s per M tokens, {tokens / wall:.0f}k tokens/s")
    print(
        f"Plan.read per step, in-process: python {parts['plan_read_python_ms']:.3f} ms CPU, "
        f"native {parts['plan_read_native_ms']:.3f} ms CPU"
    )
    print(
        f"import numba {parts['numba_import_s']:.2f} s; first compiled read, empty cache "
        f"{parts['first_read_cold_cache_s']:.2f} s, "
        f"warm cache {parts['first_read_warm_cache_s']:.2f} s"
    )


if __name__ == "__main__":
    main()
