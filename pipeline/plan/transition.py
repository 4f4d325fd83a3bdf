"""The rest of an epoch laid out anew when a switch changes `seq_len` or `lanes` (concat sources).

A switch that changes a source's geometry (docs/steering.md, "Context extension") in the middle
of its epoch e must not serve again what epoch e served before it, nor leave out what it had
not. So the new segment's layout begins with a *transitional epoch* (`epochs.Epochs`) made of
what is left of epoch e:

* **Served.** The old layout at the carried counter c has served, in epoch e, the windows its
  lanes drew so far. A window of `seq_len + 1` tokens at stream position s covers the *edges*
  (consecutive token pairs) s .. s + seq_len - 1; consecutive windows share a token, never an
  edge, so "no token sequence twice" is "no edge twice". The served edges are merged into
  intervals (`served`); a layout that is itself transitional in epoch e adds the edges of its
  drawn transitional windows to those it began with, so switches chain.
* **Left.** The complement in the epoch stream's edges (the old lane tails included) is a list
  of maximal free runs; the token ranges of the documents the new layout excludes
  (`removed_ranges`, docs/steering.md "Take documents down") are cut out too, and no two
  runs are one edge apart (`unjoinable`). The runs, laid end to end, are the transition's
  `Stream`.
* **Laid out.** That stream is cut as any epoch stream is (`layout`): `lanes` equal ranges,
  W_t = (Q_t - 1) // seq_len windows each, the window order of each lane a keyed bijection per
  (seed, source, epoch, lane, c), so it differs from the regular epoch's and from another
  transition's. A window that spans two runs begins a new document where they join
  (`read.windows`). Tokens left: under `lanes * seq_len` (the lane tails), as in any epoch.
* **After.** Regular epochs e + 1, e + 2, ... of the new geometry, from counter c + W_t.

Everything is a pure function of the two layouts and c (the ledger and the store's metadata);
the cost is O(windows of epoch e) once per process and transition (a few arrays of int64 per
window; cached with the segment's plan), never growing with the step.
"""

from __future__ import annotations

import threading

import numpy as np

from pipeline.plan.epochs import Transition
from pipeline.plan.layout import SourceLayout, window_order
from pipeline.plan.packing import PackedLayout
from pipeline.plan.permutation import permutation, round_keys
from pipeline.plan.repack import repacked
from pipeline.plan.row_layout import RowLayout

Intervals = tuple[np.ndarray, np.ndarray]
"""Half-open [starts[i], stops[i]) ranges, int64."""

NONE: Intervals = (np.empty(0, np.int64), np.empty(0, np.int64))


