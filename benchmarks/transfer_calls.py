"""The transfer of one step's six fields by each JAX call that can make the feed's global arrays.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/transfer_calls.py [--rows 32 --seq-len 2048 --rounds 7]
    .venv/bin/python benchmarks/transfer_calls.py --processes 4   # 8 devices over 4 processes

The fields laid out as `Plan.read` lays them (int32 strided views: `inputs` and `targets`
overlap in one [rows, seq_len + 1] array, as do the segment and position pairs), fresh arrays
every step, the previous step's global arrays dropped when the next ones arrive (as a trainer
drops them), rows sharded over every device in a 1-D mesh. Per call, the median over
interleaved rounds of the process CPU per step (the calls' Python, JAX's per-device copies
and the previous step's buffers freed): `jax.device_put` of the list (the feed's call until
`pipeline.feed.placer`), `jax.make_array_from_process_local_data` of the list (several
processes' call, Grain's rows in `pipeline bench`), `jax.make_array_from_callback` per field,
`Placer.put` (the feed's call now), and `Placer.put` of C-contiguous copies at 64-byte-aligned
addresses, which CPU devices alias instead of copying (the copy counted). "fields only" is
the making of the fresh views alone, counted in every row.

With `--processes N`, N local `jax.distributed` processes on 127.0.0.1 (8 / N simulated
devices each) each transfer their block of the rows (`Geometry.rows`) by the two calls that
take a block, `jax.make_array_from_process_local_data` and `Geometry.place` (the placer), and
process 0 prints its figures.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK_CALLS = (
    "jax.make_array_from_process_local_data(list)",
    "Geometry.place (the feed's call: the placer)",
)
"""The calls that take a process's block of the rows (the rest take the whole global array)."""


def measure(calls: dict, fields, steps: int, rounds: int) -> dict[str, list[float]]:
    """Process CPU ms per step of each call on fresh `fields()`, interleaved rounds."""
    import jax

    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds):
        order = list(calls.items())
        for name, call in order[::-1] if round_ % 2 else order:
            held = collections.deque(maxlen=1)  # the previous step's arrays freed, as in a trainer
            held.append(call(fields()))
            start = time.process_time()
            for _ in range(steps):
                held.append(call(fields()))
            jax.block_until_ready(held[-1])
            cpu[name].append((time.process_time() - start) / steps * 1e3)
    return cpu


def launch(args: argparse.Namespace) -> None:
    """`--processes` children of this script on 127.0.0.1, stopped after 5 minutes."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args.processes}"
    argv = [sys.executable, __file__, *sys.argv[1:], "--port", str(port)]
    children = [
        subprocess.Popen([*argv, "--process", str(i)], env=env) for i in range(args.processes)
    ]
    try:
        codes = [child.wait(timeout=300) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    if any(codes):
        sys.exit(f"a process failed: exit codes {codes}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--processes", type=int, default=1, help="1, 2, 4 or 8")
    parser.add_argument("--process", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.processes > 1 and args.process is None:
        launch(args)
        return

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from pipeline.feed.geometry import geometry

    if args.process is not None:
        jax.distributed.initialize(f"127.0.0.1:{args.port}", args.processes, args.process)
    width = args.seq_len
    where = geometry(Mesh(np.array(jax.devices()), ("data",)), ("data",), 1, args.rows, width)
    rows, sharding = len(where.rows), where.sharding
    rng = np.random.default_rng(0)
    wide = [rng.integers(0, 2**15, (rows, width + 1), dtype=np.int32) for _ in range(3)]

    def fields() -> list[np.ndarray]:
        out = []
        for values in wide:
            fresh = values.copy()
            out += [fresh[:, :-1], fresh[:, 1:]]
        return out

    def aligned(arrays: list[np.ndarray]) -> list[np.ndarray]:
        raw = np.empty(sum(a.nbytes for a in arrays) + 64, np.uint8)
        at = -raw.ctypes.data % 64
        out = []
        for array in arrays:  # every field a multiple of 64 bytes here
            view = raw[at : at + array.nbytes].view(array.dtype).reshape(array.shape)
            np.copyto(view, array)
            out.append(view)
            at += array.nbytes
        return out

    shardings, shapes = [sharding] * 6, [where.shape] * 6
    calls = {
        "jax.device_put(list)": lambda f: jax.device_put(f, shardings),
        BLOCK_CALLS[0]: lambda f: jax.make_array_from_process_local_data(shardings, f, shapes),
        "jax.make_array_from_callback per field": lambda f: [
            jax.make_array_from_callback(where.shape, sharding, a.__getitem__) for a in f
        ],
        BLOCK_CALLS[1]: lambda f: where.place(f, [])[0],
        "the placer on aligned contiguous copies": lambda f: where.place(aligned(f), [])[0],
        "fields only": lambda f: f,
    }
    if args.process is not None:  # the calls that take a process's block of rows
        calls = {name: calls[name] for name in BLOCK_CALLS}
    cpu = measure(calls, fields, args.steps, args.rounds)
    if jax.process_index():
        return
    first = next(iter(cpu))
    base = statistics.median(cpu[first])
    print(
        f"six int32 fields {args.rows} x {width}, {jax.device_count()} devices, "
        f"{jax.process_count()} process(es): process 0, {rows} rows on "
        f"{jax.local_device_count()} devices, {args.rounds} rounds"
    )
    print(f"| call | CPU ms per step, median (range) | / {first} |")
    print("| --- | ---: | ---: |")
    for name, values in cpu.items():
        median = statistics.median(values)
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(f"| {name} | {median:.3f} ({spread}) | {median / base:.2f} |")


if __name__ == "__main__":
    main()
