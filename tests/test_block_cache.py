"""The host cache's bound (`block_cache`): once the passes that fills over it make due are done,
the cache holds at most `max_bytes`, least recently used entries deleted first; a fill does not
wait for a pass. On the real disk, no mocks."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.store.block_cache import BlockCache

BOUND = 3000


def entries(root: Path) -> dict[str, int]:
    """{key: bytes} of the cache's entries (not its lock, partial and count files); an entry
    another process's pass deletes while they are listed is not one."""
    found = {}
    for path in root.rglob("*"):
        if path.parent == root or path.suffix in (".lock", ".partial"):
            continue
        try:
            if path.is_file():
                found[str(path.relative_to(root))] = path.stat().st_size
        except FileNotFoundError:
            continue
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
    processes start together), used in any order: after each use and its pass, the entries on
    the disk weigh at most the bound, unless the entry just filled is alone larger: then it is
    the one entry left. Each process counting only its own fills let the host's cache grow to
    the bound times the number of processes."""
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        caches = [BlockCache(root, BOUND) for _ in range(3)]
        for process, key in uses:
            name = f"shards/{key}"
            path = fill(caches[process], name, sizes[key])
            assert path.read_bytes() == name.encode()[-1:] * sizes[key]
            assert BlockCache.settle()
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
    assert BlockCache.settle()
    assert entries(root) == {"shards/a": 1000, "shards/c": 1000, "shards/d": 500}
    fill(cache, "shards/e", 4000)  # alone over the bound: all the others go
    assert BlockCache.settle()
    assert entries(root) == {"shards/e": 4000}
    used("shards/e", 10)
    fill(cache, "shards/f", 100)
    assert BlockCache.settle()
    assert entries(root) == {"shards/f": 100}


def count_and_disk(root: Path) -> tuple[int, int]:
    """The host's count and the bytes of the entries on the disk, read with the count's lock
    held (no fill renames in meanwhile; a pass may only delete)."""
    with open(root / ".total", "rb") as counted:
        fcntl.flock(counted, fcntl.LOCK_EX)
        return int(counted.read()), sum(entries(root).values())


def _fill_many(root: str, first: int) -> None:
    """Fill 30 entries of 50 to 400 bytes into the cache at `root` (a process of the host),
    checking after each that the count is not below the bytes on the disk."""
    cache = BlockCache(Path(root), BOUND)
    sizes = random.Random(first)
    for key in range(first, first + 30):
        fill(cache, f"shards/{key}", sizes.randint(50, 400))
        count, disk = count_and_disk(Path(root))
        assert count >= disk, (key, count, disk)


def test_a_pass_that_raises_does_not_stop_the_passes_after_it(tmp_path, monkeypatch):
    """A pass that fails in a way no one foresaw ends its thread, not the process's eviction:
    the next fill over the bound runs a pass, and the cache is within its bound again."""
    root = tmp_path / "cache"
    cache = BlockCache(root, BOUND)
    passes = BlockCache._pass

    def failing(self: BlockCache, keep: Path) -> None:
        monkeypatch.setattr(BlockCache, "_pass", passes)  # once
        raise RuntimeError("an unforeseen failure")

    monkeypatch.setattr(BlockCache, "_pass", failing)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # its traceback: expected
    for key in ("shards/a", "shards/b", "shards/c", "shards/d"):
        fill(cache, key, 1000)  # d takes it over: its pass fails
    assert BlockCache.settle(timeout_s=30)
    assert len(entries(root)) == 4
    fill(cache, "shards/e", 1000)
    assert BlockCache.settle(timeout_s=30)
    assert sum(entries(root).values()) <= BOUND


def test_processes_filling_one_cache_at_once_keep_it_counted_high_and_within_its_bound(tmp_path):
    """Three processes fill one cache at the same time, ~6700 bytes each into a bound of 3000,
    their passes racing their fills: the count, read after any fill, is never below the bytes on
    the disk, and once they are done the cache is within its bound."""
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_fill_many, args=(str(tmp_path), k * 100)) for k in (0, 1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    count, disk = count_and_disk(tmp_path)
    assert 0 < disk <= count
    fill(BlockCache(tmp_path, BOUND), "shards/last", 2 * BOUND)  # a pass with no fill racing it
    assert BlockCache.settle()
    assert entries(tmp_path) == {"shards/last": 2 * BOUND}


class _PausedPass(BlockCache):
    """A cache whose pass stops after its first deletion until `resume` is set (the test's
    stand-in for a pass over millions of entries)."""

    def __init__(
        self, root: Path, paused: Event | threading.Event, resume: Event | threading.Event
    ) -> None:
        super().__init__(root, BOUND)
        self.paused, self.resume = paused, resume

    def _delete(self, path: str) -> None:
        super()._delete(path)
        if not self.paused.is_set():
            self.paused.set()
            self.resume.wait(timeout=60)


def _pass_paused(root: str, paused: Event, resume: Event, exit_mid_pass: bool = False) -> None:
    """Fill the entry that takes the cache at `root` over its bound; its pass pauses. The
    process waits for its pass, or (`exit_mid_pass`) exits once it has paused."""
    fill(_PausedPass(Path(root), paused, resume), "shards/over", 1000)
    assert paused.wait(timeout=60) if exit_mid_pass else BlockCache.settle()


def pass_lock_held(root: Path) -> bool:
    """Whether a process of the host holds the pass lock (taken and let go if not)."""
    with open(root / ".pass", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


def full_cache(root: Path) -> None:
    """A cache at its bound: 3 entries of 1000 bytes."""
    cache = BlockCache(root, BOUND)
    for key in "abc":
        fill(cache, f"shards/{key}", 1000)


@pytest.fixture
def paused_pass(tmp_path):
    """A cache at its bound whose next fill, by another process, runs a pass paused after its
    first deletion: (root, the process, the event that resumes it)."""
    full_cache(tmp_path)
    spawn = multiprocessing.get_context("spawn")
    paused, resume = spawn.Event(), spawn.Event()
    process = spawn.Process(target=_pass_paused, args=(str(tmp_path), paused, resume))
    process.start()
    try:
        assert paused.wait(timeout=60)
        yield tmp_path, process, resume
    finally:
        if process.exitcode is None:  # not if killed mid-wait: setting would wait for it to wake
            resume.set()
        process.join(timeout=60)
        if process.exitcode is None:
            process.kill()


def test_a_fill_does_not_wait_for_a_pass_of_another_process(paused_pass):
    """While another process's pass is under way (scan done, deleting), a fill that takes the
    cache over its bound again completes: it neither waits for the count's lock held by the
    pass, nor for the pass lock (its own pass, due, waits for it). The pass then sets the count
    high, never low, and over the bound still (by the racing fill): the racing fill's pass, run
    after it, brings the cache within its bound; skipped, it left the cache over it."""
    root, process, resume = paused_pass
    done = threading.Event()

    def racing() -> None:
        fill(BlockCache(root, BOUND), "shards/racing", 1500)  # 5500 counted: over the bound
        done.set()

    filler = threading.Thread(target=racing, daemon=True)
    filler.start()
    filler.join(timeout=60)
    assert done.is_set() and pass_lock_held(root) and process.is_alive()
    count, disk = count_and_disk(root)
    assert count >= disk
    resume.set()
    process.join(timeout=60)
    assert process.exitcode == 0 and BlockCache.settle() and not pass_lock_held(root)
    count, disk = count_and_disk(root)
    assert count >= disk  # the paused pass left c, over and racing: 3500; the next took c
    assert entries(root) == {"shards/over": 1000, "shards/racing": 1500}
    fill(BlockCache(root, BOUND), "shards/next", BOUND)
    assert BlockCache.settle()
    assert entries(root) == {"shards/next": BOUND}


def test_a_process_killed_mid_pass_leaves_the_cache_usable_and_counted_high(paused_pass):
    """kill -9 of a process mid-pass releases the pass lock with it and leaves the count high,
    never low; the next fill over the bound runs a pass that brings the cache within it."""
    root, process, _ = paused_pass
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=60)
    assert not pass_lock_held(root)
    count, disk = count_and_disk(root)
    assert count >= disk and disk < count
    fill(BlockCache(root, BOUND), "shards/after", 1500)
    assert BlockCache.settle()
    assert sum(entries(root).values()) <= BOUND and "shards/after" in entries(root)
    count, disk = count_and_disk(root)
    assert count >= disk


def test_a_process_that_exits_mid_pass_leaves_the_count_high(tmp_path):
    """The pass thread is a daemon: a process that exits while its pass runs (paused here) does
    not wait for it, and leaves the pass lock free and the count high, never low."""
    full_cache(tmp_path)
    spawn = multiprocessing.get_context("spawn")
    paused, resume = spawn.Event(), spawn.Event()
    process = spawn.Process(target=_pass_paused, args=(str(tmp_path), paused, resume, True))
    process.start()
    process.join(timeout=30)
    if process.exitcode is None:  # waited for its pass
        resume.set()
        process.join(timeout=60)
    assert process.exitcode == 0 and paused.is_set() and not resume.is_set()
    assert not pass_lock_held(tmp_path)
    count, disk = count_and_disk(tmp_path)
    assert count == 4000 and disk == 3000  # one entry deleted, the count not set


def own_pass_paused(root: Path) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """A cache at `root` at its bound (a, b, c: 1000 bytes each, least recently used first) and
    a fill of this process, in a thread, that takes it over: (the fill's thread, the event set
    once its pass has paused after its first deletion, the event that resumes it)."""
    plain = BlockCache(root, BOUND)
    for ago, key in zip((40, 30, 20), "abc", strict=True):
        fill(plain, f"shards/{key}", 1000)
        os.utime(root / "shards" / key, (time.time() - ago,) * 2)
    paused, resume = threading.Event(), threading.Event()
    cache = _PausedPass(root, paused, resume)
    filler = threading.Thread(target=fill, args=(cache, "shards/over", 1000), daemon=True)
    filler.start()
    return filler, paused, resume


@pytest.fixture
def own_paused_pass(tmp_path):
    """`own_pass_paused`: (root, the fill's thread, paused, resume); resumed and settled after."""
    filler, paused, resume = own_pass_paused(tmp_path)
    try:
        yield tmp_path, filler, paused, resume
    finally:
        resume.set()
        assert BlockCache.settle()


def test_a_fill_that_takes_the_cache_over_returns_while_its_pass_runs(own_paused_pass):
    """The fill that takes the count over the bound returns while its pass (paused here, as one
    over millions of entries takes seconds) is still running in the background; the cache is
    above its bound meanwhile, and within it once the pass is done."""
    root, filler, paused, resume = own_paused_pass
    filler.join(timeout=30)
    assert not filler.is_alive() and paused.wait(timeout=30) and pass_lock_held(root)
    assert sum(entries(root).values()) == 3000  # a deleted; b next, once resumed
    resume.set()
    assert BlockCache.settle()
    assert entries(root) == {"shards/c": 1000, "shards/over": 1000}


def test_a_fill_over_the_bound_while_a_pass_runs_gets_a_pass_after_it(own_paused_pass):
    """A fill that takes the cache over its bound again while this process's pass runs (after
    its scan) is not lost: another pass runs after it and brings the cache within its bound.
    Skipping it (the pass lock was held) left the cache over its bound until some later fill."""
    root, _, paused, resume = own_paused_pass
    assert paused.wait(timeout=30)
    fill(BlockCache(root, BOUND), "shards/more", 1500)  # the first pass leaves c, over, more
    resume.set()
    assert BlockCache.settle() and not pass_lock_held(root)
    assert entries(root) == {"shards/over": 1000, "shards/more": 1500}
    count, disk = count_and_disk(root)
    assert count >= disk


def _fill_over_and_settle(root: str) -> None:
    """In a child forked mid-pass: a fill over the bound, whose pass must run once the parent's
    is done (the child has no pass thread, and must not hold the parent's pass lock)."""
    fill(BlockCache(Path(root), BOUND), "shards/child", 2000)
    assert BlockCache.settle(timeout_s=30)


def _fork_mid_pass(root: str) -> None:
    """Fork a child (`_fill_over_and_settle`) while this process's pass is paused, then resume
    it. Run in a process of its own: the test's may have started JAX's threads, and a fork of
    that process could deadlock."""
    _, paused, resume = own_pass_paused(Path(root))
    assert paused.wait(timeout=30)
    child = multiprocessing.get_context("fork").Process(target=_fill_over_and_settle, args=(root,))
    child.start()
    resume.set()
    child.join(timeout=60)
    assert child.exitcode == 0 and BlockCache.settle()


def test_a_child_forked_mid_pass_runs_its_own_passes_and_holds_no_pass_lock(tmp_path):
    """A process forked while its parent's pass thread runs (and holds the host's pass lock)
    starts its own pass thread, and lets go of its copy of the lock's descriptor: else the
    child thinks a pass thread runs, and its copy holds the host's pass lock for its life."""
    spawn = multiprocessing.get_context("spawn")
    parent = spawn.Process(target=_fork_mid_pass, args=(str(tmp_path),))
    parent.start()
    parent.join(timeout=120)
    assert parent.exitcode == 0
    assert sum(entries(tmp_path).values()) <= BOUND and not pass_lock_held(tmp_path)


class _PausedCount(BlockCache):
    """A cache whose first count (a fill's: the entry's lock and the host's count lock held)
    stops until `resume` is set."""

    def __init__(self, root: Path, paused: threading.Event, resume: threading.Event) -> None:
        super().__init__(root, BOUND)
        self.paused, self.resume = paused, resume

    def _count(self, descriptor: int) -> int:
        if not self.paused.is_set():
            self.paused.set()
            self.resume.wait(timeout=60)
        return super()._count(descriptor)


def _fill_two(root: str) -> None:
    """In a child forked mid-fill: a fill of another entry (it takes the host's count lock), and
    the parent's entry filled again (its lock)."""
    cache = BlockCache(Path(root), BOUND)
    fill(cache, "shards/child", 100)
    cache.get_file("shards/parent", lambda partial: partial.write_bytes(b"t" * 100), bool, True)


def _fork_mid_fill(root: str) -> None:
    """Fork a child (`_fill_two`) while a thread of this process fills an entry, its count
    paused, then resume that fill. In a process of its own, as `_fork_mid_pass`."""
    paused, resume = threading.Event(), threading.Event()
    cache = _PausedCount(Path(root), paused, resume)
    filler = threading.Thread(target=fill, args=(cache, "shards/parent", 100), daemon=True)
    filler.start()
    assert paused.wait(timeout=30)
    child = multiprocessing.get_context("fork").Process(target=_fill_two, args=(root,))
    child.start()
    resume.set()
    filler.join(timeout=30)
    child.join(timeout=30)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0 and not filler.is_alive()


def test_a_child_forked_mid_fill_holds_none_of_the_hosts_locks(tmp_path):
    """A process forked while a thread of its parent fills an entry (the entry's lock and the
    host's count lock held) fills entries, that one too: its copies of the locks' descriptors
    held both locks for the child's life, so every fill of the host waited for the child."""
    spawn = multiprocessing.get_context("spawn")
    parent = spawn.Process(target=_fork_mid_fill, args=(str(tmp_path),))
    parent.start()
    parent.join(timeout=120)
    assert parent.exitcode == 0
    assert entries(tmp_path) == {"shards/parent": 100, "shards/child": 100}
    count, disk = count_and_disk(tmp_path)
    assert count >= disk == 200 and not pass_lock_held(tmp_path)