def merged(starts: np.ndarray, stops: np.ndarray) -> Intervals:
    """The union of ranges, as sorted disjoint ranges (touching ones joined)."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    keep = stops > starts
    starts, stops = starts[keep], stops[keep]
    if not starts.size:
        return NONE
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], np.maximum.accumulate(stops[order])
    new = np.concatenate([[True], starts[1:] > stops[:-1]])
    last = np.append(np.flatnonzero(new)[1:] - 1, starts.size - 1)
    return starts[new], stops[last]


def complement(size: int, taken: Intervals) -> Intervals:
    """[0, size) less the sorted disjoint ranges `taken`, as non-empty ranges."""
    starts = np.concatenate([[0], taken[1]])
    stops = np.concatenate([taken[0], [size]])
    keep = stops > starts
    return starts[keep], stops[keep]


class Stream:
    """Runs of an epoch stream laid end to end: run i is tokens [real[i], real[i] + length[i])
    of the epoch stream, and tokens [virtual[i], virtual[i + 1]) of this one."""

    def __init__(self, real: np.ndarray, length: np.ndarray) -> None:
        self.real = np.asarray(real, np.int64)
        self.length = np.asarray(length, np.int64)
        self.virtual = np.concatenate([[0], np.cumsum(self.length)]).astype(np.int64)

    @classmethod
    def of_free_edges(cls, free: Intervals) -> Stream:
        """The stream of the free edge runs: run [a, b) of edges is tokens [a, b + 1)."""
        return cls(free[0], free[1] - free[0] + 1)

    @property
    def tokens(self) -> int:
        return int(self.virtual[-1])

    def edge_pieces(self, starts: np.ndarray, edges: int) -> tuple[np.ndarray, ...]:
        """The epoch stream's edges that windows of `edges` edges at `starts` of this stream
        cover (a window across a joint covers no edge there), as (window, lo, hi) pieces."""
        starts = np.asarray(starts, np.int64)
        ends = self.virtual[1:] - 1  # run i's edges: [virtual[i], ends[i]) here
        first = np.searchsorted(self.virtual, starts, side="right") - 1
        last = np.searchsorted(self.virtual, starts + edges, side="left") - 1
        counts = last - first + 1
        window = np.repeat(np.arange(starts.size), counts)
        run = first[window] + np.arange(window.size) - np.repeat(np.cumsum(counts) - counts, counts)
        lo = np.maximum(starts[window], self.virtual[run])
        hi = np.minimum(starts[window] + edges, ends[run])
        shift = self.real[run] - self.virtual[run]
        keep = hi > lo
        return window[keep], lo[keep] + shift[keep], hi[keep] + shift[keep]

    def shard_table(self, order: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, ...]:
        """`SourceLayout._shard_starts` of this stream, from the epoch stream's (shards in
        `order`, shard k at [bounds[k], bounds[k + 1])): (shard, start here, first token in
        the shard) per piece, the stream's end after the starts."""
        real, stop = self.real, self.real + self.length
        first = np.searchsorted(bounds, real, side="right") - 1
        last = np.searchsorted(bounds, stop, side="left") - 1
        counts = last - first + 1
        run = np.repeat(np.arange(real.size), counts)
        shard = first[run] + np.arange(run.size) - np.repeat(np.cumsum(counts) - counts, counts)
        lo = np.maximum(real[run], bounds[shard])
        hi = np.minimum(stop[run], bounds[shard + 1])
        keep = hi > lo
        run, shard, lo = run[keep], shard[keep], lo[keep]
        starts = np.append(self.virtual[run] + lo - real[run], self.tokens)
        return order[shard], starts, lo - bounds[shard]


