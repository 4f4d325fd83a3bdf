"""A store's open and a shard's first use, as a big mixture's restore pays them, per unit.

    python benchmarks/store_open_bench.py [--sources 256] [--rounds 3] [--root DIR ...]

Over `mixture_bench.py`'s K stores (8 shards each): each store's metadata taken from the host's
summary (`formats.load_meta` with `Summaries`, as a restore plans), then, timed by thread CPU,
every store opened as a feed's first draw opens it (`open_store(path, known=meta)`), and every
shard's first use (`shard_view`: its files checked, indexes loaded, sidecar mapped); then, as a
restore's first step uses its stores, each store opened and one of its shards used. Each
(checkout, round) runs in a fresh process and reports the least CPU per store open, per shard
first use and per store opened with one shard used, of 7 passes over all the stores (each pass
opens them afresh and closes them).
`--root`: the source checkouts to compare (default: this one), alternated round by round.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import checkouts  # beside this file

HERE = Path(__file__).resolve().parent
KEYS = ("open_us", "first_use_us", "one_shard_us")


def measure(directory: Path) -> dict[str, float]:
    """Least thread CPU (us) of a store's open and of a shard's first use, in this process."""
    import gc

    from pipeline.store.formats import load_meta, open_store
    from pipeline.store.meta_cache import Summaries

    paths = sorted(p for p in directory.iterdir() if p.is_dir())
    summaries = Summaries(paths)
    metas = [load_meta(path, summaries) for path in paths]
    summaries.save()  # then the next pass takes every store's metadata from the summary
    summaries = Summaries(paths)
    metas = [load_meta(path, summaries) for path in paths]
    opens, uses, ones = [], [], []
    for _ in range(7):
        gc.collect()
        started = time.thread_time()
        stores = [open_store(meta.path, check_reads=True, known=meta) for meta in metas]
        for store in stores:  # as a restore's first step: one shard of each store
            store.shard_view(len(paths) % store.num_shards)
        ones.append((time.thread_time() - started) / len(stores))
        for store in stores:
            store.close()
        gc.collect()
        started = time.thread_time()
        stores = [open_store(meta.path, check_reads=True, known=meta) for meta in metas]
        opens.append((time.thread_time() - started) / len(stores))
        shards = sum(store.num_shards for store in stores)
        started = time.thread_time()
        for store in stores:
            for shard in range(store.num_shards):
                store.shard_view(shard)
        uses.append((time.thread_time() - started) / shards)
        for store in stores:
            store.close()
    return {
        "open_us": min(opens) * 1e6,
        "first_use_us": min(uses) * 1e6,
        "one_shard_us": min(ones) * 1e6,
    }


def main() -> None:
    parser = checkouts.parser(__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=256)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    from mixture_bench import build  # beside this file: its stores

    roots = checkouts.roots(args.root)
    directory = build(args.dir, args.sources, 1 << 24)[0].parent
    load = os.getloadavg()[0]
    got: dict[int, list[dict[str, float]]] = {}
    for i, root in checkouts.alternated(roots, args.rounds):
        got.setdefault(i, []).append(checkouts.child(__file__, root, directory))
    print(f"load average at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}\n")
    print(
        "checkout | store open, us CPU | shard first use, us CPU | a store's open and one "
        "shard's first use, us CPU (least of the rounds)"
    )
    print("--- | ---: | ---: | ---:")
    for i, runs in sorted(got.items()):
        opens, uses, ones = (min(run[key] for run in runs) for key in KEYS)
        print(f"{roots[i]} | {opens:.1f} | {uses:.1f} | {ones:.1f}")


if __name__ == "__main__":
    main()
