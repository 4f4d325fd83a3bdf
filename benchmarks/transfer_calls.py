"""The transfer of one step's six fields by each JAX call that can make the feed's global arrays.

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        .venv/bin/python benchmarks/transfer_calls.py [--rows 32 --seq-len 2048 --rounds 7]

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
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pipeline.feed.placer import Placer

    rows, width = args.rows, args.seq_len
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    placer = Placer(sharding, np.arange(rows), 0, rows)
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

    shardings = [sharding] * 6
    calls = {
        "jax.device_put(list)": lambda f: jax.device_put(f, shardings),
        "jax.make_array_from_process_local_data(list)": lambda f: (
            jax.make_array_from_process_local_data(shardings, f, [(rows, width)] * 6)
        ),
        "jax.make_array_from_callback per field": lambda f: [
            jax.make_array_from_callback((rows, width), sharding, a.__getitem__) for a in f
        ],
        "Placer.put (the feed's call)": placer.put,
        "Placer.put of aligned contiguous copies": lambda f: placer.put(aligned(f)),
        "fields only": lambda f: f,
    }
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(args.rounds):
        order = list(calls.items())
        for name, call in order[::-1] if round_ % 2 else order:
            held = collections.deque(maxlen=1)
            held.append(call(fields()))
            start = time.process_time()
            for _ in range(args.steps):
                held.append(call(fields()))
            jax.block_until_ready(held[-1])
            cpu[name].append((time.process_time() - start) / args.steps * 1e3)
    base = statistics.median(cpu["jax.device_put(list)"])
    print(f"six int32 fields {rows} x {width}, {len(jax.devices())} devices, {args.rounds} rounds")
    print("| call | CPU ms per step, median (range) | / jax.device_put |")
    print("| --- | ---: | ---: |")
    for name, values in cpu.items():
        median = statistics.median(values)
        spread = f"{min(values):.3f}-{max(values):.3f}"
        print(f"| {name} | {median:.3f} ({spread}) | {median / base:.2f} |")


if __name__ == "__main__":
    main()
