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
(`_RESOLVED`).

A concat source (`ExcludingSourceLayout`) cuts its epochs' streams without the excluded
documents' token ranges; at the switch, the rest of the epoch in progress is what it had not
served less those ranges (`transition.relaid`, the mechanism of a `seq_len` change), re-cut.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from pipeline.config import DataConfig, SourceSpec
from pipeline.errors import ConfigError
from pipeline.plan.layout import SourceLayout
from pipeline.plan.packing import PackedLayout
from pipeline.plan.row_layout import Excluded, OpenStore, RowLayout
from pipeline.plan.sources import keyed
from pipeline.plan.transition import Intervals, Stream, complement, merged
from pipeline.store.doc_ids import locate
from pipeline.store.identity import MANIFEST_CHECKSUM
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore
from pipeline.wording import counted

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
            documents = _resolve(spec, store)
            _RESOLVED[key] = documents
            while len(_RESOLVED) > CACHED_EXCLUSIONS:
                _RESOLVED.pop(next(iter(_RESOLVED)))
    return Excluded(documents, exclude.sha256)


def _resolve(spec: SourceSpec, store: TokenStore) -> np.ndarray:
    exclude = spec.exclude
    assert exclude is not None
    where = f"sources.{spec.name}.exclude"  # the layout's caller names the config
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
) -> RowLayout:
    """The layout of a source that excludes documents (from its first draw; a segment that
    carries the source's counter continues the layout before it, `transition.continued`)."""
    with keyed(config, spec.name):
        store = open_store(meta)
        excluded = excluded_documents(spec, store, config)
        if excluded.documents.size == store.num_documents:  # not "a larger store": the file
            raise ConfigError(
                f"sources.{spec.name}.exclude: {spec.exclude.file} takes down every document "
                f"of {store.path} ({counted(store.num_documents, 'document')}); leave the "
                "source out of the mix instead"
            )
        if spec.packing == "best_fit":
            return PackedLayout(spec.name, store, config.seed, config.seq_len, config.lanes,
                                spec.too_long, excluded)  # fmt: skip
        ranges = token_ranges(store, excluded.documents)
        return ExcludingSourceLayout(spec, meta, config, excluded, ranges)


def token_ranges(store: TokenStore, documents: np.ndarray) -> tuple[np.ndarray, ...]:
    """(shard, first token, end token) of each document (ids, shard-major)."""
    firsts = np.concatenate([[0], np.cumsum(store.shard_documents)]).astype(np.int64)
    shard = np.searchsorted(firsts, documents, side="right") - 1
    lo, hi = np.empty_like(documents), np.empty_like(documents)
    for s in np.unique(shard).tolist():
        mine = shard == s
        offsets = np.asarray(store.doc_offsets(s))
        index = documents[mine] - firsts[s]
        lo[mine], hi[mine] = offsets[index], offsets[index + 1]
    return shard, lo, hi


class ExcludingSourceLayout(SourceLayout):
    """A concat source without the documents it excludes: each regular epoch's stream is the
    whole epoch stream (the shards in the epoch's order) less their token ranges, the runs left
    laid end to end (a `transition.Stream`) and cut into lanes and windows as any epoch stream.
    A window across a joint begins a document there (`read.windows`), as the excluded document
    ended one. Transitional epochs stay in the whole stream's coordinates (`edge_pieces`,
    `removed_ranges`), so exclusions and geometry changes chain."""

    def __init__(
        self,
        spec: SourceSpec,
        meta: StoreMeta,
        config: DataConfig,
        excluded: Excluded,
        ranges: tuple[np.ndarray, ...],
    ) -> None:
        """`ranges`: (shard, first token, end token) of each excluded document."""
        _, lo, hi = ranges
        tokens = meta.num_tokens - int((hi - lo).sum())
        self.excluded, self._ranges = excluded, ranges
        super().__init__(spec.name, meta, config.seed, config.seq_len, config.lanes, tokens)
        self._streams = lru_cache(maxsize=64)(self._epoch_stream)
        self._tables = lru_cache(maxsize=64)(self._epoch_table)

    def removed_ranges(self, epoch: int) -> Intervals:
        order, bounds, _ = self.stream_shards(epoch)
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        shard, lo, hi = self._ranges
        base = bounds[position[shard]]
        return merged(base + lo, base + hi)

    def edge_pieces(self, epoch: int, starts: np.ndarray) -> tuple[np.ndarray, ...]:
        return self._streams(epoch).edge_pieces(starts, self.seq_len)

    def whole_shards(self, epoch: int) -> bool:
        """Never: its streams leave the excluded documents out."""
        return False

    def _shard_starts(self, epoch: int) -> tuple[np.ndarray, ...]:
        if self.transition is not None and epoch == self.transition.epoch:
            return super()._shard_starts(epoch)
        return self._tables(epoch)

    def _epoch_stream(self, epoch: int) -> Stream:
        kept = complement(self.meta.num_tokens, self.removed_ranges(epoch))
        return Stream(kept[0], kept[1] - kept[0])

    def _epoch_table(self, epoch: int) -> tuple[np.ndarray, ...]:
        order, bounds, _ = self.stream_shards(epoch)
        return self._streams(epoch).shard_table(order, bounds)
