"""Which epoch a layout's draw counter falls in, when a switch changed the geometry before it.

A source's counter counts the rows one lane has drawn from it in the run. Under one geometry
(`seq_len`, `lanes`) for the whole run, epoch e is counters [e * W, (e + 1) * W). When a switch
changes the geometry in the middle of epoch e (docs/steering.md, "Context extension"), the rest
of epoch e is laid out anew from what it had not served (`transition`): a *transitional epoch*
of W_t rows per lane, counters [c, c + W_t) from the carried counter c; then the new geometry's
regular epochs e + 1, e + 2, ... of W rows each follow from counter c + W_t. `Epochs` is that
piecewise map, shared by the row layouts (`layout.SourceLayout`, `packing.PackedLayout`); a
layout of a run that never changed its geometry has no transition and starts at (0, 0), which
is the plain `counter // W`.
"""

from __future__ import annotations

import numpy as np


class Transition:
    """The transitional epoch of a layout: epoch `epoch`'s rest, `windows` rows per lane drawn
    from counter `counter` on. What the kind of layout keeps to place them is its own."""

    def __init__(self, epoch: int, counter: int, windows: int) -> None:
        self.epoch, self.counter, self.windows = epoch, counter, windows


class Epochs:
    """Counter -> (epoch, index in the lane's epoch order), with an optional transitional epoch
    before the regular ones (module docstring)."""

    windows_per_lane: int  # rows per lane of a regular epoch
    first_counter: int = 0  # the counter regular epoch `first_epoch` begins at
    first_epoch: int = 0
    transition: Transition | None = None

    def continue_epochs(self, counter: int, epoch: int, transition: Transition | None) -> None:
        """Regular epochs begin at epoch `epoch`, counter `counter`, after `transition`."""
        self.first_counter, self.first_epoch, self.transition = counter, epoch, transition

    @property
    def lineage(self) -> tuple[int | str, ...]:
        """What tells this layout's epoch numbering from another of the same store: its
        geometry, the documents it excludes, where its regular epochs begin and where its
        transitional epoch began (the audit keys windows by it: two transitional epochs that
        end at one counter number their rows alike)."""
        began = -1 if self.transition is None else self.transition.counter
        excluded = self.excluded.digest  # type: ignore[attr-defined]
        return self.seq_len, self.lanes, excluded, self.first_counter, began  # type: ignore[attr-defined]

    def place(self, counter: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, index in the lane's epoch, in the transitional epoch?) of each counter."""
        counter = np.asarray(counter, dtype=np.int64)
        epoch, k = np.divmod(counter - self.first_counter, self.windows_per_lane)
        epoch += self.first_epoch
        early = counter < self.first_counter
        if self.transition is not None and early.any():
            epoch[early] = self.transition.epoch
            k[early] = counter[early] - self.transition.counter
        return epoch, k, early

    def epoch_of(self, counter: int) -> int:
        """The epoch of draw `counter` (the epoch a lane is in after `counter` draws)."""
        return int(self.place(np.array([counter]))[0][0])

    def epoch_start(self, epoch: int) -> int:
        """The counter of epoch `epoch`'s first draw (for the transitional epoch: its first
        draw after the switch that began it)."""
        if self.transition is not None and epoch == self.transition.epoch:
            return self.transition.counter
        return self.first_counter + (epoch - self.first_epoch) * self.windows_per_lane

    def epoch_windows(self, epoch: int) -> int:
        """Rows per lane of epoch `epoch`."""
        if self.transition is not None and epoch == self.transition.epoch:
            return self.transition.windows
        return self.windows_per_lane
