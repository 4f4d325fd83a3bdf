"""Steps to lane positions under a batch schedule: where each step begins in every lane.

With a constant batch, step t begins at lane position t * rows_per_lane. With a schedule
(`global_batch_size: {step: {0: 64, 2000: 128}}`) lanes stay fixed and rows per lane change with
the step, so step t begins after the rows of every earlier step: a piecewise linear function of
t with one piece per schedule point, computed directly (O(points)) for any step, and inverted by
a search over the same points. Steps here count from the segment's anchor (the step its stages
are laid out from).
"""

from __future__ import annotations

import numpy as np

from pipeline.config.parse import MAX_POSITION


class StepClock:
    def __init__(self, batch_sizes: tuple[tuple[int, int], ...], lanes: int) -> None:
        self.points = np.array([step for step, _ in batch_sizes], dtype=np.int64)
        self.rows = np.array([size // lanes for _, size in batch_sizes], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(np.diff(self.points) * self.rows[:-1])])
        # the last step whose rows end at a lane position int64 holds with room (`MAX_POSITION`)
        self.last_step = int(
            self.points[-1] + (MAX_POSITION - self.starts[-1]) // self.rows[-1] - 1
        )

    @property
    def horizon(self) -> int:
        """The first step from which rows per lane never change."""
        return int(self.points[-1])

    def rows_per_lane(self, steps: np.ndarray | int) -> np.ndarray:
        return self.rows[self._piece(steps)]

    def position(self, steps: np.ndarray | int) -> np.ndarray:
        """The lane position of the first row of each step."""
        steps = np.asarray(steps, dtype=np.int64)
        piece = self._piece(steps)
        return self.starts[piece] + (steps - self.points[piece]) * self.rows[piece]

    def next_change(self, step: int) -> int | None:
        """The first step after `step` whose rows per lane may differ (None: none ever does)."""
        later = self.points[self.points > step]
        return int(later[0]) if later.size else None

    def step_of(self, positions: np.ndarray | int) -> np.ndarray:
        """The step that holds each lane position."""
        positions = np.asarray(positions, dtype=np.int64)
        piece = np.searchsorted(self.starts, positions, side="right") - 1
        return self.points[piece] + (positions - self.starts[piece]) // self.rows[piece]

    def _piece(self, steps: np.ndarray | int) -> np.ndarray | int:
        if self.points.size == 1:  # a constant batch: no search (the feed asks every step)
            return 0 if np.ndim(steps) == 0 else np.zeros(np.shape(steps), dtype=np.int64)
        return np.searchsorted(self.points, np.asarray(steps, dtype=np.int64), side="right") - 1
