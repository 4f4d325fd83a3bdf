"""Which source each lane position draws from: an exact counting function, O(1) in the position.

The sources form a balanced binary tree. Every internal node splits the rows it receives between
its two halves by rounding a running target: after the node has received C rows, its left half
has received `floor(Omega + 1/2)` of them, where Omega is the sum over those rows of the left
half's share of the node's weight *at that row's step*. Then

* counts only grow, and every position goes to exactly one source (it is a real assignment);
* a two-source mix is within 1/2 row of its exact share at every position. Below the root a
  node's own count is off by at most E, and a child's error is the rounding (1/2) plus the
  node's error weighted by the child's share: at most 1/2 + E * (max share + total variation
  of the share over the steps). `error_bounds()` evaluates this per source; with constant
  weights up to 4 sources it is below 1 row, and it never grows with time;
* weights that change with the step are followed row by row, and a change at step S affects
  the first row of step S and no row before it.

Weights are piecewise constant: piece j holds from step `starts[j]` to the next start, and the
tail from the horizon on; steps need not hold the same number of rows (a batch-size schedule),
but inside a piece they do. So a node's Omega grows linearly with its count inside a piece, and
Omega and C are precomputed per node only at piece boundaries (cumulative sums); a position's
piece is found by bisection. Memory and time grow with the number of pieces, never with the
step (a schedule point at step 10^12 costs what one at step 10 costs). With one piece per step
this is exactly the per-step sum.

Drawing a step's rows (`sources`) walks each row down the tree to its source
(`mix_tree.descend`): ~log2(K) nodes a row, not the K - 1 that counting every source takes, so
a step costs the same with 256 sources as with 2.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipeline.plan.mix_tree import EXACT, descend, descend_constant, tree


@dataclass(frozen=True)
class _Split:
    """One internal node: sources [lo, mid) go left, [mid, hi) go right."""

    lo: int
    mid: int
    hi: int
    omega: np.ndarray  # left share of the node's weight per piece, then the tail's, [P + 1]
    cum_omega: np.ndarray  # Omega at each piece boundary, [P + 1]
    count: np.ndarray  # rows received by the node at each piece boundary, [P + 1]


@dataclass(frozen=True)
class _Level:
    """The internal nodes of one level of the tree, left to right: `_Split`'s fields as arrays
    ([nodes], or [nodes, P + 1]) for `Mixture.counts` to compute a level at a time."""

    lo: np.ndarray
    mid: np.ndarray
    hi: np.ndarray
    omega: np.ndarray
    cum_omega: np.ndarray
    count: np.ndarray


class Mixture:
    """Rows of each source among lane positions [0, p), for a weight matrix over steps.

    `weights` has shape [P, K]: relative weights of pieces 0..P-1 (rows need not sum to 1 but
    must not be all zero), piece j from step `starts[j]` (default: piece j is step j) to the
    next start or `horizon` (default P); `tail` [K] holds from step `horizon` on. `step_rows`
    lane positions make a step: one number, or one per piece (how many after the horizon does
    not matter: the tail's weights are constant).
    """

    def __init__(
        self,
        weights: np.ndarray,
        tail: np.ndarray,
        step_rows: int | np.ndarray,
        starts: np.ndarray | None = None,
        horizon: int | None = None,
    ) -> None:
        self.weights, self.tail, rows, self.starts, self.horizon = _numbers(
            weights, tail, step_rows, starts, horizon
        )
        self.num_sources = self.tail.shape[0]
        self._steps = np.append(self.starts, self.horizon)  # [P + 1]
        self.piece_starts = np.concatenate([[0], np.cumsum(np.diff(self._steps) * rows)])
        self._pieces = np.vstack([self.weights, self.tail])  # [P + 1, K]: what `_build` splits
        self._levels = self._build()  # the splits, a level of the tree at a time
        # the splits as flat [tree nodes x (P + 1)] tables (pass-through nodes: zeros), for
        # `sources` to gather one node a row
        self._tree = tree(self.num_sources)
        real = np.flatnonzero(self._tree.split >= 0)
        rows = self._level_rows(self._tree.lo[real], self._tree.hi[real]) if real.size else None
        self._tables = []
        for key, dtype in (("cum_omega", np.float64), ("omega", np.float64), ("count", np.int64)):
            table = np.zeros((len(self._tree.split), len(self.piece_starts)), dtype)
            if real.size:
                table[real] = np.concatenate([getattr(level, key) for level in self._levels])[rows]
            self._tables.append(table.reshape(-1))
        # constant weights: each node's left share at twice its index (`descend_constant`)
        self._omega2 = np.repeat(self._tables[1], 2) if len(self.piece_starts) == 1 else None

    def _level_rows(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """The rows of the nodes [lo, hi) among the levels' splits, concatenated."""
        width = self.num_sources + 1
        keys = np.concatenate([level.lo * width + level.hi for level in self._levels])
        order = np.argsort(keys)
        return order[np.searchsorted(keys, lo * width + hi, sorter=order)]

    @cached_property
    def _splits(self) -> list[_Split]:
        """The splits node by node, in pre-order (a node, its left subtree, its right): for
        `error_bounds` (and tests), not a restore's start."""
        built: dict[tuple[int, int], _Split] = {}
        for level in self._levels:
            for i, (a, b, c) in enumerate(
                zip(*(x.tolist() for x in (level.lo, level.mid, level.hi)))
            ):
                built[a, c] = _Split(a, b, c, level.omega[i], level.cum_omega[i], level.count[i])
        order: list[_Split] = []
        todo = [(0, self.num_sources)]
        while todo:  # pre-order
            split = built.get(todo.pop())
            if split is not None:
                order.append(split)
                todo += [(split.mid, split.hi), (split.lo, split.mid)]
        return order

    def weights_at(self, step: int) -> np.ndarray:
        """[K] the weights that hold at `step`."""
        piece = int(np.searchsorted(self._steps, step, side="right")) - 1
        return self.weights[piece] if piece < len(self.starts) else self.tail

    def counts(self, positions: np.ndarray) -> np.ndarray:
        """[..., K] rows of each source before each position: a level of the tree at a time
        (a restore's first step asks it of hundreds of sources), each node's numbers the
        same elementwise operations as node by node."""
        positions = np.asarray(positions, dtype=np.int64)
        flat = positions.reshape(-1)
        step = np.searchsorted(self.piece_starts, flat, side="right") - 1
        out = np.empty((self.num_sources, flat.size), dtype=np.int64)
        lo, hi, received = np.array([0]), np.array([self.num_sources]), flat[None, :]
        for level in self._levels:  # `received`: [nodes, positions]
            leaf = hi - lo == 1  # a node of one source: its counts
            out[lo[leaf]] = received[leaf]
            received = received[~leaf]
            at = (slice(None), step)
            cum = level.cum_omega[at] + level.omega[at] * (received - level.count[at])
            left = np.floor(cum + 0.5).astype(np.int64)
            lo, hi = np.concatenate([level.lo, level.mid]), np.concatenate([level.mid, level.hi])
            received = np.concatenate([left, received - left])
        out[lo] = received
        return np.moveaxis(out, 0, -1).reshape(*positions.shape, self.num_sources)

    def error_bounds(self) -> np.ndarray:
        """[K] proven bounds on |rows of a source before p - its exact share| over all p."""
        bounds = {(0, self.num_sources): 0.0}
        for split in self._splits:  # parents are built before their children
            node = bounds.pop((split.lo, split.hi))
            variation = float(np.abs(np.diff(split.omega)).sum())
            left, right = split.omega.max(), (1.0 - split.omega).max()
            bounds[(split.lo, split.mid)] = 0.5 + node * (left + variation)
            bounds[(split.mid, split.hi)] = 0.5 + node * (right + variation)
        out = np.empty(self.num_sources)
        for (lo, _), bound in bounds.items():
            out[lo] = bound
        return out

    def sources(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, that source's count before the row) for each position."""
        positions = np.asarray(positions, dtype=np.int64)
        if self.num_sources == 1:  # every position is the only source's, its count the position
            return np.zeros_like(positions), positions.copy()
        flat = positions.reshape(-1)
        if self._omega2 is not None and flat.size and flat.max() < EXACT - 1:
            source, count = descend_constant(self._tree, self._omega2, flat)
            return source.reshape(positions.shape), count.reshape(positions.shape)
        before, after = np.searchsorted(self.piece_starts, (flat, flat + 1), side="right") - 1
        if (before == after).all():  # no row ends a piece: one gather a level
            after = before
        source, count = descend(self._tree, self._left_pair, flat, before, after)
        return source.reshape(positions.shape), count.reshape(positions.shape)

    def _left_pair(
        self, node: np.ndarray, before: np.ndarray, after: np.ndarray, count: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The left counts of `node`s after `count` rows (in pieces `before`) and after
        `count + 1` (in pieces `after`): `counts`' formula, on one node a row."""
        # A step walks its rows down the tree one level at a time, each level these few numpy
        # calls: in place, and with one piece (constant weights) only omega's, as every node's
        # Omega and count at the first piece's start are 0 (0 + x is x, bit for bit).
        width, (cum_table, omega_table, received_table) = len(self.piece_starts), self._tables
        if width == 1:
            cum, omega, since = None, omega_table.take(node), count
        else:
            at = node * width + before
            cum, omega, since = cum_table.take(at), omega_table.take(at), received_table.take(at)
            since = count - since
        left = _rounded(omega * since, cum).astype(np.int64)
        if after is not before:
            at = node * width + after
            cum, omega, since = cum_table.take(at), omega_table.take(at), received_table.take(at)
            since = count - since
        return left, _rounded(omega * (since + 1), cum)

    def _build(self) -> list[_Level]:
        """Every internal node's split, computed a level of the tree at a time (one set of
        numpy calls a level but its weight sums, not a node: a mixture of hundreds of sources
        is laid out at every start), the same numbers as node by node: elementwise operations
        and each node's Omega, a running sum over its own pieces."""
        levels: list[_Level] = []
        lo, hi = np.array([0]), np.array([self.num_sources])
        count = self.piece_starts[None, :]  # [nodes, P + 1]: each node's received rows
        while (hi - lo > 1).any():
            inner = hi - lo > 1  # the others are leaves
            lo, hi, count = lo[inner], hi[inner], count[inner]
            mid = (lo + hi) // 2
            omega = _left_share(self._pieces, lo, mid, hi)
            cum_omega = np.zeros(count.shape)
            np.cumsum(omega[:, :-1] * np.diff(count, axis=1), axis=1, out=cum_omega[:, 1:])
            levels.append(_Level(lo, mid, hi, omega, cum_omega, count))
            left = np.floor(cum_omega + 0.5).astype(np.int64)
            lo, hi = np.concatenate([lo, mid]), np.concatenate([mid, hi])
            count = np.concatenate([left, count - left])
        return levels


def mixture_of(
    weights: np.ndarray,
    tail: np.ndarray,
    step_rows: int | np.ndarray,
    starts: np.ndarray | None = None,
    horizon: int | None = None,
) -> Mixture:
    """`Mixture(weights, tail, step_rows, starts, horizon)`, the one made before while a plan
    still holds it (`_live`): a mixture is a pure function of these numbers, and a feed lays
    the same one out at its start and again at a restore's `adopt`, a `set_mix`, a second
    feed of the config (~2.5 us a source at 1,024 sources). Shared, so read-only; kept by
    nothing but its plans (a schedule of many pieces weighs megabytes)."""
    *arrays, horizon = _numbers(weights, tail, step_rows, starts, horizon)
    key = (arrays[0].shape, *(a.tobytes() for a in arrays), horizon)
    with _lock:
        kept = _live.get(key)
    if kept is None:
        views = [np.frombuffer(k, a.dtype).reshape(a.shape) for k, a in zip(key[1:], arrays)]
        kept = Mixture(*views, horizon)
        with _lock:
            kept = _live.setdefault(key, kept)
    return kept


def _numbers(
    weights: np.ndarray,
    tail: np.ndarray,
    step_rows: int | np.ndarray,
    starts: np.ndarray | None,
    horizon: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """A mixture's numbers as it keeps them: float weights [P, K] and tail [K], the rows of
    each piece's steps [P], int64 starts [P] (default: piece j at step j) and the horizon
    (default: P)."""
    weights = np.asarray(weights, dtype=np.float64)
    pieces = weights.shape[0]
    rows = np.broadcast_to(np.asarray(step_rows, dtype=np.int64), (pieces,))
    starts = np.arange(pieces) if starts is None else np.asarray(starts)
    horizon = pieces if horizon is None else int(horizon)
    return weights, np.asarray(tail, dtype=np.float64), rows, starts.astype(np.int64), horizon


_live: weakref.WeakValueDictionary[tuple, Mixture] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def _rounded(share: np.ndarray, cum: np.ndarray | None) -> np.ndarray:
    """floor(cum + share + 1/2), in `share`'s buffer (no cum: 0)."""
    if cum is not None:
        share += cum
    share += 0.5
    return np.floor(share, out=share)


def _left_share(weights: np.ndarray, lo: np.ndarray, mid: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """[nodes, P + 1]: the left half's share of each node's weight [lo, hi) per piece. Each
    sum is numpy's of that node's columns alone (`weights[:, lo:mid].sum(axis=1)`): how numpy
    orders a float sum depends on the array's shape, and the counts must not change. The
    halves of one width (a level has at most two) are summed in one call, each its own
    contiguous row of that width: the pairwise sum numpy makes of that node's columns."""
    left, right = (np.empty((lo.size, weights.shape[0])) for _ in range(2))
    for half, start, stop in ((left, lo, mid), (right, mid, hi)):
        widths = stop - start
        for width in set(widths.tolist()):  # a level has one or two (np.unique costs more)
            nodes = np.flatnonzero(widths == width)
            columns = start[nodes, None] + np.arange(width)  # [nodes, width]
            # [P + 1, nodes, width], C-ordered (an index `weights[:, columns]` is not: numpy
            # would then order the sums otherwise)
            half[nodes] = weights.take(columns, axis=1).sum(axis=-1).T
    total = left + right
    return np.divide(left, total, out=np.zeros_like(total), where=total > 0)


def fixed_counts(weights: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[..., K] rows of each source among the first `rows` [...] positions under constant
    integer `weights` ([K], or [..., K] one set per entry of `rows`; not all 0): `Mixture`'s
    tree and rounding, in exact integer arithmetic.

    A node with weights wL | wR that received n rows gives its left half floor(n * wL / W +
    1/2), W = wL + wR, computed as q * wL + (2 * r * wL + W) // (2 * W) with (q, r) = divmod(n,
    W): no float, no overflow for W < 2^31, so every host gets the same counts bit for bit.
    """
    weights = np.asarray(weights, dtype=np.int64)
    rows = np.asarray(rows, dtype=np.int64)
    out = np.empty((*np.broadcast_shapes(rows.shape, weights.shape[:-1]), weights.shape[-1]),
                   dtype=np.int64)  # fmt: skip
    # source-major: a node's weights are sums of whole columns, not of E short rows (~50x
    # faster for a restore's 10,000 entries; the same integers)
    columns = np.ascontiguousarray(np.moveaxis(weights, -1, 0))

    def split(lo: int, hi: int, n: np.ndarray) -> None:
        if hi - lo == 1:
            out[..., lo] = n
            return
        mid = (lo + hi) // 2
        left_weight = columns[lo:mid].sum(0)
        total = left_weight + columns[mid:hi].sum(0)
        q, r = np.divmod(n, np.maximum(total, 1))  # a node without weight receives no row
        left = q * left_weight + (2 * r * left_weight + total) // np.maximum(2 * total, 1)
        split(lo, mid, left)
        split(mid, hi, n - left)

    split(0, weights.shape[-1], rows)
    return out


class Steered:
    """A stage's mixture whose weights the run set from some of its steps on (`DataFeed.set_mix`).

    Before the first set step the stage's own `Mixture` decides; from set step e on, constant
    integer weights w_e do, counting afresh: rows before position p >= start_e are the counts at
    start_e plus `fixed_counts(w_e, p - start_e)`. So each piece keeps `Mixture`'s guarantee
    with constant weights (within `error_bounds()` of the exact share of the rows since its
    start), whatever came before it. The counts at each start are computed once, here, in one
    vectorised pass (O(E)); a position's piece is found by bisection (O(log E)).
    """

    def __init__(
        self, base: Mixture, steps: np.ndarray, starts: np.ndarray, weights: np.ndarray
    ) -> None:
        self.base = base  # the stage's own mixture, before the first set step
        self.num_sources = base.num_sources
        self.set_steps = np.asarray(steps, dtype=np.int64)  # stage-local steps, increasing
        self.positions = np.asarray(starts, dtype=np.int64)  # their first lane positions
        self.set_weights = np.asarray(weights, dtype=np.int64)  # [E, K]
        # counts at each start: the base's at the first, then each piece's rows added
        pieces = fixed_counts(self.set_weights[:-1], np.diff(self.positions))
        first = base.counts(self.positions[:1])
        self.at = np.cumsum(np.concatenate([first, pieces]), axis=0)
        # where the weights may change, for `ScheduledSources`: the stage's own points before
        # the first set step, then the set steps
        own = base.starts[base.starts < self.set_steps[0]]
        self.starts = np.concatenate([own, self.set_steps])
        self.horizon = int(self.set_steps[-1])
        # each piece's weights summed from source 0: a node's weights are two differences
        self._prefix = np.zeros((len(self.set_weights), self.num_sources + 1), np.int64)
        np.cumsum(self.set_weights, axis=1, out=self._prefix[:, 1:])

    def weights_at(self, step: int) -> np.ndarray:
        """[K] the weights that hold at stage-local `step`."""
        piece = int(np.searchsorted(self.set_steps, step, side="right")) - 1
        if piece < 0:
            return self.base.weights_at(step)
        return self.set_weights[piece].astype(np.float64)

    def counts(self, positions: np.ndarray) -> np.ndarray:
        """[..., K] rows of each source before each position."""
        positions = np.asarray(positions, dtype=np.int64)
        piece = np.searchsorted(self.positions, positions, side="right") - 1
        out = np.empty((*positions.shape, self.num_sources), dtype=np.int64)
        for e in np.unique(piece).tolist():
            mask = piece == e
            if e < 0:
                out[mask] = self.base.counts(positions[mask])
            else:
                since = positions[mask] - self.positions[e]
                out[mask] = self.at[e] + fixed_counts(self.set_weights[e], since)
        return out

    def sources(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, that source's count before the row) for each position: a row of
        piece e is the row `positions - start_e` of `fixed_counts(w_e)`, walked down the tree
        (`mix_tree.descend`), after the counts at start_e (the next piece's counts at its
        start are this piece's there, so a piece's last row needs no other)."""
        positions = np.asarray(positions, dtype=np.int64)
        flat = positions.reshape(-1)
        piece = np.searchsorted(self.positions, flat, side="right") - 1
        source, count = np.empty_like(flat), np.empty_like(flat)
        early = piece < 0
        if early.any():
            source[early], count[early] = self.base.sources(flat[early])
        late = ~early
        if late.any():
            e = piece[late]
            since = flat[late] - self.positions[e]
            drawn, before = descend(self.base._tree, self._left_pair, since, e, e)
            source[late], count[late] = drawn, self.at[e, drawn] + before
        return source.reshape(positions.shape), count.reshape(positions.shape)

    def _left_pair(
        self, node: np.ndarray, piece: np.ndarray, same: np.ndarray, count: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The left counts of `node`s after `count` and `count + 1` rows under piece `piece`'s
        weights (`same`: the piece again): `fixed_counts`' integer formula, one node a row."""
        tree, prefix = self.base._tree, self._prefix
        low = prefix[piece, tree.lo[node]]
        left_weight = prefix[piece, tree.mid[node]] - low
        total = prefix[piece, tree.hi[node]] - low

        def left(n: np.ndarray) -> np.ndarray:
            q, r = np.divmod(n, np.maximum(total, 1))
            return q * left_weight + (2 * r * left_weight + total) // np.maximum(2 * total, 1)

        return left(count), left(count + 1)
