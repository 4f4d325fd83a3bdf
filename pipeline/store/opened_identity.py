"""What a store's manifest was when the store was opened, and whether it still is.

A store object serves the store its manifest described at open: one replaced or rewritten since
(`prepare --overwrite`) is refused, never mixed with it. The identity is `store_identity`'s: a
local manifest's (device, inode, size, mtime), one `stat`; a cloud manifest's generation number
and size, one request, shared by the callers that ask at the same moment (a batch's shards).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import Future
from pathlib import Path

from pipeline.errors import StoreError
from pipeline.store.store_files import local_identity, store_identity


class OpenedIdentity:
    """The identity of the manifest of the store at `path` (`manifest_file`), taken when made:
    before the manifest is read, so that a manifest replaced in between reads as replaced."""

    __slots__ = ("_asking", "_lock", "_manifest_file", "_path", "remote", "value")

    def __init__(self, path: Path, manifest_file: str, remote: bool) -> None:
        self._path, self._manifest_file, self.remote = path, manifest_file, remote
        self._lock = threading.Lock()
        self._asking: Future | None = None  # a cloud request in flight, shared
        self.value = self.now()

    def now(self) -> Hashable | None:
        """The manifest's identity now (None: no manifest)."""
        if not self.remote:
            return local_identity(self._manifest_file)
        with self._lock:
            shared = self._asking
            mine = shared is None
            if mine:
                shared = self._asking = Future()
        if mine:
            try:
                shared.set_result(store_identity(self._path))
            except BaseException as error:
                shared.set_exception(error)
            finally:
                with self._lock:
                    self._asking = None
        return shared.result()

    def check(self) -> None:
        """Refuse a store whose manifest is no longer the one seen at open."""
        if self.now() != self.value:
            raise StoreError(
                f"{self._manifest_file}: the store was replaced or changed after it was opened "
                "(by `prepare --overwrite`?); restart the job to read the new store"
            )
