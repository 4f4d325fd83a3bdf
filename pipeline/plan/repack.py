"""The rest of an epoch packed anew when a switch changes `seq_len` or `lanes` (best_fit sources).

The whole-document counterpart of `transition` (read its docstring first): a best_fit source
whose geometry changes in the middle of its epoch e continues with a *transitional epoch* made
of the documents epoch e has not used yet.

* **Used.** The documents of the packed rows the old layout's lanes drew in epoch e before the
  carried counter c (a layout itself transitional in e adds those of its drawn transitional
  rows to the ones it began with, so switches chain).
* **Left.** The documents the new geometry keeps (its `too_long`, at its `seq_len`: a longer
  `seq_len` truncates less, and keeps documents `drop` left out before), less those used, in a
  keyed order per (seed, source, epoch, c); `removed` document ids (a hook for documents taken
  down) are left out too.
* **Packed.** By the packing's own code (`packing.pack_rows`: block-wise best fit decreasing,
  rows made a multiple of the new `lanes`), and permuted by a keyed bijection per (seed,
  source, epoch, c); lane l draws positions [l * R_t, (l + 1) * R_t). Their rows are numbered
  after the regular packing's, in the layout's row arrays (`PackedLayout.epoch_rows`).
* **After.** The new geometry's regular epochs e + 1, ... from counter c + R_t. The rows past
  the last multiple of `lanes` (fewer than `lanes` rows, when single-document rows cannot be
  split to even them out) are not used in epoch e: the lane tails of a transitional epoch.

Cost: one packing of the documents left, O(documents of the store), once per process and
transition; never growing with the step.
"""

from __future__ import annotations

import threading

import numpy as np

from pipeline.plan.epochs import Transition
from pipeline.plan.packing import PackedLayout, pack_rows
from pipeline.plan.permutation import permutation, round_keys
from pipeline.plan.row_layout import NO_DOCUMENTS


class RepackedTransition(Transition):
    """A best_fit source's transitional epoch: `count` packed rows (`windows` per lane),
    numbered from `first_row` on in the layout's row arrays; `used` the documents epoch `epoch`
    had used before it began (sorted ids; not those removed: a later switch that stops removing
    them gives them back to the epoch)."""

    def __init__(
        self,
        layout: PackedLayout,
        epoch: int,
        counter: int,
        count: int,
        first_row: int,
        used: np.ndarray,
    ) -> None:
        super().__init__(epoch, counter, count // layout.lanes)
        self.count, self.first_row, self.used = count, first_row, used
        self._keys = round_keys(layout.seed, "transition-row-order", layout.name, epoch, counter)
        self._order: np.ndarray | None = None
        self._lock = threading.Lock()

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """The packed rows (numbers in the layout's arrays) at `positions` of the epoch's
        keyed order of its rows (the order computed once)."""
        with self._lock:
            if self._order is None:
                self._order = permutation(self.count, self._keys)
        return self.first_row + self._order[np.asarray(positions, np.int64)]


def used_documents(layout: PackedLayout, counter: int) -> tuple[int, np.ndarray]:
    """(epoch, the documents used in it) by `layout`'s lanes before draw `counter`."""
    epoch, k, early = (int(a[0]) for a in layout.place(np.array([counter])))
    lanes = np.arange(layout.lanes)
    if early:
        transition = layout.transition
        assert isinstance(transition, RepackedTransition)
        positions = (lanes[:, None] * transition.windows + np.arange(k)).reshape(-1)
        drawn = layout.documents_of(transition.rows(positions))
        return epoch, np.union1d(transition.used, drawn)
    positions = (lanes[:, None] * layout.windows_per_lane + np.arange(k)).reshape(-1)
    rows = layout._row_order(epoch, positions) if positions.size else NO_DOCUMENTS
    return epoch, np.unique(layout.documents_of(rows))


def repacked(
    before: PackedLayout, after: PackedLayout, counter: int, removed: np.ndarray = NO_DOCUMENTS
) -> PackedLayout:
    """`after` (a new packing of the same store, another geometry) continuing `before` from
    draw `counter`: the rest of `before`'s epoch there packed anew as a transitional epoch,
    then `after`'s regular epochs (module docstring). `removed`: document ids never to serve.
    `after` is changed in place and returned."""
    epoch, used = used_documents(before, counter)
    if not used.size and not removed.size:  # nothing of epoch e used: a regular epoch of `after`
        after.continue_epochs(counter, epoch, None)
        return after
    regular = after.windows_per_lane * after.lanes
    kept = np.unique(after.row_docs[: after.row_offsets[regular]])
    left = np.setdiff1d(kept, np.union1d(used, removed), assume_unique=True)
    if left.size:
        keys = round_keys(after.seed, "transition-pack", after.name, epoch, counter)
        left = left[permutation(left.size, keys)]
    offsets, docs = pack_rows(left, after.doc_tokens - 1, after.seq_len, after.lanes, None)
    rows = offsets.size - 1
    if not rows:  # too few documents left for a row per lane: the next epoch has them
        after.continue_epochs(counter, epoch + 1, None)
        return after
    base = after.row_docs.size
    after.row_offsets = np.concatenate([after.row_offsets, offsets[1:] + base])
    after.row_docs = np.concatenate([after.row_docs, docs])
    transition = RepackedTransition(after, epoch, counter, rows, regular, used)
    after.continue_epochs(counter + transition.windows, epoch + 1, transition)
    return after
