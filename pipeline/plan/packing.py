"""Whole-document rows for `packing: best_fit` sources, without state.

A best-fit source's documents are never split across rows. A document of n tokens (eod
included) gives n - 1 (input, target) pairs, `inputs = d[:-1]`, `targets = d[1:]`, so it takes
n - 1 of a row's `seq_len` slots; a longer one is truncated to `seq_len + 1` tokens or dropped
(`too_long`), and counted.

The *packing* is a pure function of (seed, source, store): the documents are put in a keyed
order, cut into blocks of `BLOCK_DOCUMENTS`, and each block is packed on its own by best-fit
decreasing (longest first, each into the row it leaves least room in). The rows are then made
a multiple of `lanes` by moving single documents out of rows that hold several (documents
stay whole), so every lane has the same R = rows // lanes rows per epoch and epochs end
together everywhere, as the concatenated sources' windows do.

Epoch e of the source is a keyed permutation of all the rows, per (seed, source, epoch); lane l
takes positions [l * R, (l + 1) * R) of it. So each document is used exactly once per epoch,
the k-th row a lane draws is computed directly (epoch k // R), and restoring at any step costs
nothing beyond the packing, which is computed when a process first opens the source (its cost
grows with the store, never with the step), shared by the plans of that process and kept on
local disk (packing_cache.py), so a restore in a new process reads it instead of packing again.

`PackedLayout` is the `best_fit` row layout (`pipeline.plan.row_layout.RowLayout`); a packing
policy of another name subclasses it with its own `policy` and `pack`, and never shares its
packings (their keys hold the policy).
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache, partial
from typing import ClassVar

import numpy as np

from pipeline.config import DataConfig, SourceSpec
from pipeline.errors import ConfigError
from pipeline.plan.epochs import Epochs
from pipeline.plan.layout import SMALL_DOMAIN
from pipeline.plan.packing_cache import Packing, cached
from pipeline.plan.permutation import permutation, permute, round_keys
from pipeline.plan.row_layout import (
    DOCUMENTS,
    NO_DOCUMENTS,
    NO_EXCLUSION,
    Arrays,
    Excluded,
    OpenStore,
)
from pipeline.plan.sources import keyed
from pipeline.store.identity import MANIFEST_CHECKSUM
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore
from pipeline.wording import counted

BLOCK_DOCUMENTS = 4096
# Packings are pure, so plans of one process share them (a restore, `verify`'s host plans).
CACHED_PACKINGS = 8
_CACHE: dict[tuple, Packing] = {}
_CACHE_LOCK = threading.Lock()


def best_fit_decreasing(slots: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of indices into `slots` (each <= capacity): longest first, each into the open row
    with the least room that holds it (ties: the earliest row), else a new row."""
    order = np.argsort(-slots, kind="stable").tolist()
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free slots, row) of open rows, sorted
    for index in order:
        need = int(slots[index])
        at = bisect_left(room, (need, -1))
        if at < len(room):
            free, row = room.pop(at)
        else:
            free, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if free - need > 0:
            insort(room, (free - need, row))
    return rows


@dataclass(frozen=True)
class PackingStats:
    rows: int
    documents: int
    truncated: int
    dropped: int
    slots_used: int
    seq_len: int

    @property
    def padding_fraction(self) -> float:
        """Share of a row's `seq_len` target slots that are padding."""
        return 1.0 - self.slots_used / (self.rows * self.seq_len)

    def describe(self) -> str:
        """One line for `epochs` and `verify`."""
        return (
            f"best_fit: {counted(self.rows, 'row')} per epoch of "
            f"{counted(self.documents, 'document')}, padding "
            f"{self.padding_fraction:.1%} of target slots, {self.truncated:,} truncated, "
            f"{self.dropped:,} dropped (too long)"
        )


