"""The one place a store's format picks the class that reads it.

A prepared store (`pipeline prepare`, a directory with `manifest.json`) is a `TokenStore`.
Corpora read in place are opened by their index directory (`pipeline index`): a Megatron
dataset's holds `megatron-index.json` (`MegatronStore`), Parquet/Arrow token columns'
`columns-index.json` (`ColumnStore`). All offer what the plan reads: the metadata (`meta`:
fingerprint, token counts), document offsets, checked token reads; each in-place class also
builds its index (`build_index`), so `pipeline index` picks the class by format alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import StoreError
from pipeline.store.columns import ColumnStore
from pipeline.store.inplace import InPlaceStore, load_record, record_meta
from pipeline.store.megatron import MegatronStore
from pipeline.store.meta import StoreMeta
from pipeline.store.meta_cache import Summaries, manifest_stat
from pipeline.store.store_files import store_identity
from pipeline.store.token_store import TokenStore
from pipeline.urls import is_url

AnyStore = TokenStore | InPlaceStore
IN_PLACE: dict[str, type[InPlaceStore]] = {"megatron": MegatronStore, "parquet": ColumnStore}


def _in_place(path: str | Path) -> type[InPlaceStore] | None:
    """The in-place store class whose index is at `path`; None for a prepared store."""
    return None if is_url(path) else _in_place_local(os.fspath(path))


def _in_place_local(path: str) -> type[InPlaceStore] | None:
    """`_in_place` of a local directory (a mixture probes hundreds): plain string joins, and
    `access` first, which answers a missing file without the exception `isfile`'s `stat`
    raises and catches (~0.8 us against ~2.2 us; most stores have neither record)."""
    for cls in IN_PLACE.values():
        record = f"{path}/{cls.RECORD}"
        if os.access(record, os.F_OK) and os.path.isfile(record):
            return cls
    return None


def _record(cls: type[InPlaceStore], path: Path) -> dict[str, Any]:
    return load_record(path, cls.RECORD, cls.KIND, cls.VERSION)


def open_store(path: str | Path, **options: Any) -> AnyStore:
    """The store at `path`, opened by the class its format needs (options: `TokenStore`'s;
    a store read in place takes `verify` and `check_reads`). A store whose metadata the plan
    read from its manifest (`known`, vouched for: `StoreMeta.checked`) is a prepared one: it
    is not probed for an in-place index again at its first draw."""
    known = options.get("known")
    cls = None if known is not None and known.checked is not None else _in_place(path)
    if cls is None:
        return TokenStore(path, **options)
    return cls(path, **{k: v for k, v in options.items() if k in ("verify", "check_reads")})


def load_meta(path: str | Path, summaries: Summaries | None = None) -> StoreMeta:
    """The plan's metadata of the store at `path`, reading its manifest or index record only;
    a local prepared store's from the host's `summaries` while its manifest is unchanged
    (`meta_cache`), read and kept there otherwise."""
    if is_url(path):
        return StoreMeta.load(path)
    return local_meta(path if isinstance(path, Path) else Path(path), summaries)


def local_meta(path: Path, summaries: Summaries | None = None) -> StoreMeta:
    """`load_meta` of a local store (a mixture's planning asks it of each of hundreds: one
    `fspath`, string joins)."""
    where = os.fspath(path)
    cls = _in_place_local(where)
    if cls is not None:
        return record_meta(path, _record(cls, path))
    stat = None if summaries is None else manifest_stat(where)  # before the read, as below
    kept = None if summaries is None else summaries.meta(path, stat)
    if kept is not None:
        return kept
    # a local manifest's identity: its store, opened at its first draw, takes the manifest read
    meta = StoreMeta.load(path, store_identity(path))
    if summaries is not None:
        summaries.keep(meta, stat)
    return meta


def local_metas(paths: Sequence[Path], summaries: Summaries) -> list[StoreMeta | None]:
    """What the host's `summaries` vouch for of the local stores at `paths`, as `local_meta`
    finds it (a store with an in-place index has none), in one pass for a mixture's hundreds;
    None where `local_meta` reads the store (new, changed, in place, or missing)."""
    keys = [os.fspath(path) for path in paths]
    return summaries.vouched(paths, keys, [cls.RECORD for cls in IN_PLACE.values()])


def check_index(kind: str, path: Path, column: str | None = None, data: Path | None = None) -> None:
    """A `format: megatron | parquet` source's index is at `path` (else: how to make it), a
    token column's indexes the configured `column`, and it indexes the source's `data` (its
    `path:`), not another corpus, nor another set of files."""
    cls = IN_PLACE[kind]
    record = _record(cls, path)
    if column is not None and record["column"] != column:
        raise StoreError(
            f"{path}: indexes column {record['column']!r}, the source reads {column!r}; index "
            "that column (`pipeline index --column`) into another directory"
        )
    if data is not None:
        cls.check_data(record, path, data)
