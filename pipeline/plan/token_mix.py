"""`mix_unit: tokens`: a stage whose sources share its *tokens*, not its rows, by their weights.

Row weights give a best_fit source rows that carry fewer tokens than a concat source's windows
(padding, short documents), so its share of the trained tokens drifts below its weight. Here a
stage's rows are ordered by *virtual finish time* instead (weighted fair queuing): source s's
j-th row of the stage finishes at D_s(j + 1) / w_s, where D_s(m) is the target tokens of its
first m rows of the stage summed over the lanes (a "row group": the same counter in every
lane, so every lane draws the same source at each position and counters stay per source, as
the ledger carries them) and w_s its weight (quantized, integers). Row q of the stage is the
q-th smallest finish time (ties: the lower source index first).

* **Pure.** D_s is a function of the counter alone: a concat source's row groups carry
  lanes x seq_len tokens each; a best_fit source's are the packed rows' target slots, summed
  over the lanes per index of the epoch's order (`TokenClock`: a prefix sum per epoch, O(rows)
  once per epoch touched, cached), and every regular epoch carries the same total. So the
  q-th row is found without history: for each source, bisect its index in the merged order
  (the rank of a row is a sum over sources of one inverse-prefix-sum lookup each, in exact
  integer arithmetic). O(K^2 log q log R) per lane position, K sources, R rows per epoch;
  the rows after it are merged on (K lookups each), and a step read right after the one
  before it starts from where that one ended (a memo, no state: any step computes alone).
* **Bound.** Let V be the finish time of the q-th row. Every row of s finishing before V is
  among the first q and none after it, so with τ the most tokens one row group carries (at
  most lanes x seq_len) and w_s normalised to sum 1, w_s V - τ <= T_s <= w_s V, and T (all
  sources) is within [V - K τ, V]. Hence -τ <= T_s - w_s T <= K w_s τ: each source's trained
  tokens before any lane position of the stage are within max(1, K w_s) row groups of tokens
  of its weight's share, whatever the step (it does not grow).
* **Limits.** Constant weights only (no schedules; no `set_mix` inside the stage, which is
  refused); sources whose layouts are not laid out anew by a switch (`seq_len`, `lanes`,
  `exclude` changes in mid-epoch are refused while the stage mixes by tokens). "Tokens" are
  target slots that hold a document token (padding excluded); a masked store's prompt tokens
  count as tokens here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from pipeline.errors import ConfigError
from pipeline.plan.row_layout import DOCUMENTS, RowLayout


class TokenClock:
    """Target tokens of a source's first k row groups (one row per lane each), for counters k.

    A concat source's rows are windows of seq_len targets; a best_fit source's row holds the
    slots its documents fill (`PackedLayout`), summed per index over the lanes of an epoch's
    order (cached prefix sums)."""

    def __init__(self, layout: RowLayout, where: str) -> None:
        if getattr(layout, "transition", None) is not None or getattr(layout, "first_counter", 0):
            raise ConfigError(
                f"{where}: mix_unit: tokens needs regular epochs; source {layout.name} was laid "
                "out anew by a switch (seq_len, lanes or exclude changed in mid-epoch)"
            )
        self.layout = layout
        self.rows = layout.windows_per_lane  # row groups per epoch
        self.packed = layout.row_kind == DOCUMENTS
        if self.packed:
            docs = layout.doc_tokens[layout.row_docs] - 1  # type: ignore[attr-defined]
            offsets = layout.row_offsets  # type: ignore[attr-defined]
            self.row_tokens = np.add.reduceat(docs, offsets[:-1]) if docs.size else docs
            self.epoch_tokens = int(self.row_tokens[: self.rows * layout.lanes].sum())
        else:
            self.epoch_tokens = self.rows * layout.lanes * layout.seq_len
        self.prefix = lru_cache(maxsize=16)(self._prefix)

    @property
    def most(self) -> int:
        """The most tokens one row group carries (τ of the bound)."""
        if not self.packed:
            return self.layout.lanes * self.layout.seq_len
        return int(self.layout.lanes * self.row_tokens.max())

    def tokens(self, counters: np.ndarray) -> np.ndarray:
        """Tokens of row groups [0, k) for each counter k."""
        counters = np.asarray(counters, dtype=np.int64)
        epoch, k = np.divmod(counters, self.rows)
        out = epoch * self.epoch_tokens
        if not self.packed:
            return out + k * self.layout.lanes * self.layout.seq_len
        for e in np.unique(epoch).tolist():
            mask = epoch == e
            out[mask] += self.prefix(e)[k[mask]]
        return out

    def count(self, tokens: np.ndarray) -> np.ndarray:
        """The most row groups k whose tokens(k) <= each `tokens` (>= 0)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if self.epoch_tokens == 0:
            raise ConfigError(f"source {self.layout.name}: its rows carry no token")
        epoch, rest = np.divmod(tokens, self.epoch_tokens)
        if not self.packed:
            return epoch * self.rows + rest // (self.layout.lanes * self.layout.seq_len)
        out = epoch * self.rows
        for e in np.unique(epoch).tolist():
            mask = epoch == e
            out[mask] += np.searchsorted(self.prefix(e), rest[mask], side="right") - 1
        return out

    def _prefix(self, epoch: int) -> np.ndarray:
        """[rows + 1] tokens of the first j row groups of epoch `epoch`."""
        lanes = self.layout.lanes
        counters = epoch * self.rows + np.arange(self.rows)
        groups = np.zeros(self.rows, dtype=np.int64)
        for lane in range(lanes):
            rows = self.layout.epoch_and_window(counters, np.full(self.rows, lane))[1]  # type: ignore[attr-defined]
            groups += self.row_tokens[rows]
        return np.concatenate([[0], np.cumsum(groups)])


