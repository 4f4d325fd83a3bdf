"""What checked reads (`feed: {verify: read}`, the default) cost, by the share of a store read.

    .venv/bin/python benchmarks/checked_reads_bench.py --store python-code --check-steps 40 90 180
    .venv/bin/python benchmarks/checked_reads_bench.py --store python-code --check-steps 40 \
        --block-bytes 2048 --cache-dir /tmp/bench-2k

Each block of a flat sidecar is checked on its first read per open shard, so what the checks
cost per token served depends on how much of the store a run reads: the first read of a window
hashes its blocks, and the reads into them that follow hash nothing. For each `--check-steps`
count, `bench.checked_reads_differences` (whose median is the last line of `pipeline bench`)
reads that many steps of the bench's config from freshly opened stores with `verify: read` and
with `verify: off`, back to back in alternating order over `--rounds`, and prints the median
and quartiles of the rounds' differences in CPU seconds per million tokens, beside the share of
the stores' tokens the steps read. `--block-bytes` prepares the stores with another block size
(in its own `--cache-dir`: the bench's cache keeps stores of the size prepare writes).
`--processes N` measures in N new processes in turn and prints the median of their medians and
their range: the figure of one process moved with its memory layout by more than the cost.
`--by-store` adds a line per store after each: the share of its tokens the steps served, its
reads and checks (reads that hash) per step, the bytes a check hashes and the bytes hashed per
token it served, counted (no clock): what a mixture's figure is made of. `--unit-costs` first
prints what a check's parts cost in this process (`unit_costs`): its call, and its bytes from
memory and from the cache.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # benchmarks/bench.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--check-steps", type=int, nargs="+", default=[40, 90, 180])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-bytes", type=int, help="prepare with this block size")
    parser.add_argument(
        "--processes", type=int, default=1, help="measure in this many new processes in turn"
    )
    parser.add_argument("--by-store", action="store_true", help="and the checks' counts by store")
    parser.add_argument("--unit-costs", action="store_true", help="first, a check's parts' costs")
    args = parser.parse_args()
    if args.block_bytes is not None:
        from pipeline.store import writer

        writer.BLOCK_BYTES = args.block_bytes
    from pipeline.store.token_store import TokenStore

    sources = bench.resolve_sources(args)
    config = bench.config_mapping(sources, args)
    tokens = sum(TokenStore(path).num_tokens for path, _ in sources.values())
    block = TokenStore(next(iter(sources.values()))[0]).manifest["shards"][0]["flat_block_bytes"]
    if args.unit_costs:
        print(unit_costs([path for path, _ in sources.values()], args.rounds), flush=True)
    for steps in args.check_steps:
        start = time.perf_counter()
        costs = [c * 1e6 for c in per_process(config, steps, args.rounds, args.processes)]
        share = steps * args.rows * args.seq_len / tokens
        print(
            f"{args.store} ({tokens:,} tokens, blocks of {block} bytes): {steps} steps "
            f"({share:.0%} of the tokens): hashes {hashed_per_token(config, steps):.2f} bytes "
            f"per token served; checks alone {statistics.median(costs):+.4f} CPU s per M tokens "
            f"({args.rounds} rounds in each of {len(costs)} processes, from {min(costs):+.4f} "
            f"to {max(costs):+.4f}; {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        if args.by_store:
            for line in by_store(config, steps):
                print(f"  {line}", flush=True)


def by_store(config: dict, steps: int) -> list[str]:
    """A line per store of what the checks of `steps` steps from freshly opened stores do:
    tokens served (and their share of the store's), reads and checks (reads that found a block
    not checked yet, each one `google_crc32c` call) per step, bytes hashed per check and per
    token served. Counted around `FlatBlocks.read` for the steps, so the load moves none of it."""
    from pipeline.config import parse_config
    from pipeline.read.plan import Plan
    from pipeline.store.flat_blocks import FlatBlocks

    counts: dict[str, list[int]] = {}  # sidecar folder -> [tokens served, reads, checks]
    read = FlatBlocks.read

    def counted(blocks: FlatBlocks, start: int, stop: int) -> np.ndarray:
        last = ((stop - 1) >> blocks.shift) + 1
        fresh = blocks.checked.find(0, start >> blocks.shift, last) >= 0
        count = counts.setdefault(str(Path(blocks._path).parent), [0, 0, 0])
        count[0], count[1], count[2] = count[0] + stop - start, count[1] + 1, count[2] + fresh
        return read(blocks, start, stop)

    plan = Plan.from_config(parse_config(config, origin="bench"))  # verify: read, the default
    rows = np.arange(config["global_batch_size"])
    FlatBlocks.read = counted  # type: ignore[method-assign]
    try:
        for step in range(steps):
            plan.batch(step, rows)
    finally:
        FlatBlocks.read = read  # type: ignore[method-assign]
    lines = []
    for store in plan.stores():
        flats = [store.flat_blocks(shard) for shard in range(store.num_shards)]
        hashed = sum(  # to within a block: the last may be shorter
            min(f.checked.count(1) * f.block_bytes, f.tokens.nbytes) for f in flats if f is not None
        )
        served, reads, checks = counts.get(str(store.path), [0, 0, 0])
        lines.append(
            f"{store.path.name}: {served:,} tokens served ({served / store.num_tokens:.0%} of "
            f"its {store.num_tokens:,}); per step {reads / steps:.1f} reads, {checks / steps:.1f} "
            f"checks of {hashed / max(checks, 1) / 1024:.0f} KiB; hashes "
            f"{hashed / max(served, 1):.2f} bytes per token served"
        )
        store.close()
    return lines


def unit_costs(stores: list[Path], rounds: int) -> str:
    """What a check's parts cost in this process, CPU per block, on the stores' sidecars, each
    mapped afresh per round as a fresh store maps it: a window's 4 KiB (at most the block)
    copied out of every block (what `verify: off` does), against the block hashed, then the
    window copied (what a block's first checked read does: its bytes come from memory, not
    the cache); a block hashed over and over (from the core's cache: the hash's own speed);
    and a check's call with its slice on no bytes. Medians of `rounds` rounds, alternating
    which of the first two goes first."""
    import google_crc32c

    from pipeline.store.token_store import TokenStore

    flats = []
    for path in stores:
        with TokenStore(path) as store:
            shards = store.manifest["shards"]
        flats += [(path / shard["flat"], shard["flat_block_bytes"]) for shard in shards]
    row = np.empty(min(4096, flats[0][1]), np.uint8)  # a 2,049-token uint16 window's bytes

    def blocks(hash_first: bool) -> tuple[float, int]:
        """CPU s of one pass over every block of every sidecar, freshly mapped; blocks."""
        spent, count = 0.0, 0
        for path, size in flats:
            with path.open("rb") as file:
                mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            tokens = np.frombuffer(mapped, np.uint8)
            ends = range(size, tokens.size + 1, size)  # whole blocks only
            start = time.process_time()
            for end in ends:
                if hash_first:
                    google_crc32c.extend(0, tokens[end - size : end])
                row[:] = tokens[end - row.size : end]
            spent += time.process_time() - start
            count += len(ends)
        return spent, count

    checked, off = [], []
    for round_ in range(rounds):
        for hash_first in (True, False) if round_ % 2 == 0 else (False, True):
            spent, count = blocks(hash_first)
            (checked if hash_first else off).append(spent / count)
    block, empty = np.zeros(flats[0][1], np.uint8), np.zeros(0, np.uint8)
    calls, hot = 100_000, []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(1000):
            google_crc32c.extend(0, block)
        hot.append((time.process_time() - start) / 1000)
    start = time.process_time()
    for _ in range(calls):
        google_crc32c.extend(0, empty[0:0])
    call = (time.process_time() - start) / calls
    size = flats[0][1]
    first = statistics.median(c - o for c, o in zip(checked, off))
    return (
        f"a check's parts, CPU per block of {size} bytes ({count:,} blocks, {rounds} rounds): "
        f"first read (hashed, then {row.size} bytes copied) {first * 1e6:.2f} us more than the "
        f"copy alone ({size / first / 1e9:.1f} GB/s); from the cache "
        f"{statistics.median(hot) * 1e6:.2f} us; the call and its slice on no bytes "
        f"{call * 1e6:.2f} us"
    )


def hashed_per_token(config: dict, steps: int) -> float:
    """Bytes the checks of `steps` steps from freshly opened stores hash per token served: the
    work the CPU figure measures, counted (each checked block is hashed once), so it does not
    move with the machine's load."""
    from pipeline.config import parse_config
    from pipeline.read.plan import Plan

    plan = Plan.from_config(parse_config(config, origin="bench"))  # verify: read, the default
    rows = np.arange(config["global_batch_size"])
    served = sum(plan.batch(step, rows)["inputs"].size for step in range(steps))
    hashed = 0
    for store in plan.stores():
        for shard in range(store.num_shards):
            blocks = store.flat_blocks(shard)  # None for a shard without a flat sidecar
            if blocks is not None:  # to within a block: the last may be shorter
                hashed += min(blocks.checked.count(1) * blocks.block_bytes, blocks.tokens.nbytes)
        store.close()
    return hashed / served


def per_process(config: dict, steps: int, rounds: int, processes: int) -> list[float]:
    """The median of `bench.checked_reads_differences` in this process, or in each of
    `processes` new ones in turn: a process's memory layout (where the maps and buffers fall)
    moved its figure by more than the checks cost, up to 5 ns per token on this machine."""
    if processes == 1:
        return [statistics.median(bench.checked_reads_differences(config, steps, rounds))]
    spawn = multiprocessing.get_context("spawn")
    medians = []
    for _ in range(processes):
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            work = pool.submit(bench.checked_reads_differences, config, steps, rounds)
            medians.append(statistics.median(work.result()))
    return medians


if __name__ == "__main__":
    main()
