"""Locks that the processes of a host share (`fcntl.flock` of a file), let go of by forked
children.

A flock belongs to the open file, not to the process: a child forked while a thread of its
parent has a lock file open (holding its lock, or waiting for it) gets a copy of the descriptor,
and the lock is let go only once every copy is closed. The child never runs that thread, so it
would hold the lock for its life, and every process of the host that takes it (its own fills
too) would wait for the child. So lock files are opened here, and a forked child points its
copies at `/dev/null` at once (not closed: a copy's number stays taken, should the parent's
thread's frame ever close it in the child); the parent's thread lets go of the lock as usual.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_lock = threading.Lock()  # held to open or close a lock file, and by a fork: none half done
_open: set[int] = set()  # this process's lock files' descriptors, open


@contextlib.contextmanager
def locked(path: Path) -> Iterator[int]:
    """The file at `path` (made if missing), open and locked, waited for, until the block ends
    (or the process dies)."""
    with _lock:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        _open.add(descriptor)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield descriptor
    finally:
        with _lock:
            _open.discard(descriptor)
            os.close(descriptor)


def _forked() -> None:
    """In a forked child: let go of the copies of the parent's open lock files."""
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in _open:
        os.dup2(null, descriptor, inheritable=False)
    os.close(null)
    _open.clear()
    _lock.release()


os.register_at_fork(before=_lock.acquire, after_in_parent=_lock.release, after_in_child=_forked)