class TokenMixture:
    """A stage's rows by virtual finish time (module docstring): the `Mixture` interface
    (`counts`, `sources`) over positions counted from `start` (the stage's first row)."""

    def __init__(
        self, weights: np.ndarray, clocks: Sequence[TokenClock], counters: np.ndarray, start: int
    ) -> None:
        self.weights = np.asarray(weights, dtype=np.int64)  # [K] >= 0: 0 draws nothing
        self.clocks = list(clocks)
        self.counters = np.asarray(counters, dtype=np.int64)  # each source's counter at start
        self.base = np.array([c.tokens(np.array([k]))[0] for c, k in zip(clocks, self.counters)])
        self.start = start
        self.num_sources = len(self.clocks)
        self.drawn = [s for s in range(self.num_sources) if self.weights[s] > 0]
        self._ended: tuple[int, np.ndarray] = (-1, np.zeros(0, dtype=np.int64))

    starts = np.zeros(1, dtype=np.int64)  # constant weights: one piece, as `Mixture` has
    horizon = 0

    def weights_at(self, step: int) -> np.ndarray:
        """[K] the weights (constant) that hold at any step of the stage."""
        return self.weights.astype(np.float64)

    def error_bounds(self) -> np.ndarray:
        """[K] the bound in tokens on |T_s - share_s x T| (module docstring)."""
        most = max(self.clocks[s].most for s in self.drawn)
        share = self.weights / self.weights.sum()
        return np.maximum(1.0, len(self.drawn) * share) * most

    def _finish(self, source: int, index: int) -> int:
        """D_s(index + 1): tokens of the source's first index + 1 rows of the stage."""
        clock = self.clocks[source]
        return int(clock.tokens(np.array([self.counters[source] + index + 1]))[0]) - int(
            self.base[source]
        )

    def _before(self, source: int, index: int) -> np.ndarray:
        """[K] rows of each source ordered before row `index` of `source`."""
        finish, weight = self._finish(source, index), int(self.weights[source])
        out = np.empty(self.num_sources, dtype=np.int64)
        for s, clock in enumerate(self.clocks):
            if s == source or not self.weights[s]:
                out[s] = index if s == source else 0
                continue
            # rows j of s with D_s(j + 1) / w_s < finish / weight (<= for a lower index)
            scaled = finish * int(self.weights[s])
            limit = scaled // weight if s < source else (scaled - 1) // weight
            if limit < 0:
                out[s] = 0
                continue
            total = int(self.base[s]) + limit
            out[s] = int(clock.count(np.array([total]))[0]) - int(self.counters[s])
        return out

    def _select(self, q: int) -> tuple[int, int]:
        """(source, index) of row q of the stage: the row with exactly q rows before it."""
        for source in self.drawn:
            lo, hi = 0, q  # the largest index whose rank is <= q
            if int(self._before(source, 0).sum()) > q:
                continue
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if int(self._before(source, mid).sum()) <= q:
                    lo = mid
                else:
                    hi = mid - 1
            if int(self._before(source, lo).sum()) == q:
                return source, lo
        raise AssertionError(f"no row at stage position {q}")  # every position has one

    def counts(self, positions: np.ndarray) -> np.ndarray:
        """[..., K] rows of each source before each position."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.zeros((*positions.shape, self.num_sources), dtype=np.int64)
        for q in np.unique(positions).tolist():
            if q > self.start:
                out[positions == q] = self._before(*self._select(q - self.start))
        return out

    def sources(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, that source's count before the row) for each position: the first of
        each run of consecutive positions selected (`_select`), the others merged on from it
        (the next row is the least finish time of each source's next row: K lookups)."""
        positions = np.asarray(positions, dtype=np.int64)
        unique = np.unique(positions)
        found: dict[int, tuple[int, int]] = {}
        runs = np.split(unique, np.flatnonzero(np.diff(unique) != 1) + 1)
        for run in runs:
            for q, row in zip(run.tolist(), self._walk(int(run[0]) - self.start, len(run))):
                found[q] = row
        source = np.array([found[q][0] for q in positions.reshape(-1).tolist()], np.int64)
        count = np.array([found[q][1] for q in positions.reshape(-1).tolist()], np.int64)
        return source.reshape(positions.shape), count.reshape(positions.shape)

    def _walk(self, q: int, rows: int) -> list[tuple[int, int]]:
        """(source, index) of stage rows q .. q + rows - 1. The rows before q are counted by a
        selection, or taken from the walk that ended at q (a memo of this pure function: the
        next step's rows, when steps are read in order)."""
        ended, counted = self._ended
        if ended == q:
            before = counted.copy()
            source, index = self._next(before)
        else:
            source, index = self._select(q)
            before = self._before(source, index)
        out = [(source, index)]
        for _ in range(rows - 1):
            before[source] += 1
            source, index = self._next(before)
            out.append((source, index))
        before[source] += 1
        self._ended = (q + rows, before)  # one assignment: reader threads may walk at once
        return out

    def _next(self, before: np.ndarray) -> tuple[int, int]:
        """The row after those `before` counts: the least finish time of each source's next
        row (ties: the lower source)."""
        best = None  # (finish, weight, source) of the least finish time so far
        for s in self.drawn:
            finish, weight = self._finish(s, int(before[s])), int(self.weights[s])
            if best is None or finish * best[1] < best[0] * weight:
                best = (finish, weight, s)
        return best[2], int(before[best[2]])
