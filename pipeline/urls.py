"""Locations a user may give as a URL (`gs://bucket/x`) or as a local path.

`pathlib.Path("gs://b/x")` silently becomes the relative path `gs:/b/x`, so a URL must be
recognised before anything turns it into a `Path`. URLs are read and written through
`etils.epath` (the library Orbax uses, which reaches Cloud Storage through `gcsfs`), whose
paths have the `pathlib` interface: `location` gives one or the other and the rest of the code
joins, reads and lists them alike. What `etils.epath` has no call for (an object's generation
number, a copy inside the store, a batched delete) goes to the same `gcsfs` instance. ArrayRecord
opens `gs://` shards with its own reader.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import socket
import threading
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pipeline.errors import StoreError, UnreachableError
from pipeline.extras import require

# A scheme followed by ":/" also catches a URL that a Path already collapsed ("gs:/b/x").
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]+:/")
_COPY_BLOCK = 16 << 20  # a streamed copy holds at most this much of a shard in memory
_CONNECT_TIMEOUT_S = 5.0
_reached: set[tuple[str, int]] = set()  # endpoints this process has connected to once
# Connections the Cloud Storage client of this process holds at once (aiohttp's default is 100):
# room for two stages of `remote_reads.together` at their widest (`remote_reads.PARALLEL`), so a
# stage's requests never queue for a connection, even beside another reader's or fetch-ahead's.
CONNECTIONS = 512
_pool_lock = threading.Lock()


def is_url(location: str | os.PathLike) -> bool:
    """True for `gs://...`, `s3://...` and the like (and their Path-mangled `gs:/...` form)."""
    return bool(_URL.match(os.fspath(location)))


def location(value: str | os.PathLike) -> Any:
    """A `pathlib.Path` for a local path, an `etils.epath.Path` for a URL (a `pathlib`-like
    path whose str() is the URL again). Typed Any: the two classes share an interface, no base."""
    if not is_url(value):  # a Path is kept, not parsed again (~10 us: a store's open asks)
        return value if isinstance(value, Path) else Path(value)
    from etils import epath

    text = os.fspath(value)
    if not re.match(r"^[^:]+://", text):  # undo the "gs:/b/x" a Path made of "gs://b/x"
        text = text.replace(":/", "://", 1)
    if text.startswith("gs://"):  # etils.epath reaches Cloud Storage only through gcsfs
        require("gcsfs", "gcs", f"{text}: Cloud Storage")
    return epath.Path(text)


def check_reachable(url: Any) -> None:
    """Stop in seconds, with one line, when the Cloud Storage endpoint of a gs:// URL cannot be
    connected to at all (no network, a wrong STORAGE_EMULATOR_HOST): gcsfs would retry each
    request with backoff for about 35 s and end in a traceback of its internals. One TCP
    connection per endpoint and process; transient failures later are gcsfs's to retry."""
    text = str(url)
    if not text.startswith("gs://"):
        return
    # gcsfs's endpoint: STORAGE_EMULATOR_HOST (with or without a scheme), else Google's
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST", "") or "default"
    if endpoint == "default":
        endpoint = "https://storage.googleapis.com"
    elif "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if (host, port) in _reached:
        return
    try:
        socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        raise UnreachableError(
            f"{text}: cannot connect to Cloud Storage at {host}:{port} ({reason}); check the "
            "network (or STORAGE_EMULATOR_HOST for an emulator)"
        ) from None
    _reached.add((host, port))


