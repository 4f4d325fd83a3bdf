"""The one place a store's format picks the class that reads it.

A prepared store (`pipeline prepare`, a directory with `manifest.json`) is a `TokenStore`; a
Megatron dataset read in place is a `MegatronStore`, opened by its index directory
(`pipeline index`, which holds `megatron-index.json`). Both offer what the plan reads: the
metadata (`meta`: fingerprint, token counts), document offsets, checked token reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.store.megatron import MegatronStore, load_megatron_meta
from pipeline.store.megatron_index import is_index
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore
from pipeline.urls import is_url

AnyStore = TokenStore | MegatronStore


def _megatron(path: str | Path) -> bool:
    return not is_url(path) and is_index(Path(path))


def open_store(path: str | Path, **options: Any) -> AnyStore:
    """The store at `path`, opened by the class its format needs (options: `TokenStore`'s;
    a Megatron store takes `verify` and `check_reads`)."""
    if _megatron(path):
        return MegatronStore(
            path, **{k: v for k, v in options.items() if k in ("verify", "check_reads")}
        )
    return TokenStore(path, **options)


def load_meta(path: str | Path) -> StoreMeta:
    """The plan's metadata of the store at `path`, reading its manifest or index record only."""
    return load_megatron_meta(path) if _megatron(path) else StoreMeta.load(path)
