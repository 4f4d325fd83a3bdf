"""A config's sources as stores: opened to read, or only their metadata to plan.

A store that cannot be opened is named by its config key (`FILE: sources.NAME.path: ...`), so a
wrong path in a data config reads as a config error, before any step runs; damage found later,
at a shard's first use, is named by the same key (`Plan.read`, `keyed`, `Plan.store_message`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import TypeVar

from pipeline.config import DataConfig, SourceSpec
from pipeline.errors import ConfigError, StoreError
from pipeline.store.formats import (
    check_index,
    load_meta,
    local_meta,
    local_metas,
    open_store,
)
from pipeline.store.meta import StoreMeta
from pipeline.store.meta_cache import Summaries
from pipeline.store.remote_reads import configure, together
from pipeline.store.token_store import TokenStore

T = TypeVar("T")


def open_stores(
    config: DataConfig, open_store: Callable[..., TokenStore] = open_store
) -> dict[str, TokenStore]:
    """Every source's store, opened (its files checked) by `open_store(path, check_reads=...)`
    as the config's `feed.verify` says, by source name."""
    configure_remote_reads(config)
    check_reads = config.feed.check_reads
    return _each_source(config, lambda spec: open_store(spec.path, check_reads=check_reads))


def plan_stores(
    config: DataConfig, open_store: Callable[..., TokenStore] = open_store
) -> dict[str, TokenStore | StoreMeta]:
    """What a feed plans from, by source name: a local store's metadata alone (its manifest,
    checked, or the host's summary of it: `meta_cache`), the store itself opened at its first
    draw (`StoreSet.open`), so a restore's work follows the sources its first steps draw, not
    the mixture; a bucket's store opened now by `open_store`, all at once with the others (one
    round trip for any number of them: opened at their first draws they would add round trips
    to the first batch)."""
    configure_remote_reads(config)
    summaries = _summaries(config)
    local = [s for s in config.sources if s.format == "store" and s.name not in config.in_buckets]
    vouched = local_metas([spec.path for spec in local], summaries)
    known = {spec.name: meta for spec, meta in zip(local, vouched) if meta is not None}

    def load(spec: SourceSpec) -> TokenStore | StoreMeta:
        if spec.name in config.in_buckets:
            return open_store(spec.path, check_reads=config.feed.check_reads)
        return local_meta(spec.path, summaries)

    stores: dict[str, TokenStore | StoreMeta] = _each_source(config, load, known)
    summaries.save()
    return stores


def load_metas(config: DataConfig) -> dict[str, StoreMeta]:
    """Every source's store metadata (its manifest alone, or the host's summary of it), by
    source name."""
    configure_remote_reads(config)
    summaries = _summaries(config)
    metas = _each_source(config, lambda spec: load_meta(spec.path, summaries))
    summaries.save()
    return metas


def _summaries(config: DataConfig) -> Summaries:
    """The host's kept metadata of the config's local sources (`meta_cache`)."""
    return Summaries([spec.path for spec in config.sources if spec.name not in config.in_buckets])


def configure_remote_reads(config: DataConfig) -> None:
    """This process's reads of remote stores as the config's `feed.cache` and
    `feed.read_timeout_s` say (`configure`)."""
    directory, max_gb = config.feed.remote.cache or (None, 0.0)
    configure(directory, max_gb, config.feed.remote.read_timeout_s)


def path_key(config: DataConfig, name: str) -> str:
    """The config key of source `name`'s store, for messages: `FILE: sources.NAME.path` (or
    `eval.sources.NAME.path`)."""
    return f"{config.origin}: {config.sources_key}.{name}.path"


@contextmanager
def keyed(config: DataConfig, name: str) -> Iterator[None]:
    """Prefix a `StoreError` raised inside with source `name`'s config key (`path_key`): with
    many sources, the one whose store is at fault."""
    try:
        yield
    except StoreError as error:
        raise StoreError(f"{path_key(config, name)}: {error}") from error


def _each_source(
    config: DataConfig, load: Callable[[SourceSpec], T], known: Mapping[str, T] | None = None
) -> dict[str, T]:
    """`load` of every source but those `known` (by name: taken as they are), by name;
    sources in buckets all at once (one round trip for any number of them, `together`)."""
    known = known or {}

    def one(spec: SourceSpec) -> T:
        try:
            if spec.format != "store":  # not indexed yet: say how, not "no store here"
                check_index(spec.format, spec.path, spec.column, spec.data)
            return load(spec)
        except StoreError as error:
            raise ConfigError(f"{path_key(config, spec.name)}: {error}") from error

    todo = [spec for spec in config.sources if spec.name not in known]
    if config.in_buckets:
        values = together(*(partial(one, spec) for spec in todo))
    else:
        values = [one(spec) for spec in todo]
    loaded = dict(zip((spec.name for spec in todo), values, strict=True))
    return {name: known[name] if name in known else loaded[name] for name in config.source_names}