def read_local(path: str, checked: bool = False) -> bytes:
    """A local file's bytes, by plain system calls (a shard's first use reads three small
    files: `pathlib` and buffered I/O cost more than the reads). Read in chunks of at least
    64 KiB, shrunk to the file: an exact-size read of a small file puts the bytes an open
    shard keeps (its indexes) in Python's small-object pools among short-lived objects, which
    then stay mapped: +28 MB of RSS at 256 sources of 8 shards (docs/benchmarks.md).
    `checked`: the caller compares the bytes with a digest (a store's manifest and small
    files), so a first read shorter than asked is taken as the end of the file, without the
    read that confirms it (a system call, ~1-2 us, three a shard's first use): a regular file
    reads short only at its end, and bytes cut short otherwise fail the digest."""
    fd = os.open(path, os.O_RDONLY)
    try:  # to its end: a file that grew since the fstat, a pipe or /proc file (of size 0)
        parts = [os.read(fd, 1 << 16)]  # a small file: no `fstat` (a system call, ~1 us)
        if checked and len(parts[0]) < 1 << 16:
            return parts[0]
        chunk = 1 << 16 if len(parts[0]) < 1 << 16 else max(os.fstat(fd).st_size, 1 << 16)
        while parts[-1] and (data := os.read(fd, chunk)):
            parts.append(data)
    finally:
        os.close(fd)
    return parts[0] if len(parts) == 1 else b"".join(parts)  # one part: not copied


def read_bytes(url: str) -> bytes:
    """The bytes at a URL or local path; OSError (with the URL) when it cannot be read."""
    if not is_url(url):
        return read_local(url)
    check_reachable(url)
    try:
        return location(url).read_bytes()
    except OSError:
        raise
    except Exception as error:  # a missing backend (gcsfs) or a cloud error
        raise OSError(f"{type(error).__name__}: {error}") from error


