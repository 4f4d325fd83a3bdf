"""The stores a plan reads: one home for their metadata and the ones opened so far.

A plan is computed from store metadata (`StoreMeta`) alone; a store's files are opened only
when a row layout needs them (a best-fit packing reads the document index) or a row is read.
`StoreSet` keeps both by content fingerprint, opens each store once (reader threads of one step
may ask at once) at the path its metadata was read from, and refuses a store whose content
changed since (`open_at`). The plan layer reaches stores only through it, as an injected
opener (`StoreSet.open`). A feed's set opens through `shared_stores.acquire` (`opener`), so a
big mixture's restore opens only the stores its steps draw, each at its first draw, shared with
the process's other feeds, and hands a store it opened and refused back through `release`
(`shared_stores.release`: another feed may hold the same store, so it cannot simply close it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.errors import StoreError
from pipeline.store.formats import AnyStore, open_store
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore


class StoreSet:
    """Stores by content fingerprint: metadata of each, and those opened so far."""

    def __init__(
        self,
        stores: Iterable[AnyStore | StoreMeta] = (),
        *,
        check_reads: bool = True,
        opener: Callable[..., AnyStore] = open_store,
        release: Callable[[AnyStore], None] | None = None,
    ) -> None:
        self.check_reads = check_reads  # how a store given as metadata is opened (TokenStore)
        self.opener = opener  # `open_store`'s signature: (path, check_reads=..., known=...)
        # what undoes `opener` for a store the set will not keep (default: close it)
        self.release = release or _close
        self._metas: dict[str, StoreMeta] = {}
        self._stores: dict[str, AnyStore] = {}
        self._opening = threading.Lock()
        self.add(*stores)

    def meta(self, path: Path, fingerprint: str, check_reads: bool) -> StoreMeta:
        """The metadata of the store of content `fingerprint`: given, or its store opened at
        `path` (files checked, reads checked if `check_reads`; `open_at`'s error names
        `path`)."""
        if fingerprint not in self._metas:
            self.add(open_at(path, fingerprint, check_reads, self.opener, self.release))
        return self._metas[fingerprint]

    def open(self, meta: StoreMeta) -> AnyStore:
        """The open store of `meta`'s content, opened at `meta.path` on first use (`open_at`:
        its error names the path, so a reader prefixes the source's key)."""
        store = self._stores.get(meta.fingerprint)
        if store is None:
            with self._opening:  # reader threads of one step may ask at once: open it once
                store = self._stores.get(meta.fingerprint)
                if store is None:
                    opener = partial(self.opener, known=meta)  # its manifest, as read
                    store = open_at(
                        meta.path, meta.fingerprint, self.check_reads, opener, self.release
                    )
                    self._stores[meta.fingerprint] = store
        return store

    def open_now(self, path: Path, **kwargs: Any) -> AnyStore:
        """The store at `path` opened by the set's opener now (a bucket's store, which a plan
        opens before its first draw) and kept, so that it is handed back with the others; a
        store the set holds already (two sources of one path) is the one kept, the second
        opening handed back at once (the set hands each store back once)."""
        store = self.opener(path, **kwargs)
        held = self._stores.get(store.fingerprint)
        if held is not None:
            self.release(store)
            return held
        self.add(store)
        return store

    def opened(self, fingerprint: str) -> AnyStore | None:
        """The store of content `fingerprint` if it is open."""
        return self._stores.get(fingerprint)

    def metas(self) -> list[StoreMeta]:
        """The metadata of every store in the set (what a plan pickles instead of stores)."""
        return list(self._metas.values())

    def stores(self) -> list[AnyStore]:
        """The stores opened so far (to hand to a plan of a restored ledger, or to close)."""
        return list(self._stores.values())

    def add(self, *stores: AnyStore | StoreMeta) -> StoreSet:
        """Keep `stores`: open stores (`stores()` lists them, to hand back) or metadata."""
        for store in stores:
            self._metas[store.fingerprint] = meta_of(store)
            if not isinstance(store, StoreMeta):  # an open store (of any format)
                self._stores[store.fingerprint] = store
        return self


def _close(store: AnyStore) -> None:
    store.close()


def meta_of(store: AnyStore | StoreMeta) -> StoreMeta:
    """The metadata of an open store, or metadata itself."""
    return store if isinstance(store, StoreMeta) else store.meta


def open_at(
    path: Path,
    fingerprint: str,
    check_reads: bool,
    opener: Callable[..., Any] = open_store,
    release: Callable[[Any], None] = _close,
) -> AnyStore:
    """The store at `path` (opened by `opener`), which must hold the content the ledger
    recorded: one replaced since (read from its manifest when the plan was made, or by the run
    a checkpoint resumes) would serve other rows under the same steps, and is handed to
    `release`. A `StoreError` naming `path` first, as every store error does, so the caller
    prefixes the source's key (`keyed`, `Plan.read`)."""
    store = opener(path, check_reads=check_reads)
    if store.fingerprint != fingerprint:
        release(store)
        raise StoreError(
            f"{path}: the store has content fingerprint {store.fingerprint}, the ledger "
            f"recorded {fingerprint}: {_REPLACED[isinstance(store, TokenStore)]}"
        )
    return store


_REPLACED = {  # why a store's content changed under its path, and the remedy, by kind
    True: "it was replaced after the ledger recorded it (by `prepare --overwrite`?); a new run: "
    "restart it to read the new store; a resumed run: put the recorded store back there (the "
    "same inputs and prepare options rebuild it) and prepare new content at another path to "
    "switch to it",
    False: "the corpus read in place (its data files, or their `pipeline index`) changed after "
    "the ledger recorded it; a new run: restart it to read the new content; a resumed run: put "
    "the recorded files back there (and index them again) and give new content another path "
    "to switch to it",
}
