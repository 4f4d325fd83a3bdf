"""`loss_weights`: each trained token's weight, so that each source's share of a step's loss is
its objective weight (`objective:`, docs/mixtures.md "Objective weights").

Per step, with T_s the trained tokens of source s in the whole global batch (targets whose
segment is not 0), T their sum, o_s the step's objective weight of s and O the sum of o_s over
the sources with T_s > 0, every trained token of s weighs

    w_s = (o_s * T) / (O * T_s)

so the tokens of s carry o_s / O of the step's total weight, and the weights average 1 over
the step's trained tokens: a loss normalised by the count of trained tokens keeps its scale.
Untrained targets weigh 0; a step whose stage has no objective (o = NO_OBJECTIVE) weighs every
trained token 1; a step whose present sources all weigh 0 weighs every token 0.

The totals T_s span the whole global batch, which no host reads alone, so the weights are
derived where the global batch is: on the devices (`pipeline.feed.expand`, one jitted reduction
over the global arrays, from two int32 per row: `ROW_FIELDS`), or on the host that holds every
row (`pipeline dump`). One function, `weights`, written once for NumPy and `jax.numpy` (`xp`):
the same float32 operations in the same order, so both give the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.plan.draws import Draws
from pipeline.plan.objective import NO_OBJECTIVE, objective_at
from pipeline.plan.plan import DrawPlan
from pipeline.read.plan import Plan

SOURCE, OBJECTIVE = ROW_FIELDS = ("loss_source", "loss_objective")
"""The per-row int32 inputs of `weights`: each row's source (index into its segment's
sources) and that source's objective weight at the step (`NO_OBJECTIVE`: none)."""


def row_fields(plan: DrawPlan, draws: Draws) -> dict[str, np.ndarray]:
    """The `ROW_FIELDS` of drawn rows; empty when their step has no objective (no
    `loss_weights`)."""
    objective = objective_at(plan.segment_plan(draws.segment_index), draws.step)
    if objective is None:
        return {}
    source = draws.source.astype(np.int32)
    return {SOURCE: source, OBJECTIVE: objective.astype(np.int32)[source]}


def weights(xp: Any, targets_segmentation: Any, source: Any, objective: Any, sources: int) -> Any:
    """float32 `loss_weights` shaped like `targets_segmentation` [..., seq_len], for the rows'
    `source` and `objective` [...] (`ROW_FIELDS`), `sources` the number of source indices: the
    formula of this module's docstring, over all the rows given (one whole step)."""
    trained = targets_segmentation != 0
    counts = trained.sum(axis=-1, dtype=xp.int32)  # [...] trained targets of each row
    batch_axes = tuple(range(counts.ndim))
    onehot = source[..., None] == xp.arange(sources, dtype=xp.int32)  # [..., K]
    totals = xp.where(onehot, counts[..., None], 0).sum(axis=batch_axes, dtype=xp.int32)  # T_s
    given = xp.where(onehot, objective[..., None], 0).max(axis=batch_axes)  # o_s (0 if absent)
    present = totals > 0
    total_objective = xp.where(present, given, 0).sum(dtype=xp.int32)  # O
    numerator = given.astype(xp.float32) * totals.sum(dtype=xp.int32).astype(xp.float32)
    denominator = total_objective.astype(xp.float32) * xp.maximum(totals, 1).astype(xp.float32)
    usable = present & (total_objective > 0)
    per_source = xp.where(usable, numerator / xp.where(usable, denominator, 1), 0)
    per_row = xp.where(objective == NO_OBJECTIVE, 1, xp.take(per_source, source))
    return xp.where(trained, per_row.astype(xp.float32)[..., None], 0).astype(xp.float32)


def step_weights(plan: Plan, step: int) -> np.ndarray | None:
    """[global batch, seq_len] `loss_weights` of every row of `step`, read on this host (all
    rows: `pipeline dump`, tests); None when the step has no objective."""
    draws = plan.draws(step)
    rows = row_fields(plan, draws)
    if not rows:
        return None
    sources = len(draws.source_names)
    return weights(np, plan.read(draws)["targets_segmentation"], *rows.values(), sources)