def cache_directory(variable: str, name: str) -> Path | None:
    """A host cache's directory: `$variable`, else `$XDG_CACHE_HOME/pipeline/NAME` (default
    `~/.cache`); None when `$variable` is `off`."""
    value = os.environ.get(variable, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "pipeline" / name


def cache_entries(directory: Path, name: re.Pattern[str]) -> list[tuple[int, int, Path]]:
    """A host cache's entries (the files of `directory` whose name is `name`), least recently
    used first: (last use, size, path); one removed by another process meanwhile is left out."""
    entries = []
    for path in directory.iterdir():
        if name.fullmatch(path.name):
            with suppress(FileNotFoundError):
                stat = path.stat()
                entries.append((stat.st_mtime_ns, stat.st_size, path))
    return sorted(entries)


def write_atomically(path: Any, data: bytes) -> None:
    """Replace the file or object at `path` with `data`, so that a reader sees the old bytes or
    the new, never a part: a local file is written beside it and renamed over it; a cloud
    object is one upload, which Cloud Storage makes visible only once it is complete. The local
    partial file's name is unique per call (pid and a random tag), so threads of one process
    writing the same path at once never rename or remove each other's."""
    if is_url(path):
        location(path).write_bytes(data)
        return
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def object_version(url: Any) -> tuple[int, int] | None:
    """(generation, size) of a cloud object, None when there is none. Cloud Storage gives every
    write of an object a new generation number: what an inode and mtime are to a local file.
    A backend that gives none (not Cloud Storage) is refused: a constant stand-in would let a
    same-size replacement go unnoticed, and shard readers read `gs://b/o#GENERATION`."""
    fs, path = _filesystem(url)
    fs.invalidate_cache(path)  # asked of the server, never of a listing this process cached
    try:
        # one request: `_info` also lists the name as a prefix, a second request to storage
        info = bounded(url, getattr(fs, "_get_object", fs._info), path)
    except FileNotFoundError:
        return None
    if not info.get("generation"):
        raise StoreError(
            f"{url}: the object store gives no generation number, so a replaced object "
            "could not be detected; keep stores on local disk or in Cloud Storage (gs://)"
        )
    return int(info["generation"]), int(info["size"])


REQUEST_TIMEOUT_S = [60.0]
"""The limit on one request to object storage (`feed.read_timeout_s`, set by
`remote_reads.configure`), retries included."""


def storage_endpoint() -> str:
    """The Cloud Storage endpoint gcsfs talks to, for messages."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"


def bounded(url: Any, call: Any, *args: Any, **kwargs: Any) -> Any:
    """`await call(*args, **kwargs)` (a coroutine function of `url`'s fsspec filesystem) on the
    filesystem's loop, answered within `REQUEST_TIMEOUT_S` or refused with one line naming the
    URL and the endpoint: a bucket that does not answer never hangs the caller."""
    import fsspec.asyn

    fs, _ = _filesystem(url)
    timeout = REQUEST_TIMEOUT_S[0]
    try:
        return fsspec.asyn.sync(fs.loop, call, *args, timeout=timeout, **kwargs)
    except fsspec.asyn.FSTimeoutError:
        raise UnreachableError(
            f"{url}: no answer from Cloud Storage at {storage_endpoint()} within {timeout:g} s "
            "(feed.read_timeout_s); check the network"
        ) from None


def copy_file(source: Any, destination: Any) -> None:
    """Copy one file between any two locations (local disk and Cloud Storage alike): streamed
    through this machine, except between two cloud objects, which the store copies itself
    (Beam's commit of a whole bucket store then moves no shard bytes through one worker)."""
    if is_url(source) and is_url(destination):  # etils.epath would stream it
        fs, path = _filesystem(source)
        fs.copy(path, _filesystem(destination)[1])
        return
    with source.open("rb") as reader, destination.open("wb") as writer:
        shutil.copyfileobj(reader, writer, _COPY_BLOCK)


def list_files(url: str) -> list[str] | None:
    """The objects a URL names, as URLs in sorted order, from one listing: the object itself,
    every object under a prefix (`gs://b/dir`), or every object a glob matches (`*`, `?`,
    `[..]`, `**` for any depth). None when nothing is there (a glob that matches nothing is
    an empty list)."""
    fs, path = _filesystem(url)
    scheme = str(location(url)).split("://", 1)[0]
    if glob.has_magic(path):
        found = fs.glob(path, detail=True)
    else:
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        found = fs.find(path, detail=True) if info["type"] == "directory" else {path: info}
    return sorted(f"{scheme}://{name}" for name, info in found.items() if info["type"] == "file")


def clear_prefix(url: Any, keep: str) -> None:
    """Delete every object under a URL prefix except `url / keep`, in batched requests."""
    fs, root = _filesystem(url)
    kept = f"{root.rstrip('/')}/{keep}"
    doomed = [path for path in fs.find(root) if path != kept]
    if doomed:
        fs.rm(doomed)


def _filesystem(url: Any) -> tuple[Any, str]:
    """The fsspec filesystem (gcsfs for gs://) that etils.epath reads a URL with, and the
    URL's path in it: the same instance, so its listing cache sees every write of ours."""
    from etils.epath.backend import fsspec_backend

    text = str(location(url))
    check_reachable(text)
    fs = fsspec_backend.fs(text)
    _pool(fs)
    return fs, fs._strip_protocol(text)


def _pool(fs: Any) -> None:
    """Give this process's gcsfs client a pool of `CONNECTIONS` connections: with aiohttp's
    default of 100, a stage of more requests than that (the identities of 130 sources) would
    take two round trips. A client not connected yet gets a pool of that size; one that another
    caller connected first (etils.epath, Orbax) has its pool's limit raised. A client that
    presents a client certificate builds its own pool when it connects, raised afterwards."""
    if not hasattr(fs, "session_kwargs"):
        return  # not gcsfs
    session = getattr(fs, "_session", None)
    connector = getattr(session, "connector", None)
    if connector is not None:
        if 0 < connector.limit < CONNECTIONS:
            connector._limit = CONNECTIONS  # aiohttp reads it at each acquire; it has no setter
        return
    if session is not None or getattr(fs, "_use_client_cert", False):
        return  # closed, or it will build its own pool (raised after it connects)
    import aiohttp

    with _pool_lock:
        if fs._session is None and "connector" not in fs.session_kwargs:
            connector = aiohttp.TCPConnector(loop=fs.loop, limit=CONNECTIONS)
            fs.session_kwargs = {**fs.session_kwargs, "connector": connector}


def remove_tree(path: Any) -> None:
    """Delete a directory or a URL prefix and everything under it; a missing one is fine."""
    if is_url(path):
        check_reachable(path)
        if path.exists():
            path.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)
