"""Reading from a bucket: time to the first batch, sequential round trips, requests and bytes
of a feed over gs:// stores (the GCS emulator behind tests/gcs_proxy.py, `--latency` s per
request), cold and with a warm host cache (`feed.cache`), for 1 and 64 sources. Each row is a
fresh process. `--no-flat` writes the stores without flat sidecars (`prepare --no-flat-tokens`),
served from whole shards (`remote_shards`).

    python benchmarks/bucket_bench.py [--sources 1,64] [--latency 0.05] [--steps 60] [--no-flat]
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


def child(config: str, steps: int) -> None:
    """One fresh process: first batch, then the other steps; prints a JSON line."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    from jax.sharding import Mesh

    from pipeline.config import load_config
    from pipeline.feed.data_feed import DataFeed

    started = time.monotonic()
    with DataFeed(load_config(config), Mesh(np.array(jax.devices()[:8]), ("data",))) as feed:
        next(feed)
        first, wall = time.monotonic() - started, time.time()
        for _ in range(steps - 1):
            next(feed)
        stats = feed.stats()
    print(json.dumps({"first_s": first, "at": wall, "per_token": stats.downloaded_per_token}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sources", default="1,64")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-flat", action="store_true")
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    import yaml

    from pipeline.urls import copy_file, location
    from tests.gcs_emulator import serving
    from tests.gcs_proxy import proxied
    from tests.storegen import write_synthetic_store

    work = Path(tempfile.mkdtemp(prefix="bucket-bench-"))
    counts = [int(n) for n in args.sources.split(",")]
    print(
        "| sources | cache | DataFeed() to first batch (s) | round trips to it | requests | MB "
        "| bytes per token |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    with serving() as bucket:
        rng = np.random.default_rng(0)
        for k in range(max(counts)):  # 4 shards of ~140 k tokens each per source
            local = work / f"s{k}"
            lengths = [rng.integers(50, 400, 600).tolist() for _ in range(4)]
            write_synthetic_store(local, lengths, first=k << 24, flat=not args.no_flat)
            for file in local.iterdir():
                copy_file(file, location(f"{bucket}/s{k}") / file.name)
        with proxied(os.environ["STORAGE_EMULATOR_HOST"], latency=args.latency) as log:
            for count in counts:
                cache = work / f"cache-{count}"
                raw = {
                    "seed": 1, "seq_len": 64, "global_batch_size": 8,
                    "mix": {f"s{k}": 1 for k in range(count)},
                    "sources": {f"s{k}": {"path": f"{bucket}/s{k}"} for k in range(count)},
                    "feed": {"cache": {"dir": str(cache), "max_gb": 10}},
                }  # fmt: skip
                config = work / f"c{count}.yaml"
                config.write_text(yaml.safe_dump(raw))
                for label in ("cold", "warm"):
                    log.clear()
                    command = [sys.executable, __file__, "--child", str(config), str(args.steps)]
                    done = subprocess.run(command, capture_output=True, text=True, check=True)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    print(
                        f"| {count} | {label} | {row['first_s']:.2f} | "
                        f"{log.rounds(before=row['at'])} | {len(log.requests)} | "
                        f"{log.downloaded() / 1e6:.2f} | {row['per_token']:.1f} |"
                    )


if __name__ == "__main__":
    main()