class PackedLayout(Epochs):
    """Where a best-fit source's rows are, per epoch and lane (the `SourceLayout` of packing).

    After a switch that changed the geometry mid-epoch, its `transition` (`repack.
    RepackedTransition`) holds the rest of that epoch's documents packed anew: rows numbered
    after the regular packing's (`epoch_rows`), in `row_offsets` and `row_docs` with them."""

    policy: ClassVar[str] = "best_fit"
    row_kind: ClassVar[str] = DOCUMENTS

    def __init__(
        self,
        name: str,
        store: TokenStore,
        seed: int,
        seq_len: int,
        lanes: int,
        too_long: str,
        excluded: Excluded = NO_EXCLUSION,
    ) -> None:
        self.name = name
        self.store = store
        self.meta = store.meta
        self.seed = seed
        self.seq_len = seq_len
        self.lanes = lanes
        self.too_long = too_long
        self.excluded = excluded
        settings = {"packing": self.policy, "store": store.manifest[MANIFEST_CHECKSUM],
                    "seed": seed, "source": name, "seq_len": seq_len, "lanes": lanes,
                    "too_long": too_long}  # fmt: skip
        if excluded.digest:  # only then: the packings of sources without exclusions keep keys
            settings["exclude"] = excluded.digest
        key = tuple(settings.values())
        with _CACHE_LOCK:
            packed = _CACHE.pop(key, None)
            if packed is None:
                pack = partial(self.pack, store, seed, name, seq_len, lanes, too_long)
                if excluded.digest:
                    pack = partial(_pack_store, store, seed, name, seq_len, lanes, too_long,
                                   excluded.documents)  # fmt: skip
                packed = cached(settings, store.num_documents, pack)
            _CACHE[key] = packed  # most recent last
            while len(_CACHE) > CACHED_PACKINGS:
                _CACHE.pop(next(iter(_CACHE)))
        self.doc_shard = np.repeat(np.arange(store.num_shards), store.shard_documents)
        self.doc_start, self.doc_tokens = packed["doc_start"], packed["doc_tokens"]
        self.row_offsets, self.row_docs = packed["row_offsets"], packed["row_docs"]
        self.truncated, self.dropped = packed["counts"].tolist()
        self.windows_per_lane = (len(self.row_offsets) - 1) // lanes
        self._permutation = lru_cache(maxsize=64)(self._epoch_permutation)

    @classmethod
    def build(
        cls, spec: SourceSpec, meta: StoreMeta, config: DataConfig, open_store: OpenStore
    ) -> PackedLayout:
        """Packs the store's documents, so opens it (the document index) when the plan is
        made: a shard damaged there is named by the source's config key, as at open
        (`sources.path_key`)."""
        with keyed(config, spec.name):
            store = open_store(meta)
            return cls(spec.name, store, config.seed, config.seq_len, config.lanes, spec.too_long)

    @staticmethod
    def order_key(entry: Mapping[str, str]) -> list[str]:
        """The policy and what it does with a document longer than a row."""
        return [entry["packing"], entry.get("too_long", "truncate")]

    @staticmethod
    def pack(
        store: TokenStore, seed: int, name: str, seq_len: int, lanes: int, too_long: str
    ) -> Packing:
        """The packing of a store's documents: the policy itself (`_pack_store`)."""
        return _pack_store(store, seed, name, seq_len, lanes, too_long)

    @classmethod
    def draw(
        cls,
        layouts: Sequence[PackedLayout],
        which: np.ndarray,
        counter: np.ndarray,
        lane: np.ndarray,
    ) -> Arrays:
        """(epoch, packed row, -1) of each draw, by each source's own layout."""
        out = tuple(np.empty_like(counter) for _ in range(3))
        for k in np.unique(which).tolist():
            rows = np.flatnonzero(which == k)
            for part, values in zip(out, layouts[k].epoch_and_window(counter[rows], lane[rows])):
                part[rows] = values
        return out

    @cached_property
    def stats(self) -> PackingStats:
        """Of the regular epochs' packing."""
        rows = self.windows_per_lane * self.lanes
        docs = self.row_docs[: self.row_offsets[rows]]
        return PackingStats(
            rows=rows,
            documents=len(docs),
            truncated=self.truncated,
            dropped=self.dropped,
            slots_used=int((self.doc_tokens[docs] - 1).sum()),
            seq_len=self.seq_len,
        )

    def epoch_and_window(self, counter: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, ...]:
        """(epoch, packed row, -1) of draw `counter` of `lane` (no token start: rows are
        documents, not windows of a stream)."""
        counter = np.asarray(counter, dtype=np.int64)
        lane = np.broadcast_to(np.asarray(lane, dtype=np.int64), counter.shape)
        epoch, k, early = self.place(counter)
        position = lane * self.windows_per_lane + k
        row = np.empty_like(k)
        for e in np.unique(epoch[~early]).tolist():
            mask = (epoch == e) & ~early
            row[mask] = self._row_order(e, position[mask])
        if early.any():
            transition = self.transition
            row[early] = transition.rows(lane[early] * transition.windows + k[early])
        return epoch, row, np.full_like(k, -1)

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """The packed rows epoch `epoch` draws (each once, over all lanes)."""
        if self.transition is not None and epoch == self.transition.epoch:
            return self.transition.rows(np.arange(self.transition.windows * self.lanes))
        return np.arange(self.windows_per_lane * self.lanes)

    def documents_of(self, rows: np.ndarray) -> np.ndarray:
        """The documents of packed rows `rows`, row after row (one vectorised gather)."""
        rows = np.asarray(rows, dtype=np.int64)
        first = self.row_offsets[rows]
        counts = self.row_offsets[rows + 1] - first
        index = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        return self.row_docs[index]

    def documents(self, row: int) -> np.ndarray:
        """Document ids (store order, shard-major) of packed row `row`, in row order."""
        return self.row_docs[self.row_offsets[row] : self.row_offsets[row + 1]]

    def locate(self, document: int) -> tuple[int, int]:
        """(shard, index in the shard) of a document id."""
        shard = int(self.doc_shard[document])
        return shard, int(document - self.store.shard_documents[:shard].sum())

    def _row_order(self, epoch: int, position: np.ndarray) -> np.ndarray:
        """Packed rows at `position` of epoch `epoch`'s keyed order of all the rows."""
        rows = self.windows_per_lane * self.lanes
        if rows <= SMALL_DOMAIN:
            return self._permutation(epoch)[position]
        return permute(position, rows, self._epoch_keys(epoch))

    def _epoch_keys(self, epoch: int) -> np.ndarray:
        return round_keys(self.seed, "row-order", self.name, epoch)

    def _epoch_permutation(self, epoch: int) -> np.ndarray:
        return permutation(self.windows_per_lane * self.lanes, self._epoch_keys(epoch))


