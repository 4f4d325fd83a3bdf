"""What a store's checks cost: opening it, a shard's first use, and the full pass.

    .venv/bin/python benchmarks/store_check_bench.py [INPUT] [--num-shards 16] [--repeat 5]

Prepares INPUT (default `builtin:python-code`) into a temporary store, then times, as medians
of `--repeat` runs: `TokenStore(path)` (manifest and sizes), the first use of each shard
(indexes, the sampled records of the sidecar it is served from; per shard) and
`TokenStore.verify()` (every byte).
docs/token-store.md quotes the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.store.token_store import TokenStore


def measure(path: Path) -> tuple[float, float, float]:
    """(open s, first use s per shard, full verify s) of one fresh `TokenStore`."""
    started = time.perf_counter()
    store = TokenStore(path)
    opened = time.perf_counter() - started
    started = time.perf_counter()
    for shard in range(store.num_shards):
        store.record_offsets(shard)  # the first use runs the shard's checks
    first_use = (time.perf_counter() - started) / store.num_shards
    store.close()
    started = time.perf_counter()
    TokenStore(path).verify()
    return opened, first_use, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input", nargs="?", default="builtin:python-code")
    parser.add_argument("--num-shards", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        prepare(PrepareOptions([args.input], path, num_shards=args.num_shards, progress=False))
        store = TokenStore(path)
        size = sum(entry["bytes"] for entry in store.manifest["shards"])
        runs = [measure(path) for _ in range(args.repeat)]
    opened, first_use, verify = (statistics.median(column) for column in zip(*runs))
    print(
        f"{args.input}: {store.num_shards} shards, {store.num_tokens:,} tokens, "
        f"{store.manifest['num_records']:,} records, {size / 2**20:.1f} MiB"
    )
    print(f"open            {opened * 1e3:8.2f} ms")
    print(f"first use/shard {first_use * 1e3:8.2f} ms")
    print(f"full verify     {verify:8.2f} s  ({size / 2**20 / verify:.0f} MiB/s)")


if __name__ == "__main__":
    main()
