"""Where a source's windows are in each epoch: shard order, lane ranges, window order.

For epoch `e` of a source, its shards are put in a keyed order and concatenated into the
*epoch stream* of T tokens. The stream is cut into `lanes` equal ranges of Q = T // lanes
tokens; lane `l` owns [l*Q, (l+1)*Q). A window is `seq_len + 1` tokens starting at a multiple of
`seq_len` inside the lane's range (consecutive windows share one token, so every token of the
range is a target once). Every lane has the same W = (Q - 1) // seq_len windows per epoch, so all
lanes roll over together; the few tokens past the last window of a lane are not used in that
epoch, and because the shard order changes every epoch, different tokens fall there each time.

The k-th window a lane draws from the source is window `perm(k % W)` of epoch `k // W`, where
`perm` is a keyed bijection per (seed, source, epoch, lane) (`pipeline.plan.permutation`), so
each window is used exactly once per epoch and any k is computed directly. The shard order of
epoch `e` is the same bijection on the shard indices, keyed per (seed, source, epoch).

`SourceLayout` is the `concat` row layout (`pipeline.plan.row_layout.RowLayout`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from operator import attrgetter
from typing import ClassVar

import numpy as np

from pipeline.config import DataConfig, SourceSpec
from pipeline.errors import ConfigError
from pipeline.plan.epochs import Epochs, Transition
from pipeline.plan.permutation import many_round_keys, orders, permutations, permute, round_keys
from pipeline.plan.row_layout import (
    NO_DOCUMENTS,
    NO_EXCLUSION,
    WINDOWS,
    Arrays,
    Excluded,
    OpenStore,
)
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenSpan, TokenStore
from pipeline.wording import counted

# Up to this many windows per lane, the whole window order of an (epoch, lane) is computed once
# (a few ms) and cached, so a draw is a lookup; above, each draw's window is computed on its own.
SMALL_DOMAIN = 1 << 16
OWN_ORDER_VALUES = 1 << 10  # a layout keeps its last orders of up to this many windows (8 KiB)
LANE_ORDERS_KEPT = 4  # ... this many of them
PIECE_TABLES_KEPT = 64  # a layout's shard tables of epochs (`SourceLayout.keep_table`) kept
# What `window_draws` reads of each drawn source's layout, in one array.
FIGURES = ("windows_per_lane", "first_counter", "first_epoch", "lane_tokens", "seq_len")
_figures = attrgetter(*FIGURES)  # a layout's, in one C call (a restore lays out hundreds)


class SourceLayout(Epochs):
    """One source's epochs, lanes and windows, from its store's metadata alone; reading a window
    takes the open store (`read_window`; a batch's windows: `window_pieces`).

    After a switch that changed the geometry mid-epoch, its `transition` (`transition.
    StreamTransition`) lays the rest of that epoch out on the stream of what it had not served:
    its windows' token starts are positions in that stream, whose shard table (`_shard_starts`)
    maps them to pieces of shards."""

    policy: ClassVar[str] = "concat"
    row_kind: ClassVar[str] = WINDOWS
    stats = None  # nothing beyond the windows to report

    excluded: Excluded = NO_EXCLUSION  # the documents it leaves out (`exclusion`)

    def __init__(
        self,
        name: str,
        meta: StoreMeta,
        seed: int,
        seq_len: int,
        lanes: int,
        tokens: int | None = None,
    ) -> None:
        """`tokens`: of an epoch stream (default: the store's; fewer when it excludes some)."""
        self.name = name
        self.meta = meta
        self.seed = seed
        self.seq_len = seq_len
        self.lanes = lanes
        tokens = meta.num_tokens if tokens is None else tokens
        self.lane_tokens = tokens // lanes
        self.windows_per_lane = (self.lane_tokens - 1) // seq_len
        if self.windows_per_lane < 1:
            raise ConfigError(
                f"sources.{name}: seq_len {seq_len} needs at least {seq_len + 1} tokens per lane, "
                f"but {meta.path} has {counted(tokens, 'token')}"
                f"{'' if tokens == meta.num_tokens else ' left once its exclude is taken out'} for "
                f"{counted(lanes, 'lane')} (use a smaller seq_len or fewer lanes)"
            )
        self.figures = _figures(self)

    # Per layout, made at first use: a restore lays out hundreds of sources and draws a few.
    @cached_property
    def _stream_shards(self) -> Callable[[int], tuple[np.ndarray, ...]]:
        return lru_cache(maxsize=64)(self._epoch_shard_starts)

    @cached_property
    def _window_keys(self) -> Callable[[int, int], np.ndarray]:
        return lru_cache(maxsize=1024)(self._lane_keys)

    # epoch -> `_piece_table`, and (epoch, lane) -> window order (`_remember`)
    _pieces_kept: dict[int, tuple[np.ndarray, int]] | None = None
    _lane_orders: dict[tuple[int, int], np.ndarray] | None = None

    def lane_order(self, epoch: int, lane: int) -> np.ndarray:
        """The window order of (epoch, lane) of a small layout (`window_order`): up to
        `LANE_ORDERS_KEPT` of them kept on the layout when of at most `OWN_ORDER_VALUES`
        windows, so that a step of a big mixture finds each drawn source's without the process
        cache's lock and bookkeeping (`keyed_order`), which keeps the larger ones within its
        bound."""
        if self.windows_per_lane > OWN_ORDER_VALUES:
            return window_order(self.seed, self.name, epoch, lane, self.windows_per_lane)
        kept = self._lane_orders  # read once: another thread may replace it
        order = None if kept is None else kept.get((epoch, lane))
        if order is None:
            order = window_order(self.seed, self.name, epoch, lane, self.windows_per_lane)
            self.keep_lane_order(epoch, lane, order)
        return order

    def keep_lane_order(self, epoch: int, lane: int, order: np.ndarray) -> None:
        """Keep `order` as `lane_order(epoch, lane)` if small (`warm_orders` computes it)."""
        if self.windows_per_lane <= OWN_ORDER_VALUES:
            self._lane_orders = _remember(self._lane_orders, (epoch, lane), order, LANE_ORDERS_KEPT)

    def continue_epochs(self, counter: int, epoch: int, transition: Transition | None) -> None:
        """`Epochs.continue_epochs`, and what the read path caches of the epochs forgotten."""
        super().continue_epochs(counter, epoch, transition)
        self.figures = _figures(self)
        self._pieces_kept = None

    @classmethod
    def build(
        cls, spec: SourceSpec, meta: StoreMeta, config: DataConfig, open_store: OpenStore
    ) -> SourceLayout:
        """Laid out from the store's metadata alone: no file is opened."""
        return cls(spec.name, meta, config.seed, config.seq_len, config.lanes)

    @staticmethod
    def order_key(entry: Mapping[str, str]) -> None:
        """Windows depend on the store alone."""
        return None

    @classmethod
    def draw(
        cls,
        layouts: Sequence[SourceLayout],
        which: np.ndarray,
        counter: np.ndarray,
        lane: np.ndarray,
    ) -> Arrays:
        return window_draws(layouts, which, counter, lane)

    def epoch_and_window(self, counter: np.ndarray, lane: np.ndarray) -> tuple[np.ndarray, ...]:
        """(epoch, window index in the lane, token start in the epoch stream) of draw `counter`."""
        counter = np.asarray(counter, dtype=np.int64)
        lane = np.broadcast_to(np.asarray(lane, dtype=np.int64), counter.shape)
        flat = window_draws([self], np.zeros(counter.size, np.int64), counter.ravel(), lane.ravel())
        return tuple(a.reshape(counter.shape) for a in flat)

    def pieces(self, epoch: int, start: int, stop: int) -> list[tuple[int, int, int]]:
        """(shard, first token, end token) pieces covering [start, stop) of the epoch stream."""
        order, starts, offsets = self._shard_starts(epoch)
        out = []
        position = int(np.searchsorted(starts, start, side="right")) - 1
        while start < stop:
            shard, offset = int(order[position]), int(offsets[position])
            lo = start - int(starts[position])
            hi = min(stop, int(starts[position + 1])) - int(starts[position])
            if hi > lo:
                out.append((shard, lo + offset, hi + offset))
            start += hi - lo
            position += 1
        return out

    def read_window(self, store: TokenStore, epoch: int, start: int) -> TokenSpan:
        """The window of `seq_len + 1` tokens at `start` of the epoch stream, from `store`."""
        spans, offset, doc_starts = [], 0, []
        for shard, lo, hi in self.pieces(epoch, start, start + self.seq_len + 1):
            span = store.read_shard_tokens(shard, lo, hi)
            spans.append(span.tokens)
            doc_starts.append(span.doc_starts + offset)
            offset += hi - lo
        if len(spans) == 1:
            return TokenSpan(spans[0], doc_starts[0])
        return TokenSpan(np.concatenate(spans), np.concatenate(doc_starts))

    def shard_order(self, epoch: int) -> np.ndarray:
        return self.stream_shards(epoch)[0]

    def _shard_starts(self, epoch: int) -> tuple[np.ndarray, ...]:
        """(shard, stream start, first token in the shard) of each piece of epoch `epoch`'s
        stream, and the stream's end after the starts: the whole shards in their epoch order,
        or, for a transitional epoch, the pieces of what it had left (`StreamTransition`)."""
        if self.transition is not None and epoch == self.transition.epoch:
            return self.transition.shard_table(self)  # type: ignore[attr-defined]
        return self.stream_shards(epoch)

    def edge_pieces(self, epoch: int, starts: np.ndarray) -> tuple[np.ndarray, ...]:
        """The edges (token pairs) of the whole epoch stream (`stream_shards`) that windows at
        `starts` of regular epoch `epoch` cover, as (window, lo, hi) pieces: the windows
        themselves, as the epoch stream is the whole one (a layout that excludes documents
        maps them, a piece per run of what it keeps)."""
        starts = np.asarray(starts, np.int64)
        return np.arange(starts.size), starts, starts + self.seq_len

    def removed_ranges(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The token ranges of the whole epoch stream it never serves, sorted and disjoint
        (none)."""
        return NO_DOCUMENTS, NO_DOCUMENTS

    def stream_shards(self, epoch: int) -> tuple[np.ndarray, ...]:
        """`_shard_starts` of epoch `epoch`'s whole stream: every shard in its keyed order."""
        return self._stream_shards(epoch)

    def _epoch_shard_starts(self, epoch: int) -> tuple[np.ndarray, ...]:
        order = keyed_order(self.seed, "shard-order", self.name, epoch, (), self.meta.num_shards)
        starts = np.concatenate([[0], np.cumsum(self.meta.shard_tokens[order])])
        return order, starts, np.zeros_like(order)

    def _lane_keys(self, epoch: int, lane: int) -> np.ndarray:
        return round_keys(self.seed, "window-order", self.name, epoch, lane)

    def _piece_table(self, epoch: int) -> tuple[np.ndarray, int]:
        """`_shard_starts(epoch)` as `window_pieces` lays it end to end with other streams':
        one [3, pieces] array (stream start, shard, first token in the shard), and the
        stream's end (kept: one concatenation a step, not three of a few arrays each)."""
        order, starts, offsets = self._shard_starts(epoch)
        return np.stack([starts[:-1], order, offsets]).astype(np.int64), int(starts[-1])

    def whole_shards(self, epoch: int) -> bool:
        """Whether epoch `epoch`'s stream is every shard whole, in the epoch's shard order (not
        a transitional epoch's rest), so its `_piece_table` may be laid out with others'
        (`_fill_tables`)."""
        return self.transition is None or epoch != self.transition.epoch

    def kept_table(self, epoch: int) -> tuple[np.ndarray, int] | None:
        """`_piece_table(epoch)` if kept (`keep_table`), else None."""
        kept = self._pieces_kept  # read once: `continue_epochs` may drop it meanwhile
        return None if kept is None else kept.get(epoch)

    def keep_table(self, epoch: int, table: tuple[np.ndarray, int]) -> tuple[np.ndarray, int]:
        """Keep `table` as `_piece_table(epoch)`."""
        self._pieces_kept = _remember(self._pieces_kept, epoch, table, PIECE_TABLES_KEPT)
        return table


def _remember(kept: dict | None, key: object, value: object, limit: int) -> dict:
    """`kept` (a new dict for None) with `value` at `key`, emptied first when it holds
    `limit`: a layout's own caches, made at its first draw (an `lru_cache` costs ~5 us to
    make: a restore's first steps would make a few for each source they draw). Emptied whole,
    as `_laid` is, since the readers and the fetch-ahead thread draw from the same layouts at
    once (each call here is one dict operation; a race loses an entry, computed again)."""
    if kept is None:
        kept = {}
    elif len(kept) >= limit:
        kept.clear()
    kept[key] = value
    return kept


ORDERS_BYTES = 128 << 20  # the orders kept: 256 window orders of the largest, 16,384 of 1,024
# A small order costs its numpy calls, not its values: a miss computes the orders of the
# epochs after it too, as many as make up to `AHEAD_VALUES` values (16 of a 64-value table).
AHEAD_VALUES, AHEAD_MAX = 1 << 10, 16
OrderKey = tuple[int, str, str, int, tuple[int, ...], int]  # (seed, purpose, name, epoch, lane, n)
_orders: OrderedDict[OrderKey, np.ndarray] = OrderedDict()
_orders_bytes = 0
_orders_lock = threading.Lock()


def window_order(seed: int, name: str, epoch: int, lane: int, windows: int) -> np.ndarray:
    """The whole window order of a small (epoch, lane) (`keyed_order`)."""
    return keyed_order(seed, "window-order", name, epoch, (lane,), windows)


def keyed_order(
    seed: int, purpose: str, name: str, epoch: int, lane: tuple[int, ...], n: int
) -> np.ndarray:
    """`permutation(n, round_keys(seed, purpose, name, epoch, *lane))`, read-only: cached per
    process, not per plan, so a restored feed's plan (a new plan of the same sources) finds it
    computed (a few ms each). The least recently used are dropped beyond `ORDERS_BYTES`, not
    beyond a number of orders: a mixture of hundreds of sources keeps every source's current
    order (a count of 256 would compute one again at nearly every draw).

    A small order is computed with the next epochs' (`AHEAD_VALUES`, one `permutations` pass)
    when the epoch before it was drawn: a source of a few windows a lane begins a new epoch
    every few of its draws, and a mixture of hundreds of them one nearly every step, each a
    shard order and a window order (a restore, whose first draws find no epoch before them,
    computes only the orders it reads)."""
    key = (seed, purpose, name, epoch, lane, n)
    with _orders_lock:
        order = _orders.get(key)
        if order is not None:
            _orders.move_to_end(key)
            return order
    ahead = max(1, min(AHEAD_MAX, AHEAD_VALUES // max(64, 1 << (n - 1).bit_length())))
    if (seed, purpose, name, epoch - 1, lane, n) not in _orders:
        ahead = 1  # a restore's first draw: only its own (the next ones if it rolls over)
    epochs = range(epoch, epoch + ahead)
    orders = permutations(n, many_round_keys([(seed, purpose, name, e, *lane) for e in epochs]))
    orders.flags.writeable = False  # shared by every plan of the process
    _keep([((seed, purpose, name, e, lane, n), order) for e, order in zip(epochs, orders)])
    return orders[0]


def keyed_orders(keys: list[OrderKey]) -> list[np.ndarray]:
    """`keyed_order(*key)` of each key, the kept ones found under one lock (a step's new
    streams' shard orders, most computed together by `warm_orders`)."""
    with _orders_lock:
        found = [_orders.get(key) for key in keys]
        for key, order in zip(keys, found, strict=True):
            if order is not None:
                _orders.move_to_end(key)
    return [keyed_order(*key) if order is None else order for key, order in zip(keys, found)]


def _keep(computed: list[tuple[OrderKey, np.ndarray]]) -> None:
    """Keep `computed` orders (read-only: shared by every plan of the process), the least
    recently used dropped beyond `ORDERS_BYTES`."""
    global _orders_bytes
    with _orders_lock:
        for key, order in computed:
            if key not in _orders:
                _orders[key] = order
                _orders_bytes += order.nbytes
        while _orders_bytes > ORDERS_BYTES and len(_orders) > 1:
            _orders_bytes -= _orders.popitem(last=False)[1].nbytes


def warm_orders(layouts: Sequence[SourceLayout], drawn: Iterable[tuple[int, int, int]]) -> None:
    """Compute together the shard and window orders of the (source, epoch, lane) draws `drawn`
    that no earlier draw led to (`keyed_order` computes one that follows a kept epoch with the
    next epochs'): a restore's first step draws from up to a row's worth of sources, each an
    order of its own (`permutation.orders`: one pass for all)."""
    wanted: dict[OrderKey, SourceLayout | None] = {}  # a window order's: its layout
    for source, epoch, lane in drawn:
        layout = layouts[source]
        if layout.windows_per_lane <= SMALL_DOMAIN:
            seed, name = layout.seed, layout.name
            window = (seed, "window-order", name, epoch, (lane,), layout.windows_per_lane)
            shard = (seed, "shard-order", name, epoch, (), layout.meta.num_shards)
            for key, owner in ((window, layout), (shard, None)):
                if key not in _orders and (seed, key[1], name, epoch - 1, *key[4:]) not in _orders:
                    wanted[key] = owner
    if len(wanted) > 1:
        keys = many_round_keys([(seed, p, name, e, *part) for seed, p, name, e, part, _ in wanted])
        computed = orders([key[5] for key in wanted], keys)
        _keep(list(zip(wanted, computed, strict=True)))
        for (key, owner), order in zip(wanted.items(), computed, strict=True):
            if owner is not None:  # its draws find it on the layout, not in `_orders`
                owner.keep_lane_order(key[3], key[4][0], order)


def window_draws(
    layouts: Sequence[SourceLayout], which: np.ndarray, counter: np.ndarray, lane: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`epoch_and_window` of the draws of several sources in one pass: draw i is the
    counter[i]-th window lane[i] draws from source layouts[which[i]] (a step's rows are
    grouped by (source, epoch, lane) in one Python pass over the rows, not a numpy pass per
    source). The drawn sources must be concat ones (`SourceLayout`); a draw in a transitional
    epoch (`Epochs`) takes its window from the transition's order and stream."""
    which, counter, lane = (np.asarray(a, dtype=np.int64) for a in (which, counter, lane))
    # the drawn sources' figures only (a mixture may have hundreds, a step draws a few), found
    # in Python: a step's rows are a few dozen
    sources = which.tolist()
    drawn = sorted(set(sources))
    drawn_layouts = [layouts[k] for k in drawn]
    figures = np.array([layout.figures for layout in drawn_layouts], dtype=np.int64)
    own = np.searchsorted(drawn, which)
    per_lane, first, first_epoch, lane_tokens, seq_len = figures[own].T
    epoch, k = np.divmod(counter - first, per_lane)
    epoch += first_epoch
    early = counter < first
    any_early = bool(early.any())
    if any_early:  # in a transitional epoch (the first counter of a layout without is 0)
        t_epoch, t_counter = (
            np.array([getattr(layout.transition, key, 0) for layout in drawn_layouts],
                     dtype=np.int64)[own[early]]
            for key in ("epoch", "counter")
        )  # fmt: skip
        epoch[early] = t_epoch
        k[early] = counter[early] - t_counter
    groups: dict[tuple[int, int, int, bool], list[int]] = {}
    row_keys = zip(sources, epoch.tolist(), lane.tolist(), early.tolist())
    for row, key in enumerate(row_keys):
        groups.setdefault(key, []).append(row)
    if groups and _unordered(layouts, next(iter(groups))):  # a restore: its orders at once
        warm_orders(layouts, [(source, e, ln) for source, e, ln, t in groups if not t])
    # A step's rows fall in up to one group each: per group, plain Python on its rows' ints
    # (a numpy call per group would cost more than the group's lookups), but one gather when
    # one group holds every row (one source, one lane).
    window, positions = [0] * k.size, k.tolist()
    for (source, e, ln, transitional), rows in groups.items():
        layout = layouts[source]
        if transitional:
            order = layout.transition.order(layout, ln)
        elif layout.windows_per_lane <= SMALL_DOMAIN:
            order = layout.lane_order(e, ln)
        else:  # every draw on its own
            mine = np.array([positions[r] for r in rows], dtype=np.int64)
            values = permute(mine, layout.windows_per_lane, layout._window_keys(e, ln))
            for r, value in zip(rows, values.tolist()):
                window[r] = value
            continue
        if len(rows) == k.size:
            window = order[k]
            break
        for r in rows:
            window[r] = order.item(positions[r])
    windows = np.asarray(window, dtype=np.int64)
    if any_early:  # a transitional epoch's lanes are its stream's
        lane_tokens = lane_tokens.copy()
        transitions = [getattr(layout.transition, "lane_tokens", 0) for layout in drawn_layouts]
        lane_tokens[early] = np.array(transitions, dtype=np.int64)[own[early]]
    return epoch, windows, lane * lane_tokens + windows * seq_len


def _unordered(layouts: Sequence[SourceLayout], group: tuple[int, int, int, bool]) -> bool:
    """Whether the window order of a step's first (source, epoch, lane, transitional) group
    is neither kept nor computed by `window_order` as it is: one lookup a step."""
    source, epoch, lane, transitional = group
    layout = layouts[source]
    if transitional or layout.windows_per_lane > SMALL_DOMAIN:
        return False
    key = (layout.seed, "window-order", layout.name, epoch, (lane,), layout.windows_per_lane)
    return key not in _orders


def window_pieces(
    layouts: Sequence[SourceLayout], which: np.ndarray, epochs: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, ...]:
    """The shard pieces of many windows, of several sources and epochs, in one vectorised pass.

    Window i is `seq_len + 1` tokens at starts[i] of epoch epochs[i]'s stream of source
    layouts[which[i]]. The shard bounds of every (source, epoch) stream the windows fall in are
    laid end to end, so one `searchsorted` finds every window's first shard and piece count
    (a window never leaves its stream: it lies inside a lane's range). Returns (which, shard,
    lo, hi, window, column): piece j is tokens [lo[j], hi[j]) of shard shard[j] of source
    which[j], for columns column[j].. of window window[j]; `read_pieces` copies them.
    """
    which, epochs, starts = (np.asarray(a, dtype=np.int64) for a in (which, epochs, starts))
    if not which.size:  # every row of the step is another kind of source's (best_fit)
        return tuple(np.empty(0, dtype=np.int64) for _ in range(6))
    # each window's (source, epoch) stream, numbered in order: a step draws from a few, and
    # most steps from the same ones (`_streams` keeps them laid end to end)
    keys = list(zip(which.tolist(), epochs.tolist()))
    numbers = {key: number for number, key in enumerate(sorted(set(keys)))}
    stream = [numbers[key] for key in keys]
    bounds, shards, offsets, owners, bases = _streams(layouts, numbers)
    length = layouts[0].seq_len + 1
    start = starts + bases[stream]
    first = bounds.searchsorted(start, side="right") - 1
    pieces = bounds.searchsorted(start + length, side="left") - first
    if pieces.max() == 1:  # the common step: every window inside one shard, a piece each
        offset = offsets[first] - bounds[first]
        window = np.arange(start.size)
        return (owners[first], shards[first], start + offset, start + (offset + length), window,
                np.zeros_like(window))  # fmt: skip
    window = np.repeat(np.arange(start.size), pieces)
    piece = first[window] + np.arange(window.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    lo = np.maximum(start[window], bounds[piece])
    hi = np.minimum(start[window] + length, bounds[piece + 1])
    keep = hi > lo  # an empty shard inside a window is no piece
    piece, window, lo, hi = piece[keep], window[keep], lo[keep], hi[keep]
    offset = offsets[piece] - bounds[piece]  # a piece may begin inside its shard
    return (owners[piece], shards[piece], lo + offset, hi + offset, window,
            lo - start[window])  # fmt: skip


STREAMS_KEPT = 32  # the steps' sets of streams laid end to end (`_streams`) kept at once
STREAM_PIECES_KEPT = 1 << 14  # ... of at most this many pieces each (~1 MiB with its tables)
_laid: dict[tuple[int, ...], tuple] = {}


def _streams(
    layouts: Sequence[SourceLayout], numbers: dict[tuple[int, int], int]
) -> tuple[np.ndarray, ...]:
    """The shard tables of the (source, epoch) streams `numbers` (`_piece_table`, cached per
    layout; source: an index of `layouts`) laid end to end, in their numbers' order: (bounds,
    shards, offsets, source) of each piece of a stream, the bounds shifted past the streams
    before it and followed by the end, and each stream's shift. Kept per (tables, sources)
    (`STREAMS_KEPT`): most steps of a run draw from the streams of the step before, so a step
    is a few Python calls, not ten numpy calls; an entry holds its tables, so their ids, in
    its key, stay theirs. A layout of stores of many shards is not kept
    (`STREAM_PIECES_KEPT`)."""
    found = [layouts[k].kept_table(epoch) for k, epoch in numbers]
    if None in found:
        laid = _fill_tables(layouts, list(numbers), found)
        if laid is not None:  # every stream new (a restore's first steps): laid out already
            return laid
    tables, ends = zip(*found)
    key = (*map(id, tables), *(k for k, _ in numbers))  # the owners are indexes of `layouts`
    kept = _laid.get(key)
    if kept is not None and all(a is b for a, b in zip(kept[0], tables)):
        return kept[1]
    sizes = np.array([table.shape[1] for table in tables], dtype=np.int64)
    ends = np.cumsum(ends, dtype=np.int64)
    bases = np.concatenate([[0], ends[:-1]])
    bounds, shards, offsets = np.concatenate(tables, axis=1)
    bounds = np.append(bounds + np.repeat(bases, sizes), ends[-1])
    owners = np.repeat(np.array([k for k, _ in numbers], dtype=np.int64), sizes)
    laid = (bounds, shards, offsets, owners, bases)
    if bounds.size <= STREAM_PIECES_KEPT:
        if len(_laid) >= STREAMS_KEPT:
            _laid.clear()
        _laid[key] = (tables, laid)
    return laid


def _fill_tables(
    layouts: Sequence[SourceLayout],
    streams: list[tuple[int, int]],
    found: list[tuple[np.ndarray, int] | None],
) -> tuple[np.ndarray, ...] | None:
    """The shard tables (`_piece_table`) of the (source, epoch) `streams` not kept (None in
    `found`), computed, kept on their layouts and put in `found`: the streams of every shard
    whole (`whole_shards`) in one pass over their shard orders laid end to end (a restore's
    first steps draw dozens of sources, each a few numpy calls on its own), the others one by
    one. When every stream is new and whole, `_streams`' answer (they are laid end to end in
    its order already), else None."""
    whole = []
    for i, (k, epoch) in enumerate(streams):
        if found[i] is None:
            layout = layouts[k]
            if layout.whole_shards(epoch):
                whole.append(i)
            else:
                found[i] = layout.keep_table(epoch, layout._piece_table(epoch))
    if not whole:
        return None
    mine = [layouts[streams[i][0]] for i in whole]
    epochs = [streams[i][1] for i in whole]
    counts = [layout.meta.num_shards for layout in mine]
    shard = np.concatenate(
        keyed_orders(
            [
                (layout.seed, "shard-order", layout.name, epoch, (), count)
                for layout, epoch, count in zip(mine, epochs, counts, strict=True)
            ]
        )
    )
    sizes = np.array(counts, dtype=np.int64)
    ends = np.cumsum(sizes)
    firsts = np.repeat(ends - sizes, sizes)  # each stream's first shard in `tokens`
    tokens = np.concatenate([layout.meta.shard_tokens for layout in mine])
    tokens = tokens.take(shard + firsts).astype(np.int64, copy=False)  # in stream order
    before = np.cumsum(tokens) - tokens  # each shard's start, less its stream's: below
    table = np.zeros((3, shard.size), dtype=np.int64)  # stream start, shard, 0
    table[0] = before - before.take(firsts)
    table[1] = shard
    bounds = [0, *ends.tolist()]
    totals = (before.take(ends - 1) + tokens.take(ends - 1) - before.take(ends - sizes)).tolist()
    for j, (layout, epoch) in enumerate(zip(mine, epochs, strict=True)):
        lo, hi = bounds[j], bounds[j + 1]
        found[whole[j]] = layout.keep_table(epoch, (table[:, lo:hi], totals[j]))
    if len(whole) < len(streams):
        return None
    owners = np.repeat(np.array([k for k, _ in streams], dtype=np.int64), sizes)
    end = before[-1:] + tokens[-1:]
    return np.concatenate([before, end]), shard, table[2], owners, before.take(ends - sizes)


LAYOUT = SourceLayout