def _pack_store(
    store: TokenStore,
    seed: int,
    name: str,
    seq_len: int,
    lanes: int,
    too_long: str,
    excluded: np.ndarray = NO_DOCUMENTS,
) -> Packing:
    """The packing of a store's documents (`packing_cache.ARRAYS`), its arrays read-only;
    the documents `excluded` (sorted ids) are left out."""
    shard_docs = [np.asarray(store.doc_offsets(s)) for s in range(store.num_shards)]
    doc_start = np.concatenate([d[:-1] for d in shard_docs]).astype(np.int64)
    lengths = np.concatenate([np.diff(d) for d in shard_docs]).astype(np.int64)
    long = lengths > seq_len + 1
    doc_tokens = np.minimum(lengths, seq_len + 1)
    kept = np.flatnonzero(~long) if too_long == "drop" else np.arange(lengths.size)
    if excluded.size:
        kept = np.setdiff1d(kept, excluded, assume_unique=True)
    if kept.size:  # every document dropped: `_even_out` names the source
        kept = kept[permutation(kept.size, round_keys(seed, "pack-order", name))]
    # a take-down never forces a geometry change: rows it leaves uneven are left out
    where = f"sources.{name}"
    row_offsets, row_docs = pack_rows(kept, doc_tokens - 1, seq_len, lanes, where, excluded.size)
    counts = [int(long.sum()) if too_long == which else 0 for which in ("truncate", "drop")]
    packing = {
        "doc_start": doc_start,
        "doc_tokens": doc_tokens,
        "row_offsets": row_offsets,
        "row_docs": row_docs,
        "counts": np.array(counts, dtype=np.int64),
    }
    for array in packing.values():
        array.setflags(write=False)
    return packing


def pack_rows(
    documents: np.ndarray,
    slots: np.ndarray,
    seq_len: int,
    lanes: int,
    where: str | None,
    leave_tail: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(row_offsets, row_docs) of `documents` (ids, in the order to pack them; slots[id]
    each) packed block by block by best fit decreasing into rows of `seq_len` slots, the rows
    made a multiple of `lanes` (`_even_out`, which names `where` when they cannot be; `where`
    None, or `leave_tail` while a row per lane remains: the last rows are left out instead,
    fewer than `lanes`)."""
    rows: list[list[int]] = []
    for lo in range(0, documents.size, BLOCK_DOCUMENTS):
        block = documents[lo : lo + BLOCK_DOCUMENTS]
        rows.extend([block[i] for i in row] for row in best_fit_decreasing(slots[block], seq_len))
    try:
        _even_out(rows, lanes, where or "")
    except ConfigError:
        if where is not None and not (leave_tail and len(rows) >= lanes):
            raise
        del rows[len(rows) - len(rows) % lanes :]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return offsets, np.array([d for row in rows for d in row], dtype=np.int64)


def _even_out(rows: list[list[int]], lanes: int, where: str) -> None:
    """Make the row count a multiple of `lanes` by moving the last document of rows holding
    several into rows of their own (from the last row back), so no lane is short a row."""
    missing = -len(rows) % lanes
    at = len(rows) - 1
    while missing and at >= 0:
        if len(rows[at]) > 1:
            rows.append([rows[at].pop()])
            missing -= 1
        else:
            at -= 1
    if missing or not rows:
        raise ConfigError(
            f"{where}: its documents make {counted(len(rows), 'row')}, which cannot be split "
            f"evenly over {counted(lanes, 'lane')}; use fewer lanes or a larger store"
        )


LAYOUT = PackedLayout
