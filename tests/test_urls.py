"""Writes that readers see whole, and the versions that tell a replaced cloud object."""

from __future__ import annotations

import threading
from pathlib import Path

from pipeline.urls import write_atomically

WRITERS, WRITES = 8, 20


def test_threads_writing_one_path_at_once_each_write_it_whole(tmp_path: Path) -> None:
    """Feeds' reader threads share a process: concurrent writers of one path must not take
    each other's partial file (one renaming it away, another then failing or renaming a half)."""
    path = tmp_path / "ledger.json"
    contents = [bytes([writer]) * (16 << 10) for writer in range(WRITERS)]
    start, errors = threading.Barrier(WRITERS), []

    def write(data: bytes) -> None:
        start.wait()
        try:
            for _ in range(WRITES):
                write_atomically(path, data)
        except Exception as error:  # every writer's failure is reported, not just the first
            errors.append(error)

    threads = [threading.Thread(target=write, args=(data,)) for data in contents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert path.read_bytes() in contents
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no partial file left
