"""Prepare's worker processes: a spawned pool that receives its function once and keeps a
bounded number of tasks in flight, with each worker's tokenizer given its share of the CPUs."""

from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerPool:
    """`function` over items in this process, or an ordered map over a spawned pool (safe
    beside JAX) with at most two tasks per worker in flight, so that reading stays a few
    tasks ahead of the workers, not the whole input ahead (`imap`); and any other calls on the
    same pool (`starmap`: the shard writes, without starting workers a second time). The
    pool's workers receive `function` once, when they start: a task carries only its items.
    (A function sent with every task was unpickled per chunk of 32 documents, and a tokenizer
    unpickles by loading its file again: with a 32k BPE, 2 workers spent 4.6x the CPU of 1.)

    Each worker's tokenizer gets its share of the CPUs for its own threads (`tokenizer_threads`):
    without it every worker's `encode_batch` started a thread per CPU."""

    def __init__(self, workers: int, function: Callable[[Any], Any]) -> None:
        self.workers = workers
        self.function = function
        self.pool: Any = None

    def __enter__(self) -> WorkerPool:
        if self.workers > 1:
            threads = tokenizer_threads(self.workers)
            self.pool = multiprocessing.get_context("spawn").Pool(
                self.workers, initializer=_install, initargs=(self.function, threads)
            )
        return self

    def imap(self, items: Iterable[Any]) -> Iterator[Any]:
        """`function` of each item, in order."""
        if self.pool is None:
            yield from map(self.function, items)
            return
        pending: collections.deque[Any] = collections.deque()
        for item in items:
            pending.append(self.pool.apply_async(_call_installed, (item,)))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    def starmap(self, function: Callable[..., T], arguments: list[tuple[Any, ...]]) -> list[T]:
        """`function(*args)` for each of `arguments`, in order, one call per task; the first
        exception a call raises is raised here."""
        if self.pool is None:
            return [function(*args) for args in arguments]
        return self.pool.starmap(function, arguments, chunksize=1)

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def tokenizer_threads(workers: int) -> int:
    """The threads each of `workers` processes gives its tokenizer: this process's CPUs
    shared out, at least one."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // workers)


_installed: list[Callable[[Any], Any]] = []  # in a pool worker: the function `WorkerPool` sent


def _install(function: Callable[[Any], Any], threads: int) -> None:
    """A pool worker's start: keep `function`, and cap the tokenizer's threads (HF `tokenizers`
    starts its thread pool on the first `encode_batch`, after this) unless the user set them."""
    _installed[:] = [function]
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    if threads == 1:  # one thread: encode on the calling one, no pool to hand work to
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _call_installed(item: Any) -> Any:
    return _installed[0](item)
