"""One bound on open shards for the whole process, sized from its open-file limit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.store import open_shards
from pipeline.store.open_shards import OpenShards
from pipeline.store.token_store import TokenStore
from tests.storegen import write_synthetic_store

ROOT = Path(__file__).resolve().parent.parent


def files_under(root: Path) -> int:
    """The files under `root` this process holds open: shards' ArrayRecord readers, and
    mapped flat sidecars (each map keeps a descriptor)."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used
            held += os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
    return held


def test_every_stores_shards_count_against_one_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(open_shards, "_POOL", OpenShards(3))
    stores = []
    for k in range(3):
        shards = [[5 + s, 7] for s in range(4)]
        write_synthetic_store(tmp_path / f"s{k}", shards, first=1000 * k).close()
        stores.append(TokenStore(tmp_path / f"s{k}", max_open_shards=2))
    for _ in range(2):
        for shard in range(4):
            for k, store in enumerate(stores):
                start, size = 1000 * k + int(store.shard_starts[shard]), store.shard_tokens[shard]
                expected = np.arange(start, start + size)
                tokens = store.read_shard_tokens(shard, 0, size).tokens  # an ArrayRecord reader
                np.testing.assert_array_equal(tokens, expected)
                np.testing.assert_array_equal(store.flat_blocks(shard).read(0, size), expected)
                assert open_shards.pool().open_count() <= 3  # 3 stores x 2 each without it
                assert files_under(tmp_path) <= 2 * 3  # a reader and a sidecar map each
    stores[0].close()  # a closed store's shards leave the pool
    assert open_shards.pool().open_count() <= 2
    for store in stores[1:]:
        store.close()
    assert open_shards.pool().open_count() == 0
    assert files_under(tmp_path) == 0


class Owner:
    """A store's shards as the pool sees them: `evict` closes one (records it)."""

    def __init__(self, closed: list) -> None:
        self.closed = closed

    def evict(self, shard: int) -> bool:
        self.closed.append((self, shard))
        return True


def test_a_steps_shards_marked_together_stay_open_and_the_least_recent_others_close():
    pool, closed = OpenShards(3), []
    a, b = Owner(closed), Owner(closed)
    ka, kb = pool.register(a, max_open=2), pool.register(b, max_open=4)
    for key in ((ka, 0), (ka, 1), (kb, 0)):
        pool.touch(*key)
    pool.touch_many([(kb, 1), (ka, 0)])  # 4 open: the least recent other, a's shard 1, closes
    assert closed == [(a, 1)] and pool.open_count() == 3
    # a's bound is 2, but none of a step's shards closes: b's two least recent do instead
    pool.touch_many([(ka, 2), (ka, 3), (ka, 0)])
    assert closed[1:] == [(b, 0), (b, 1)] and pool.open_count() == 3
    pool.touch(kb, 0)  # the next use closes the least recent, which brings a to its bound
    assert closed[3:] == [(a, 2)] and pool.open_count() == 3


CHILD = """
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))  # before any store opens
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pipeline.store import open_shards
from pipeline.store.token_store import TokenStore
for path in sys.argv[1:]:
    TokenStore(path).read_shard_tokens(0, 0, 1)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], open_shards.pool().limit)
"""


def test_the_soft_limit_is_raised_to_the_hard_one_and_said_once(tmp_path):
    paths = []
    for k in range(2):
        write_synthetic_store(tmp_path / f"s{k}", [[4, 4]], first=100 * k).close()
        paths.append(str(tmp_path / f"s{k}"))

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(open_shards.OPEN_FILES_ENV, None)
    done = subprocess.run([sys.executable, "-c", CHILD, *paths], capture_output=True, text=True,
                          env=env, timeout=120, check=True)  # fmt: skip
    assert done.stdout.split() == ["1024", "256"]
    said = [line for line in done.stderr.splitlines() if line.startswith("open files:")]
    assert said == [
        "open files: raised the soft RLIMIT_NOFILE from 256 to 1,024 (hard limit); at most 256 "
        f"shards stay open at once across all stores (${open_shards.OPEN_FILES_ENV})"
    ]
