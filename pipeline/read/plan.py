"""A plan that reads its rows: the six batch fields of any rows of any step.

`Plan` is the plan of the draws (`pipeline.plan.plan.DrawPlan`, pure) with the read path: one
reader of a step's rows (`read`, `batch`) over the plan's one set of open stores
(`store_set`), by the kind of rows each layout names (`READERS`): windows of a stream
(`windows`) and whole documents then padding (`documents`), both masked by
`batch.mask_untrained`; `read_compact` reads them in their compact form (`compact`). A store
error found in a read is named by the config key of the source whose store it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

import numpy as np

from pipeline.errors import StoreError
from pipeline.plan.draws import Draws
from pipeline.plan.plan import DrawPlan, SegmentPlan
from pipeline.plan.row_layout import DOCUMENTS, WINDOWS, OpenStore, RowLayout, by_kind, rows_of
from pipeline.plan.sources import path_key
from pipeline.read import compact
from pipeline.read.documents import document_fields, document_pieces
from pipeline.read.windows import found_key, read_windows, window_reads
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore
from pipeline.urls import is_url, location

Reader = Callable[..., dict[str, np.ndarray]]  # (which, epoch, window, start) -> fields


class Plan(DrawPlan):
    """The plan of a whole run, and the reader of its rows (the package's `pipeline.Plan`)."""

    def read(self, draws: Draws) -> dict[str, np.ndarray]:
        """The six fields of the drawn rows, read-only: fields share buffers (`inputs` and
        `targets` are overlapping views of one array, as are the segment and position pairs),
        so a write into one would silently change another; copy a field to change it.

        A store error (a shard damaged, found at its first use) is prefixed with the config key
        of the source whose store it names, as at open (`sources.path_key`)."""
        return self._keyed(draws, packed=False)

    def read_compact(self, draws: Draws) -> dict[str, np.ndarray] | None:
        """The drawn rows in their compact form (`pipeline.read.compact`), read-only as `read`'s
        fields; None when their ledger segment has none (the caller reads the six fields)."""
        plan = self.segment_plan(draws.segment_index)
        if compact.form(plan.row_kinds.only, plan.config.seq_len) is None:
            return None
        return self._keyed(draws, packed=True)

    def _keyed(self, draws: Draws, packed: bool) -> dict[str, np.ndarray]:
        try:
            batch = self._read(draws, packed)
        except StoreError as error:
            key = self._source_key(draws.segment_index, str(error))
            if key is None:
                raise
            raise StoreError(f"{key}: {error}") from error
        for values in batch.values():
            values.flags.writeable = False
        return batch

    def _read(self, draws: Draws, packed: bool) -> dict[str, np.ndarray]:
        """The windows of every windowed source in one pass (`read_windows`), each
        whole-document source's rows on their own (`document_fields`); into zeros when
        several share the rows."""
        plan = self.segment_plan(draws.segment_index)
        plan.layouts.ready(draws.drawn)  # laid out at their first draw, whichever plan drew
        layouts, open_store = plan.ordered_layouts, self.store_set.open
        kinds = by_kind(plan.row_kinds, draws.drawn, READERS)
        groups = _readers(layouts, open_store, draws.source, kinds, packed, draws.found)
        rows = (draws.source, draws.epoch, draws.window, draws.start)
        if len(groups) == 1:  # no fancy-index copies when one reader reads every row
            return groups[0][0](*rows)
        out: dict[str, np.ndarray] = {}
        for read, mine in groups:
            for name, values in read(*(a[mine] for a in rows)).items():
                if name not in out:
                    out[name] = np.zeros((len(draws.rows), *values.shape[1:]), values.dtype)
                out[name][mine] = values
        return out

    def pieces(self, draws: Draws, *, local: bool = False) -> list[Pieces]:
        """What reading `draws` copies, without reading it: per store in a bucket of the drawn
        sources (`local`: and on disk), the shard pieces (store, shards, lo, hi) of its rows
        (`PIECES`). A feed fetches the blocks of the steps ahead of those it reads with it
        (`piece_reads.fetch_blocks`), so a store on disk is not opened for it; what it finds
        is kept for the reader of the same draws (`Draws.found`)."""
        plan = self.segment_plan(draws.segment_index)
        plan.layouts.ready(draws.drawn)
        layouts = plan.ordered_layouts
        drawn = draws.drawn if local else [k for k in draws.drawn if is_url(layouts[k].meta.path)]
        arrays = (draws.source, draws.epoch, draws.window, draws.start)
        kinds = by_kind(plan.row_kinds, drawn, PIECES)
        rows = rows_of(draws.source, kinds.values(), len(draws.drawn))
        found: list[Pieces] = []
        for (kind, mine), chosen in zip(kinds.items(), rows):
            found += PIECES[kind](
                layouts, self.store_set.open, mine, draws.found, *(a[chosen] for a in arrays)
            )
        return found

    def batch(self, step: int, rows: Iterable[int] | None = None) -> dict[str, np.ndarray]:
        """The six fields of `rows` (default: all) of `step`, [len(rows), seq_len] each."""
        return self.read(self.draws(step, rows))

    def store(self, meta: StoreMeta) -> TokenStore:
        """The open store of `meta`'s content (`StoreSet.open`)."""
        return self.store_set.open(meta)

    def _source_key(self, index: int, message: str) -> str | None:
        """The config key (`sources.path_key`) of segment `index`'s source whose store (at the
        path it was read from) `message` names first, as every store error does; of stores
        nested in one another, the innermost (the longest root), which holds the file; of
        sources sharing that store, `_reader_at`'s."""
        plan = self.segment_plan(index)
        roots = {}
        for name in plan.config.source_names:
            meta = plan.layouts[name].meta
            store = self.store_set.opened(meta.fingerprint)
            roots[name] = str(meta.path if store is None else store.path)
        named = [n for n, root in roots.items() if message.startswith((f"{root}/", f"{root}:"))]
        if not named:
            return None
        root = max((roots[name] for name in named), key=len)
        return path_key(plan.config, _reader_at(plan, [n for n in named if roots[n] == root], root))

    def store_message(self, store: TokenStore | StoreMeta, error: StoreError) -> str:
        """`error` (found in `store` outside a read: a verification, an identity re-check)
        after the config key (`sources.path_key`) of a source that reads `store` in the latest
        segment planned that does (`_reader_at`: the one whose path `store` was opened at, else
        the first by name). One key, as `Plan.read` gives, so the line keeps one format.
        Unprefixed when no planned segment reads `store`."""
        for plan in self.planned():
            names = [
                name
                for name in plan.config.source_names
                if plan.layouts[name].meta.fingerprint == store.fingerprint
            ]
            if names:
                return f"{path_key(plan.config, _reader_at(plan, names, str(store.path)))}: {error}"
        return str(error)

    def stores(self) -> list[TokenStore]:
        """The stores opened so far (`StoreSet.stores`): a store opens at its first draw."""
        return self.store_set.stores()

    @property
    def vocab_size(self) -> int:
        """The largest vocabulary of the plan's stores, opened or not: the size a model's
        embedding table must have to hold every token id the plan serves."""
        return max(meta.vocab_size for meta in self.store_set.metas())


Groups = list[tuple[Reader, list[int]]]  # readers, each with the sources (indexes) it reads


def _windows(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    sources: list[int],
    packed: bool,
    found: dict,
) -> Groups:
    """One reader for the rows of every windowed source (`read_windows`: one pass)."""
    read = partial(read_windows, layouts, open_store, sources, packed=packed, found=found)
    return [(read, sources)]


def _documents(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    sources: list[int],
    packed: bool,
    found: dict,
) -> Groups:
    """One reader per whole-document source (`document_fields`)."""
    return [
        (partial(_document_rows, layouts[k], open_store(layouts[k].meta), packed), [k])
        for k in sources
    ]


READERS: dict[str, Callable[[Sequence[RowLayout], OpenStore, list[int], bool, dict], Groups]] = {
    WINDOWS: _windows,
    DOCUMENTS: _documents,
}
"""The readers of each kind of rows (`RowLayout.row_kind`), in the order their fields are
laid out: (layouts, open_store, sources, packed, the draws' `Draws.found`) -> groups; a layout
with a new kind of rows adds its reader here (docs/architecture.md)."""


Pieces = tuple[TokenStore, np.ndarray, np.ndarray, np.ndarray]  # store, shards, lo, hi


def _window_pieces(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    drawn: list[int],
    found: dict,
    which: np.ndarray,
    epoch: np.ndarray,
    window: np.ndarray,
    start: np.ndarray,
) -> list[Pieces]:
    """The shard pieces of drawn windows (of the sources `drawn`), by store (`window_reads`,
    kept in `found` for the reader of the same draws: `found_key`)."""
    stores, pieces = window_reads(layouts, open_store, drawn, which, epoch, start)
    found[found_key(drawn)] = (stores, pieces)
    owner, shard, lo, hi, _, _ = pieces
    return [
        (store, shard[owner == k], lo[owner == k], hi[owner == k]) for k, store in enumerate(stores)
    ]


def _document_pieces(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    drawn: list[int],
    found: dict,
    which: np.ndarray,
    epoch: np.ndarray,
    window: np.ndarray,
    start: np.ndarray,
) -> list[Pieces]:
    """The shard pieces of the documents of drawn packed rows (`window`, of the sources
    `drawn`), by store."""
    return [
        (open_store(layouts[k].meta), *document_pieces(layouts[k], window[which == k]))
        for k in drawn
    ]


PIECES: dict[str, Callable[..., list[Pieces]]] = {
    WINDOWS: _window_pieces,
    DOCUMENTS: _document_pieces,
}
"""What each kind of rows (`RowLayout.row_kind`) reads, without reading it (`Plan.pieces`):
(layouts, open_store, sources, the draws' `Draws.found`, which, epoch, window, start) ->
pieces; a layout with a new kind of rows adds its reader to `READERS` and its pieces here."""


def _readers(
    layouts: Sequence[RowLayout],
    open_store: OpenStore,
    which: np.ndarray,
    kinds: dict[str, list[int]],
    packed: bool,
    found: dict,
) -> list[tuple[Reader, np.ndarray | slice]]:
    """Who reads which of the drawn rows (`which` indexes `layouts`; `kinds`: the drawn
    sources by their kind of rows, `by_kind`; `packed`: in the compact form; `found`: the
    draws' `Draws.found`): each kind's reader(s) (`READERS`)."""
    groups = [
        group
        for kind, mine in kinds.items()
        for group in READERS[kind](layouts, open_store, mine, packed, found)
    ]
    drawn = sum(map(len, kinds.values()))
    return list(zip((read for read, _ in groups), rows_of(which, (s for _, s in groups), drawn)))


def _document_rows(
    layout: RowLayout,
    store: TokenStore,
    packed: bool,
    which: np.ndarray,
    epoch: np.ndarray,
    window: np.ndarray,
    start: np.ndarray,
) -> dict[str, np.ndarray]:
    """A whole-document source's rows: its packed rows are the drawn `window`s."""
    return document_fields(layout, store, window, packed=packed)


def _reader_at(plan: SegmentPlan, names: list[str], root: str) -> str:
    """Of `names`, sources of `plan` that share the store opened at `root`, the one whose
    config path is `root`, else the first: sources may name copies of one store (one
    fingerprint), which is read at one copy's path, and the key must lead to that copy."""
    own = (name for name in names if str(location(plan.config.source(name).path)) == root)
    return next(own, names[0])
