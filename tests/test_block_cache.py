"""The host cache's bound (`block_cache`): after every fill, of any process, the cache holds at
most `max_bytes`, least recently used entries deleted first. On the real disk, no mocks."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.store.block_cache import BlockCache

BOUND = 3000


def entries(root: Path) -> dict[str, int]:
    """{key: bytes} of the cache's entries (not its lock, partial and count files)."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and path.parent != root and path.suffix not in (".lock", ".partial"):
            found[str(path.relative_to(root))] = path.stat().st_size
    return found


def fill(cache: BlockCache, key: str, size: int) -> Path:
    """The file entry `key` of `size` bytes (its content a function of the key, as the cache's
    content-addressed keys are), filled unless the cache holds it."""
    data = key.encode()[-1:] * size
    return cache.get_file(key, lambda partial: partial.write_bytes(data), lambda path: True)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2 * BOUND), min_size=6, max_size=6),
    uses=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=30),
)
def test_after_every_fill_of_any_process_the_cache_holds_at_most_its_bound(sizes, uses):
    """Three processes' caches on one directory (each its own object, made before any fill, as
    processes start together), used in any order: after each use, the entries on the disk
    weigh at most the bound, unless the entry just filled is alone larger: then it is the one
    entry left. Each process counting only its own fills let the host's cache grow to the
    bound times the number of processes."""
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        caches = [BlockCache(root, BOUND) for _ in range(3)]
        for process, key in uses:
            name = f"shards/{key}"
            path = fill(caches[process], name, sizes[key])
            assert path.read_bytes() == name.encode()[-1:] * sizes[key]
            held = entries(root)
            assert sum(held.values()) <= BOUND or held == {name: sizes[key]}, held


def test_a_pass_deletes_the_least_recently_used_and_keeps_the_entry_just_filled(tmp_path):
    """Least recently used first (a read refreshes an entry), down to 90 % of the bound; the
    entry just filled is kept even when it alone is over the bound, and is the first to go at
    the next pass once it is the least recently used."""
    root = tmp_path / "cache"
    cache = BlockCache(root, BOUND)

    def used(key: str, seconds_ago: float) -> None:
        past = time.time() - seconds_ago
        os.utime(root / key, (past, past))

    for key in ("shards/a", "shards/b", "shards/c"):
        fill(cache, key, 1000)  # 3000 bytes: at the bound, not over it
    fill(cache, "shards/a", 1000)  # a read: a is the most recently used
    for key, ago in (("shards/b", 30), ("shards/c", 20), ("shards/a", 10)):
        used(key, ago)
    fill(cache, "shards/d", 500)  # 3500: deleted down to <= 2700, b first
    assert entries(root) == {"shards/a": 1000, "shards/c": 1000, "shards/d": 500}
    fill(cache, "shards/e", 4000)  # alone over the bound: all the others go
    assert entries(root) == {"shards/e": 4000}
    used("shards/e", 10)
    fill(cache, "shards/f", 100)
    assert entries(root) == {"shards/f": 100}


def _fill_many(root: str, first: int) -> None:
    """Fill 20 entries of 300 bytes into the cache at `root` (a process of the host)."""
    cache = BlockCache(Path(root), BOUND)
    for key in range(first, first + 20):
        fill(cache, f"shards/{key}", 300)


def test_processes_filling_one_cache_at_once_leave_it_within_its_bound(tmp_path):
    """Two processes fill one cache at the same time, 6000 bytes each into a bound of 3000:
    their fills and passes share one count of the host's bytes (under its lock)."""
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_fill_many, args=(str(tmp_path), k * 100)) for k in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    held = entries(tmp_path)
    assert 0 < sum(held.values()) <= BOUND
