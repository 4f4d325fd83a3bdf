"""The objective weights in force at a step: each source's share of the step's loss.

A stage's `objective:` (config/objective.py) holds from its first row on; a step holds the
objective of the stage its first row is in (a step that straddles a stage boundary, after an
epochized blend, takes the earlier stage's), so one step has one objective. A run may set it
from a step on (`DataFeed.set_mix(..., objective=...)`, a ledger objective entry): the stage in
force then takes the entry's weights until the next entry, the end of that stage, or the next
segment, as `set_mix` weights do. Weights are
quantized as `set_mix` weights are (`mix_table.quantize`: integers in units of 2^-20 of their
total), so every host computes the same integers. A segment none of whose stages has an
objective has none (`None`: the batch has no `loss_weights`); in a segment with one, a stage
without one gives `NO_OBJECTIVE` (every trained token weighs 1).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from pipeline.config import StageSpec
from pipeline.plan.mix_table import MixTable, quantize

NO_OBJECTIVE = -1
"""A step's per-source weight when its stage has no objective: every trained token weighs 1."""


class Staged(Protocol):
    """What the objective needs of a segment's plan (`plan.SegmentPlan`)."""

    objectives: np.ndarray | None  # [stages, sources] (`stage_objectives`)
    objective_entries: MixTable  # the segment's `set_mix(..., objective=...)` calls
    objective_weights: np.ndarray  # [entries, sources] their weights by the segment's sources

    def stage_at(self, step: int) -> int: ...


def stage_objectives(stages: list[StageSpec], names: tuple[str, ...]) -> np.ndarray | None:
    """[stages, sources] each stage's quantized objective (`NO_OBJECTIVE` where it has none);
    None when no stage has one."""
    if all(stage.objective is None for stage in stages):
        return None
    out = np.full((len(stages), len(names)), NO_OBJECTIVE, dtype=np.int64)
    for row, stage in enumerate(stages):
        if stage.objective is not None:
            units = dict(quantize(dict(stage.objective), f"stage {stage.name}: objective"))
            out[row] = [units.get(name, 0) for name in names]
    return out


def objective_at(plan: Staged, step: int) -> np.ndarray | None:
    """[sources] the objective of `step` (by the segment's source order), None if none: the
    last objective entry at or before `step` when it was made in `step`'s stage (bisection),
    else the stage's own. A segment without any costs two attribute reads (a feed asks at every
    step)."""
    entries, table = plan.objective_entries, plan.objectives
    if table is None and len(entries) == 0:
        return None
    stage = plan.stage_at(step)
    last = entries.first_at(step + 1) - 1
    if last >= 0 and plan.stage_at(int(entries.steps[last])) == stage:
        return plan.objective_weights[last]
    if table is None:
        return np.full(plan.objective_weights.shape[1], NO_OBJECTIVE)
    return table[stage]
