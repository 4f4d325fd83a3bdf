"""What checked reads (`feed: {verify: read}`, the default) cost, by the share of a store read.

    .venv/bin/python benchmarks/checked_reads_bench.py --store python-code --check-steps 40 90 180
    .venv/bin/python benchmarks/checked_reads_bench.py --store python-code --check-steps 40 \
        --block-bytes 1024 --cache-dir /tmp/bench-1k

Each block of a flat sidecar is checked on its first read per open shard, so what the checks
cost per token served depends on how much of the store a run reads: the first read of a block
hashes all of it, and the reads into it that follow hash nothing. For each `--check-steps`
count, `bench.checked_reads_cpu` (the last line of `pipeline bench`) reads that many steps of
the bench's config from freshly opened stores with `verify: read` and with `verify: off`,
alternating over `--rounds`, and prints the difference of the medians in CPU seconds per
million tokens, beside the share of the stores' tokens the steps read. `--block-bytes` prepares
the stores with another block size (in its own `--cache-dir`: the bench's cache keeps stores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # benchmarks/bench.py, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    parser.add_argument("--check-steps", type=int, nargs="+", default=[40, 90, 180])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-bytes", type=int, help="prepare with this block size")
    args = parser.parse_args()
    if args.block_bytes is not None:
        from pipeline.store import writer

        writer.BLOCK_BYTES = args.block_bytes
    from pipeline.store.token_store import TokenStore

    sources = bench.resolve_sources(args)
    config = bench.config_mapping(sources, args)
    tokens = sum(TokenStore(path).num_tokens for path, _ in sources.values())
    block = TokenStore(next(iter(sources.values()))[0]).manifest["shards"][0]["flat_block_bytes"]
    for steps in args.check_steps:
        start = time.perf_counter()
        cost = bench.checked_reads_cpu(config, steps, args.rounds) * 1e6
        share = steps * args.rows * args.seq_len / tokens
        print(
            f"{args.store} ({tokens:,} tokens, blocks of {block} bytes): {steps} steps "
            f"({share:.0%} of the tokens): checks alone {cost:+.4f} CPU s per M tokens "
            f"({args.rounds} rounds, {time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
