"""One process of the cache tests (tests/test_remote_reads.py): feed a data config for some
steps and save the batches and the bytes this process downloaded.

    python tests/remote_feed_worker.py CONFIG STEPS OUT.npz
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
from jax.sharding import Mesh

from pipeline.config import load_config
from pipeline.feed.data_feed import DataFeed
from pipeline.read.batch import FIELDS


def main(config: str, steps: int, out: str) -> None:
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    with DataFeed(load_config(config), mesh) as feed:
        batches = [next(feed) for _ in range(steps)]
        downloaded = feed.stats().downloaded_bytes
    arrays = {f"{f}{i}": np.asarray(b[f]) for i, b in enumerate(batches) for f in FIELDS}
    np.savez(out, downloaded=downloaded, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
