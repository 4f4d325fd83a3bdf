"""A/B of the host cache's eviction pass (`BlockCache`) between code versions.

    .venv/bin/python benchmarks/cache_pass_ab.py --root /tmp/before --root . --entries 100000

A cache of 64 KiB blocks holds millions of entries, and a pass scans them all. A variant is a
source checkout (`--root`, put first on PYTHONPATH); each round makes a fresh cache directory of
`--entries` entries of 16 bytes (untimed), then every variant, in an order that alternates
between rounds, runs in a fresh process on its own copy (hard links: 300k copied files took most
of an hour on a loaded machine): after a fill that brings the cache to
its bound (untimed: a new process's first fill counts the cache), the public row is one `get`
whose fill takes the cache over it (its pass deletes ~10 % of the entries), after a scan of the
entries alone (`_entries`). `settled_*` run until the pass is done: where it runs in the
background (`BlockCache.settle`), `fill_*` is the `get` alone, and `get_ms` (not per 100k) is
that `get`'s wall time in milliseconds, what the reader or fetch-ahead thread that made the fill
waits. While the `get` and its pass run, a thread takes and lets go of the host's count lock
(`DIR/.total`) again and again, as the fills of the host's other processes do: `fill_wait_s` is
its longest wait, in seconds (not per 100k: the time a fill of another process stalls; it
includes the GIL's switch interval, ~5 ms).
Prints process CPU and wall per 100k entries, medians (range) per variant, and the ratios.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD = "--child"
KEYS = (
    "get_ms", "fill_cpu_s", "fill_wall_s", "settled_cpu_s", "settled_wall_s", "scan_cpu_s",
    "scan_wall_s", "fill_wait_s",
)  # fmt: skip


def measure(root: Path, entries: int) -> dict[str, float]:
    """One round of one variant, in this (fresh) process: seconds per 100k entries."""
    from pipeline.store.block_cache import BlockCache

    cache = BlockCache(root, entries * 16 + 16)  # the entries and one more fill it exactly
    cache.get("blocks/fits", lambda: b"f" * 16, lambda data: True)  # untimed: counts the cache
    per = 100_000 / entries
    started, cpu = time.perf_counter(), time.process_time()
    cache._entries()
    scan = ((time.process_time() - cpu) * per, (time.perf_counter() - started) * per)
    done, waits = threading.Event(), [0.0]

    def other_fills() -> None:
        """The count lock taken as another process's fill takes it, until the `get` is done."""
        while not done.is_set():
            waited = time.perf_counter()
            with open(root / ".total", "a+") as counted:
                fcntl.flock(counted, fcntl.LOCK_EX)
                waits.append(time.perf_counter() - waited)
            time.sleep(0.001)

    waiter = threading.Thread(target=other_fills)
    waiter.start()
    started, cpu = time.perf_counter(), time.process_time()
    cache.get("blocks/over", lambda: b"o" * 16, lambda data: True)
    fill = ((time.process_time() - cpu) * per, (time.perf_counter() - started) * per)
    getattr(BlockCache, "settle", lambda: True)()  # a version without it passes in the `get`
    settled = ((time.process_time() - cpu) * per, (time.perf_counter() - started) * per)
    done.set()
    waiter.join()
    get_ms = fill[1] / per * 1000
    return dict(zip(KEYS, (get_ms, *fill, *settled, *scan, max(waits)), strict=True))


def populate(root: Path, entries: int) -> None:
    """`entries` entries of 16 bytes in 100 folders, used one second apart in 100 groups."""
    for k in range(entries):
        folder = root / "blocks" / f"{k % 100:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / str(k)).write_bytes(b"x" * 16)
        os.utime(folder / str(k), (1e9 + k // (entries // 100 or 1),) * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", required=True, help="a source checkout")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {root: [] for root in args.root}
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch, "base")
        populate(base, args.entries)
        for round_ in range(args.rounds):
            order = args.root if round_ % 2 == 0 else args.root[::-1]
            for root in order:
                copy = Path(scratch, "copy")
                shutil.copytree(base, copy, copy_function=os.link)  # a pass only deletes
                env = {**os.environ, "PYTHONPATH": str(Path(root).resolve())}
                out = subprocess.run(
                    [sys.executable, __file__, CHILD, str(copy), str(args.entries)],
                    env=env, check=True, capture_output=True, text=True, timeout=600,
                )  # fmt: skip
                results[root].append(json.loads(out.stdout))
                shutil.rmtree(copy)
    first = {key: statistics.median(r[key] for r in results[args.root[0]]) for key in KEYS}
    print(f"load {os.getloadavg()[0]:.1f}; seconds per 100k entries, median (range)")
    for root, rounds in results.items():
        cells = []
        for key in KEYS:
            values = [r[key] for r in rounds]
            median = statistics.median(values)
            cells.append(
                f"{key} {median:.3f} ({min(values):.3f}-{max(values):.3f}, "
                f"{median / first[key]:.2f}x)"
            )
        print(f"{root}: " + "; ".join(cells))


if __name__ == "__main__":
    if sys.argv[1:2] == [CHILD]:
        print(json.dumps(measure(Path(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
