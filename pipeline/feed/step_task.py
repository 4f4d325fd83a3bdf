"""A reader thread's task: one step's local rows read on the host, then put on the devices.

`DataFeed` hands `read_step` to its reader threads (`pipeline.feed.readers`), a step per task;
`benchmarks/profile_feed.py` runs the same task inline to time its parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.errors import FeedError
from pipeline.feed import expand
from pipeline.feed.geometry import Geometry
from pipeline.feed.stats import StepRead
from pipeline.plan.draws import Draws, DrawSummary
from pipeline.plan.report import ScheduledSources
from pipeline.read import objective
from pipeline.read.plan import Plan


@dataclass
class StepRows:
    """One step's rows as a reader task read them, with what `next()` needs besides."""

    batch: dict[str, Any]  # the six fields and the provenance asked for (host, then global)
    read: StepRead | None  # None when the feed keeps no statistics
    # for the event log (None: no log): the step's stages and epochs, and the sources with a
    # scheduled share at it; found here, in the reader thread, so that next() makes no numpy
    # call for them, and not at all for a feed that logs no events
    events: tuple[DrawSummary, frozenset[str]] | None = None


def read_rows(
    plan: Plan,
    step: int,
    rows: np.ndarray,
    provenance: tuple[str, ...],
    measure: bool,
    scheduled: ScheduledSources | None = None,
    compact: bool = False,
    draws_of: Callable[[Plan, int, np.ndarray], Draws] = Plan.draws,
) -> StepRows:
    """This process's `rows` of `step`, read on the host (`read_step` then transfers them);
    `compact`: in their compact form where the step has one (`Plan.read_compact`; the
    devices build the six fields, `pipeline.feed.expand`); `measure`: counted for the feed's
    statistics; `draws_of`: the rows' draws (a feed's `FetchAhead.draws`: its thread's)."""
    started = time.perf_counter()
    draws = draws_of(plan, step, rows)
    batch = plan.read_compact(draws) if compact else None
    if batch is None:
        batch = plan.read(draws)
    for name, values in draws.provenance(provenance).items():
        if values.size and values.max() > np.iinfo(np.int32).max:
            raise FeedError(f"step {step}: provenance field {name} exceeds int32")
        batch[name] = values.astype(np.int32)
    batch.update(objective.row_fields(plan, draws))  # loss_weights' inputs, if an objective
    read = StepRead.of(plan, draws, started) if measure else None
    events = None if scheduled is None else (draws.summary(), scheduled(step))
    return StepRows(batch, read, events)


def read_step(
    plan: Plan,
    step: int,
    geometry: Geometry,
    provenance: tuple[str, ...],
    measure: bool,
    scheduled: ScheduledSources | None = None,
    expand_mode: str = "auto",
    draws_of: Callable[[Plan, int, np.ndarray], Draws] = Plan.draws,
) -> StepRows:
    """A reader thread's task: one step's local rows, read and transferred to the devices
    (`expand_mode`: the `feed.expand` of the config in force, never a ledger's)."""
    compact = expand.on_device(expand_mode, geometry)
    rows = read_rows(plan, step, geometry.rows, provenance, measure, scheduled, compact, draws_of)
    rows.batch = expand.to_global(geometry, rows.batch)
    return rows
