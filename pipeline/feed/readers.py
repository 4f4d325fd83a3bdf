"""The feed's reader threads: persistent threads fed by a queue, one task per step.

A `ThreadPoolExecutor` costs every step a `Future` (a condition variable and its lock), a work
item and a thread-count check in the submitting thread, and the future's hand-over in the
consumer. Here the training thread hands a step out with one `SimpleQueue.put` and takes a
finished one from a dict (taking the lock only to wait); the threads live as long as the feed.

A task runs in whichever thread is free; results are kept by step, so steps are taken in
order whatever order they finish in. `drop` forgets every step handed out so far (a seek): a
thread still reading one finishes it and throws the result away.

`submit` takes objects for the thread to let go of once the task has run (`keep`): the feed
hands over the arrays of the step it served last, so that JAX frees their device buffers here.
Freed in the training thread, each array let the interpreter lock go, a reader thread reading
took it, and the training thread waited to get it back through the reader's own releases of it:
~30 voluntary context switches and ~0.6 ms of CPU a step where both threads had a core at once
(docs/benchmarks.md, "The previous step's arrays, freed in the reader thread").

How many: `reader_count`. A local store's read is a memory-map copy and numpy work that holds
the GIL most of the time, so a second reader mostly takes the GIL from the first (measured in
docs/benchmarks.md, "One reader thread"); a remote store's read waits on ranged GETs, which
other readers overlap.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from pipeline.config.parse import AUTO_THREADS

REMOTE_THREADS = 4
"""`feed.threads: auto`'s count when a store is remote (capped by the prefetch depth)."""
_LIVE: weakref.WeakSet[Readers] = weakref.WeakSet()


@atexit.register
def _join_all() -> None:
    """At interpreter exit, let each unclosed feed's threads finish their step and stop (they
    are daemon threads, so they never hold up the exit of a program that forgot its feed)."""
    for readers in list(_LIVE):
        readers.close(wait=True)


def reader_count(threads: int | str, prefetch: int, remote: bool) -> int:
    """The feed's reader threads: no more than steps in flight (`prefetch`); `auto` is one
    thread when every store is local, `REMOTE_THREADS` when one is in a bucket (`remote`)."""
    if threads == AUTO_THREADS:
        threads = REMOTE_THREADS if remote else 1
    return min(int(threads), prefetch)


class Readers:
    """`count` daemon threads named `name`-0.., each running the tasks handed to `submit`."""

    def __init__(self, count: int, name: str) -> None:
        self._todo: queue.SimpleQueue[tuple[int, int, Callable[[], Any], Any] | None] = (
            queue.SimpleQueue()
        )
        self._done = threading.Condition()
        self._results: dict[int, tuple[bool, Any]] = {}  # step -> (ok, value or exception)
        self._generation = 0  # a task handed out before the last drop() is stale
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()
        _LIVE.add(self)

    def submit(self, step: int, task: Callable[[], Any], keep: Any = None) -> None:
        """Run `task()` for `step` in a reader thread, which lets go of `keep` once it ran."""
        self._todo.put((self._generation, step, task, keep))

    def done(self, step: int) -> bool:
        """Whether `step`'s task has finished (and its result was not yet taken)."""
        return step in self._results

    def finished(self) -> int:
        """How many handed-out steps have finished and wait to be taken."""
        return len(self._results)

    def take(self, step: int) -> Any:
        """`step`'s result, waiting for it; re-raises the exception its task raised."""
        outcome = self._results.pop(step, None)  # finished already: no lock (one consumer)
        if outcome is None:
            with self._done:
                while step not in self._results:
                    self._done.wait()
                outcome = self._results.pop(step)
        ok, value = outcome
        if not ok:
            raise value
        return value

    def drop(self) -> None:
        """Forget every step handed out so far."""
        with self._done:
            self._generation += 1
            self._results.clear()

    def close(self, wait: bool = True) -> None:
        """Stop the threads once their current task ends (joined when `wait`). Idempotent."""
        if not self._closed:
            self._closed = True
            self.drop()
            for _ in self._threads:
                self._todo.put(None)
        if wait:
            current = threading.current_thread()
            for thread in self._threads:
                if thread is not current:
                    thread.join()

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            generation, step, task, keep = item
            del item
            if generation == self._generation:  # else dropped before it started
                try:
                    outcome = (True, task())
                except BaseException as error:  # handed to the consumer, as a Future does
                    outcome = (False, error)
                with self._done:
                    if generation == self._generation:
                        self._results[step] = outcome
                        self._done.notify_all()
                del outcome  # a finished batch is the consumer's alone
            # let go of here, after the hand-over: freeing the arrays lets the interpreter lock
            # go, which the consumer woken for the result takes (freed first, before the
            # result, the consumer waited for the next task's releases instead: 1.12x the CPU)
            del task, keep
