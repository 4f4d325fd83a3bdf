"""Reading from a bucket: time to the first batch, sequential round trips, the steps after it
(the time `next()` waits, each after a training step of `--train-ms`), requests and bytes of a
feed over gs:// stores (the GCS emulator behind tests/gcs_proxy.py, `--latency` s per request),
cold and with a warm host cache (`feed.cache`), and cold without fetching the next steps'
blocks ahead (`feed.fetch_ahead: 0`), for 1 and 64 sources; the feed's defaults otherwise. Each
row is a fresh process. `--no-flat` writes the stores without flat sidecars (`prepare
--no-flat-tokens`), served from whole shards (`remote_shards`).

    python benchmarks/bucket_bench.py [--sources 1,64] [--latency 0.05] [--steps 60]
        [--train-ms 50] [--no-flat]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def child(config: str, steps: int, train_s: float) -> None:
    """One fresh process: first batch, then the other steps, each after `train_s` of a
    training step (a sleep); prints a JSON line."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    from jax.sharding import Mesh

    from pipeline.config import load_config
    from pipeline.feed.data_feed import DataFeed

    started = time.monotonic()
    with DataFeed(load_config(config), Mesh(np.array(jax.devices()[:8]), ("data",))) as feed:
        next(feed)
        first, wall = time.monotonic() - started, time.time()
        waited = 0.0  # in next(), after the first batch: what a training step would wait
        for _ in range(steps - 1):
            time.sleep(train_s)
            asked = time.monotonic()
            next(feed)
            waited += time.monotonic() - asked
        stats = feed.stats()
    row = {"first_s": first, "at": wall, "per_token": stats.downloaded_per_token}
    print(json.dumps({**row, "wait_ms": 1e3 * waited / max(steps - 1, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sources", default="1,64")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--train-ms", type=float, default=50.0)
    parser.add_argument("--no-flat", action="store_true")
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), float(args.child[2]))
        return
    with tempfile.TemporaryDirectory(prefix="bucket-bench-") as work:  # ~370 MB, removed
        run(args, Path(work))


def run(args: argparse.Namespace, work: Path) -> None:
    """The table, its stores, configs and caches written under `work`."""
    import yaml

    from pipeline.urls import copy_file, location
    from tests.gcs_emulator import serving
    from tests.gcs_proxy import proxied
    from tests.storegen import write_synthetic_store

    counts = [int(n) for n in args.sources.split(",")]
    print(
        "| sources | run | DataFeed() to first batch (s) | round trips to it | next() wait per "
        f"step after it, {args.train_ms:g} ms steps (ms) | requests | MB | bytes per token |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    with serving() as bucket:
        rng = np.random.default_rng(0)
        for k in range(max(counts)):  # 4 shards of ~140 k tokens each per source
            local = work / f"s{k}"
            lengths = [rng.integers(50, 400, 600).tolist() for _ in range(4)]
            write_synthetic_store(local, lengths, first=k << 24, flat=not args.no_flat)
            for file in local.iterdir():
                copy_file(file, location(f"{bucket}/s{k}") / file.name)
        with proxied(os.environ["STORAGE_EMULATOR_HOST"], latency=args.latency) as log:
            # the baseline first: in earlier runs the first run over freshly uploaded objects was
            # the slowest to its first batch, whichever it was; that falls on the baseline
            runs = (("cold, fetch_ahead: 0", "b", 0), ("cold", "a", 4), ("warm", "a", 4))
            for count in counts:
                for label, cache, ahead in runs:
                    raw = {
                        "seed": 1, "seq_len": 64, "global_batch_size": 8,
                        "mix": {f"s{k}": 1 for k in range(count)},
                        "sources": {f"s{k}": {"path": f"{bucket}/s{k}"} for k in range(count)},
                        "feed": {"cache": {"dir": str(work / f"cache-{count}-{cache}"),
                                           "max_gb": 10}, "fetch_ahead": ahead},
                    }  # fmt: skip
                    config = work / f"c{count}.yaml"
                    config.write_text(yaml.safe_dump(raw))
                    log.clear()
                    command = [
                        sys.executable, __file__, "--child", str(config), str(args.steps),
                        str(args.train_ms / 1e3),
                    ]  # fmt: skip
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    print(
                        f"| {count} | {label} | {row['first_s']:.2f} | "
                        f"{log.rounds(before=row['at'])} | {row['wait_ms']:.1f} | "
                        f"{len(log.requests)} | {log.downloaded() / 1e6:.2f} | "
                        f"{row['per_token']:.1f} |"
                    )


if __name__ == "__main__":
    main()
