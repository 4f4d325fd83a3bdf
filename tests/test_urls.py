"""Writes that readers see whole, and the versions that tell a replaced cloud object."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import fsspec.asyn
import pytest

from pipeline import urls
from pipeline.errors import StoreError
from pipeline.store.store_files import store_identity
from pipeline.urls import location, write_atomically

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


class _NoGenerations(fsspec.asyn.AsyncFileSystem):
    """An asynchronous fsspec filesystem (as s3fs and gcsfs are) whose objects have a size and
    an etag but no generation number (the Cloud Storage emulator always gives one, so it cannot
    serve this case)."""

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return {"name": path, "size": 10, "etag": "abc"}


def test_a_store_whose_objects_have_no_generation_is_refused(monkeypatch) -> None:
    """A constant stand-in generation would make a same-size replacement look unchanged."""
    monkeypatch.setattr(urls, "_filesystem", lambda url: (_NoGenerations(), str(url)))
    # the object's own line, not wrapped as a metadata request that failed (store_files)
    refused = r"^gs://b/web/manifest.json: the object store gives no generation number"
    with pytest.raises(StoreError, match=refused):
        store_identity(location("gs://b/web"))


def test_a_local_read_reads_to_the_end_whatever_the_size_the_file_reports(tmp_path: Path) -> None:
    """`read_bytes` of a local path (manifests, configs, a shard's indexes) reads by plain system
    calls sized by `fstat`: a file of size 0 that has bytes (a pipe, a /proc file) and a file
    larger than one read are read whole, an empty file is empty, a missing one is an OSError."""
    read, write = os.pipe()
    os.write(write, b"seq_len: 8\n")
    os.close(write)
    try:
        assert urls.read_bytes(f"/dev/fd/{read}") == b"seq_len: 8\n"
    finally:
        os.close(read)
    assert urls.read_bytes("/proc/self/cmdline") == Path("/proc/self/cmdline").read_bytes()
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * 4099)
    assert urls.read_bytes(str(big)) == big.read_bytes()
    for size in (1, 100, 1 << 16, (1 << 16) + 1):  # one read of its size and one byte more
        (tmp_path / "small").write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        assert urls.read_bytes(str(tmp_path / "small")) == (tmp_path / "small").read_bytes()
    (tmp_path / "empty").write_bytes(b"")
    assert urls.read_bytes(str(tmp_path / "empty")) == b""
    with pytest.raises(FileNotFoundError):
        urls.read_bytes(str(tmp_path / "missing"))