class StreamTransition(Transition):
    """A concat source's transitional epoch: windows of `seq_len + 1` tokens of `stream` (what
    epoch `epoch` had left at counter `counter`), `windows` per lane, lane l owning stream
    tokens [l * lane_tokens, (l + 1) * lane_tokens); `served` the epoch stream's edges served
    before it began."""

    def __init__(
        self, layout: SourceLayout, epoch: int, counter: int, stream: Stream, served: Intervals
    ) -> None:
        self.stream = stream
        self.served = served
        self.lane_tokens = stream.tokens // layout.lanes
        windows = max(0, (self.lane_tokens - 1) // layout.seq_len)
        super().__init__(epoch, counter, windows)
        self._orders: dict[int, np.ndarray] = {}
        self._table: tuple[np.ndarray, ...] | None = None
        self._lock = threading.Lock()

    def order(self, layout: SourceLayout, lane: int) -> np.ndarray:
        """Lane `lane`'s window order: a keyed bijection of its windows (cached, read-only)."""
        with self._lock:
            order = self._orders.get(lane)
            if order is None:
                keys = round_keys(
                    layout.seed, "transition-order", layout.name, self.epoch, lane, self.counter
                )
                order = permutation(self.windows, keys)
                order.flags.writeable = False
                self._orders[lane] = order
        return order

    def shard_table(self, layout: SourceLayout) -> tuple[np.ndarray, ...]:
        """`SourceLayout._shard_starts` of the transitional epoch (computed once)."""
        with self._lock:
            if self._table is None:
                order, bounds, _ = layout.stream_shards(self.epoch)
                self._table = self.stream.shard_table(order, bounds)
            return self._table


def served(layout: SourceLayout, counter: int) -> tuple[int, Intervals]:
    """(epoch, the epoch stream's edges served in it) by `layout`'s lanes before draw `counter`
    (the same on every lane: counters are)."""
    epoch, k, early = (int(a[0]) for a in layout.place(np.array([counter])))
    transition = layout.transition
    if early:  # the transitional epoch: its first k windows a lane, after what it began with
        assert isinstance(transition, StreamTransition)
        width, before = transition.lane_tokens, transition.served
        orders = [transition.order(layout, lane) for lane in range(layout.lanes)]
    else:
        width, before, windows = layout.lane_tokens, NONE, layout.windows_per_lane
        orders = [
            window_order(layout.seed, layout.name, epoch, lane, windows)
            for lane in range(layout.lanes)
        ]
    starts = np.concatenate(
        [lane * width + order[:k] * layout.seq_len for lane, order in enumerate(orders)]
    ).astype(np.int64)
    _, lo, hi = window_edges(layout, epoch, starts)
    return epoch, merged(np.concatenate([before[0], lo]), np.concatenate([before[1], hi]))


def window_edges(layout: SourceLayout, epoch: int, starts: np.ndarray) -> tuple[np.ndarray, ...]:
    """(window, lo, hi): the edges of epoch `epoch`'s whole stream that `layout`'s windows at
    `starts` (their `Draws.start`) cover, a piece per run a window spans. Every layout of a
    store numbers an epoch's edges alike, so the audit compares what each served."""
    transition = layout.transition
    if isinstance(transition, StreamTransition) and epoch == transition.epoch:
        return transition.stream.edge_pieces(starts, layout.seq_len)
    return layout.edge_pieces(epoch, starts)


def unjoinable(taken: Intervals, edges: int) -> Intervals:
    """`taken` with each lone taken edge b between two free runs widened by the edge after it.
    Else the runs would meet at tokens b and b + 1: a window across that joint would serve the
    pair (b, b + 1), edge b, again. A lone edge is what a window clipped at a joint served of
    a run (its last or first edge); the edge beyond was taken too unless a switch has freed
    it since (a take-down dropped), so this costs an edge per such window, else nothing."""
    starts, stops = taken
    lone = (stops - starts == 1) & (starts > 0) & (stops < edges)
    if not lone.any():
        return taken
    return merged(starts, np.where(lone, stops + 1, stops))


def relaid(before: SourceLayout, after: SourceLayout, counter: int) -> SourceLayout:
    """`after` (a new layout of the same store, another geometry or other documents excluded)
    continuing `before` from draw `counter`: the rest of `before`'s epoch there as a
    transitional epoch, then `after`'s regular epochs (module docstring); the token ranges
    `after` never serves (`removed_ranges`: the documents it excludes) are left out. `after`
    is changed in place and returned."""
    epoch, done = served(before, counter)
    edges = before.meta.num_tokens - 1
    removed = after.removed_ranges(epoch)  # sorted, disjoint
    taken = done
    if removed[0].size:  # every edge that touches a removed token (inside the stream)
        lo, hi = np.maximum(removed[0] - 1, 0), np.minimum(removed[1], edges)
        taken = merged(np.concatenate([done[0], lo]), np.concatenate([done[1], hi]))
    if not taken[0].size:  # nothing of epoch e served yet: it is a regular epoch of `after`
        after.continue_epochs(counter, epoch, None)
        return after
    stream = Stream.of_free_edges(complement(edges, unjoinable(taken, edges)))
    # what was served, not what was removed: a later switch that stops removing them gives
    # the removed documents' edges back to the epoch (as `repack` does for best_fit)
    transition = StreamTransition(after, epoch, counter, stream, done)
    if transition.windows < 1:  # too little left for a window per lane: tails
        after.continue_epochs(counter, epoch + 1, None)
    else:
        after.continue_epochs(counter + transition.windows, epoch + 1, transition)
    return after


def continued(before: RowLayout, after: RowLayout, counter: int) -> RowLayout:
    """The layout a segment draws a source with after a segment that drew it with `before`
    (counter `counter` carried): with the same geometry and the same excluded documents,
    `after` taking over `before`'s epochs (transitional or not: they go on; `after` reads the
    store at this segment's path), else `after` continuing `before` from a transitional epoch
    (`relaid`, `repack.repacked`, which leaves out what `after` excludes)."""
    if (before.seq_len, before.lanes, _excluded(before)) == (
        after.seq_len, after.lanes, _excluded(after)
    ):  # fmt: skip
        after.continue_epochs(before.first_counter, before.first_epoch, before.transition)
        if isinstance(after, PackedLayout):  # its transitional rows are in its row arrays
            after.row_offsets, after.row_docs = before.row_offsets, before.row_docs
        return after
    if isinstance(after, SourceLayout) and isinstance(before, SourceLayout):
        return relaid(before, after, counter)
    assert isinstance(after, PackedLayout) and isinstance(before, PackedLayout)  # `carries`
    return repacked(before, after, counter, after.excluded.documents)


def _excluded(layout: RowLayout) -> str:
    """The digest of the ids a layout excludes ("" for none)."""
    return layout.excluded.digest
