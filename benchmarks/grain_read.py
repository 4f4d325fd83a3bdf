"""Grain's settings as the benchmarks try them, and how their rows are named and compared, in
one place: bench.py's main table and sft_bench.py's packed-SFT rows sweep the same settings and
pick Grain's best the same way, and sft_bench.py cannot import bench.py (bench.py imports it)."""

from __future__ import annotations

from collections.abc import Mapping

# (num_threads, prefetch_buffer_size): none, small, medium, Grain's default (16, 500)
GRAIN_READ_OPTIONS = ((0, 0), (1, 16), (2, 64), (16, 500))
# mp_prefetch workers read with this: each worker is a process, its own threads add little.
# Only the mp_prefetch rows use it; every single-process Grain row (the main table's pipeline
# and the packed-SFT packers) is tried with each of GRAIN_READ_OPTIONS, the best by measurement.
GRAIN_MP_READ = (1, 16)


def grain_settings(workers: int) -> dict[str, dict[str, int]]:
    """Row suffix -> Grain options of every setting tried: each ReadOptions in one process
    (`t{threads}_b{buffer}`), then mp_prefetch with 1..`workers` processes (`mp{n}`)."""
    settings = {
        f"t{threads}_b{buffer}": {"threads": threads, "buffer": buffer, "workers": 0}
        for threads, buffer in GRAIN_READ_OPTIONS
    }
    threads, buffer = GRAIN_MP_READ
    for n in range(1, workers + 1):
        settings[f"mp{n}"] = {"threads": threads, "buffer": buffer, "workers": n}
    return settings


def grain_label(options: Mapping[str, int], pipeline: str = "") -> str:
    """A Grain row's label: `Grain [PIPELINE, ]ReadOptions(...)` in one process, or
    `Grain [PIPELINE ]+ mp_prefetch(n workers)`."""
    head = f"Grain {pipeline}".rstrip()
    workers = options["workers"]
    if workers:
        return f"{head} + mp_prefetch({workers} worker{'s' if workers != 1 else ''})"
    read = (
        f"ReadOptions(num_threads={options['threads']}, prefetch_buffer_size={options['buffer']})"
    )
    return f"{head}{', ' if pipeline else ' '}{read}"


def fastest(
    tokens_per_s: Mapping[str, float], settings: Mapping[str, Mapping[str, int]], mp: bool
) -> str | None:
    """The row of `settings` (name -> options) with the highest median tokens/s in this run,
    among those in one process (`mp` false) or those with mp_prefetch; None if none ran."""
    rows = (name for name, options in settings.items() if bool(options["workers"]) == mp)
    return max(rows, key=lambda name: tokens_per_s[name], default=None)


def ratio(a: float, b: float) -> float:
    """a / b; NaN when b is 0 (a run too short for the CPU clock's 10 ms ticks)."""
    return a / b if b else float("nan")
