"""Taking documents down: a best_fit source's layout once `sources.NAME.exclude` names some.

A source whose config excludes documents (config/exclude.py) packs its store without them
(`PackedLayout` with `Excluded`). When the exclusion starts or changes at a switch, with the
source's counter carried from the segment before (same store, same packing), the epoch in
progress is not restarted: as for a change of `seq_len` (`repack.repacked`, through
`transition.continued`), the documents that epoch has not used yet, less the excluded ones,
are packed anew into a *transitional epoch*, and the epochs after it use the packing without
the excluded documents. So after the switch no excluded document is served, every other
document is served exactly once in every epoch (the epoch in progress counts what was served
before the switch), and the steps before it are unchanged.

Finding the excluded documents is one pass over the store's id files (`doc_ids.locate`):
memory O(excluded ids), time O(documents in the store), once per process and exclusion
(`_RESOLVED`). Concat sources cannot exclude documents yet: refused by name.
"""

from __future__ import annotations

import threading

import numpy as np

from pipeline.config import DataConfig, SourceSpec
from pipeline.errors import ConfigError
from pipeline.plan.packing import Excluded, PackedLayout
from pipeline.plan.row_layout import OpenStore
from pipeline.plan.sources import keyed
from pipeline.store.doc_ids import locate
from pipeline.store.identity import MANIFEST_CHECKSUM
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore

_RESOLVED: dict[tuple[str, str, str], np.ndarray] = {}  # (store, ids digest, missing) -> docs
_RESOLVED_LOCK = threading.Lock()
CACHED_EXCLUSIONS = 16


def excluded_documents(spec: SourceSpec, store: TokenStore, config: DataConfig) -> Excluded:
    """The documents `spec.exclude` names in `store` (sorted ids, shard-major); an id the store
    lacks is one line naming the file and line, unless `missing: ignore`."""
    exclude = spec.exclude
    assert exclude is not None
    key = (store.manifest[MANIFEST_CHECKSUM], exclude.sha256, exclude.missing)
    with _RESOLVED_LOCK:
        documents = _RESOLVED.get(key)
        if documents is None:
            documents = _resolve(spec, store, config)
            _RESOLVED[key] = documents
            while len(_RESOLVED) > CACHED_EXCLUSIONS:
                _RESOLVED.pop(next(iter(_RESOLVED)))
    return Excluded(documents, exclude.sha256)


def _resolve(spec: SourceSpec, store: TokenStore, config: DataConfig) -> np.ndarray:
    exclude = spec.exclude
    assert exclude is not None
    where = f"{config.origin}: sources.{spec.name}.exclude"
    if not store.has_ids:
        raise ConfigError(
            f"{where}: the store {store.path} records no document ids; prepare it with "
            "--id-field FIELD or --record-ids (docs/token-store.md)"
        )
    lines: dict[str, int] = {}  # id -> its first line
    for number, document_id in exclude.ids():
        lines.setdefault(document_id, number)
    found = locate(store.path, store.manifest, lines)
    if exclude.missing == "error" and len(found) < len(lines):
        number, document_id = min((n, i) for i, n in lines.items() if i not in found)
        raise ConfigError(
            f"{exclude.file} line {number}: document id {document_id!r} is not in the store "
            f"of sources.{spec.name} ({store.path}); remove the line, or set "
            f"sources.{spec.name}.exclude: {{file: ..., missing: ignore}}"
        )
    firsts = np.concatenate([[0], np.cumsum(store.shard_documents)])
    documents = np.array([firsts[s] + d for s, d in found.values()], dtype=np.int64)
    documents.sort()
    documents.setflags(write=False)
    return documents


def build(
    spec: SourceSpec, meta: StoreMeta, config: DataConfig, open_store: OpenStore
) -> PackedLayout:
    """The layout of a source that excludes documents (from its first draw; a segment that
    carries the source's counter continues the layout before it, `transition.continued`)."""
    if spec.packing != "best_fit":
        raise ConfigError(
            f"sources.{spec.name}.exclude: only packing: best_fit sources can exclude "
            "documents for now (concat sources: not yet, docs/steering.md)"
        )
    with keyed(config, spec.name):
        store = open_store(meta)
        excluded = excluded_documents(spec, store, config)
        return PackedLayout(spec.name, store, config.seed, config.seq_len, config.lanes,
                            spec.too_long, excluded)  # fmt: skip
