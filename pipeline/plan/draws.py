"""What some rows of a step draw (`Draws`, `DrawPlan.draws`), and its summary for the logs.

A step's draws are read, counted and logged by several readers (the read path, the feed's
statistics, its event log): what they all need of the rows is found once, when they are drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config.parse import PROVENANCE


@dataclass(frozen=True)
class DrawSummary:
    """Which stages and source epochs some rows of a step drew: what the feed's log, the
    trainer's log and `inspect` report. Summaries of a step's row chunks `merge`."""

    stages: frozenset[tuple[int, str]] = frozenset()  # (ledger segment index, stage name)
    epochs: Mapping[str, int] = field(default_factory=dict)  # source -> highest epoch drawn

    def merge(self, other: DrawSummary) -> DrawSummary:
        epochs = dict(self.epochs)
        for name, epoch in other.epochs.items():
            epochs[name] = max(epoch, epochs.get(name, -1))
        return DrawSummary(self.stages | other.stages, epochs)

    @property
    def stage_label(self) -> str:
        """The stage names, joined by '+' when the rows straddle a stage boundary."""
        return "+".join(sorted({name for _, name in self.stages}))

    @property
    def epochs_label(self) -> str:
        """`name=epoch` per source, by name."""
        return " ".join(f"{name}={epoch}" for name, epoch in sorted(self.epochs.items()))


@dataclass(frozen=True)
class Draws:
    """What each requested row of a step is: one entry per row, in request order."""

    step: int
    rows: np.ndarray
    segment_index: int  # the ledger segment that decides the step
    lane: np.ndarray
    stage: np.ndarray  # index into `stage_names`
    stage_names: tuple[str, ...]
    source: np.ndarray  # index into `source_names`
    source_names: tuple[str, ...]
    counter: np.ndarray
    epoch: np.ndarray
    window: np.ndarray
    start: np.ndarray  # token start in the source's epoch stream
    drawn: list[int]  # the sources drawn, ascending (`np.unique(source)`, found once a step)
    # what a reader found of these rows, for the next reader of the same draws (the pieces the
    # fetch-ahead thread finds, which the reader then takes and copies: `windows.found_key`)
    found: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def provenance(self, names: Iterable[str] = PROVENANCE) -> dict[str, np.ndarray]:
        """Per-row `source` (index into `source_names`), `epoch` and `window`, as the batch's
        extra fields carry them (`feed.provenance`, `pipeline dump`)."""
        return {name: getattr(self, name) for name in names}

    def summary(self) -> DrawSummary:
        """The stages and each drawn source's highest epoch, in Python over the rows: a host's
        rows of a step are a few dozen, where numpy's calls cost more than its loops."""
        names = self.stage_names
        stages = {(self.segment_index, names[s]) for s in set(self.stage.tolist())}
        highest: dict[int, int] = {}
        for source, epoch in zip(self.source.tolist(), self.epoch.tolist()):
            if epoch > highest.get(source, -1):
                highest[source] = epoch
        names = self.source_names
        epochs = {names[source]: highest[source] for source in sorted(highest)}
        return DrawSummary(frozenset(stages), epochs)
