"""Read-only views of a plan for people: stage boundaries, epoch rollovers, target weights.

Everything here is computed from the plan's stage tables and counters, never by replaying steps:
a source's counter (windows drawn per lane) only grows with the step inside a ledger segment,
so the step at which it reaches any value is found by bisection in O(log step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeline.plan.packing import PackingStats
from pipeline.plan.plan import DrawPlan, SegmentPlan
from pipeline.plan.stages import StageLayout

SEARCH_LIMIT = 10**15  # steps: past this a source counts as never reaching a counter


@dataclass(frozen=True)
class StageRow:
    """One stage of one ledger segment in absolute steps."""

    segment_index: int
    index: int
    name: str
    start_step: int
    start_row: int  # row inside each lane where the stage's first row is (0: a step boundary)
    end_step: int | None  # step holding the stage's last row (None: open-ended)
    end_row: int | None  # one past the stage's last row inside each lane of `end_step`
    superseded_at: int | None  # a later ledger segment takes over at this step
    kind: str  # "steps N", "open-ended" or "epochs"
    mix: str
    joined_at: int | None = None  # the run entered the stage here, at a switch, not at its start


def segment_stop(plan: DrawPlan, index: int) -> int | None:
    """One past the last step ledger segment `index` decides (None: open-ended)."""
    segments = plan.ledger.segments
    if index + 1 < len(segments):
        return segments[index + 1].start_step
    return plan.segment_plan(index).end_step()


def batch_span(plan: DrawPlan, step: int) -> tuple[SegmentPlan, float]:
    """The segment plan of `step`, and the first later step whose batch may differ: the batch
    schedule's next point or the ledger's next segment (inf: neither). A caller that asks at
    every step (the feed's geometry, `ScheduledSources`) recomputes only there."""
    index = plan.ledger.segment_index(step)
    segment = plan.segment_plan(index)
    segments = plan.ledger.segments
    end = segments[index + 1].start_step if index + 1 < len(segments) else math.inf
    change = segment.clock.next_change(step - segment.anchor)
    if change is not None:
        end = min(end, segment.anchor + change)
    return segment, end


def stage_rows(plan: DrawPlan) -> list[StageRow]:
    """Each segment's stages in absolute steps, from the one that holds the segment's start.

    A run-anchored segment (`starts_at: run`) lays its config out from step 0, so its first
    stage may have begun (in that layout) before the switch: it is listed with that start and
    `joined_at` set to the switch step; stages that ended before the switch are not listed.
    """
    out = []
    for index, segment in enumerate(plan.ledger.segments):
        seg = plan.segment_plan(index)
        superseded = segment_stop(plan, index) if index + 1 < len(plan.ledger.segments) else None
        first = seg.position_of(segment.start_step)
        for k, stage in enumerate(seg.table.stages):
            if stage.end is not None and stage.end <= first:
                continue  # laid out, and over, before this segment began
            start_step, start_row = _step_and_row(seg, stage.start)
            if superseded is not None and start_step >= superseded:
                break
            end_step = end_row = None
            if stage.end is not None:
                end_step, end_row = _step_and_row(seg, stage.end - 1)
                end_row += 1
            out.append(
                StageRow(
                    index,
                    k,
                    stage.spec.name,
                    start_step,
                    start_row,
                    end_step,
                    end_row,
                    superseded,
                    _kind(stage),
                    describe_mix(stage),
                    segment.start_step if stage.start < first else None,
                )
            )
    return out


def _step_and_row(seg: SegmentPlan, position: int) -> tuple[int, int]:
    """(absolute step, row inside each lane) of a lane position of a segment's layout."""
    step = seg.anchor + int(seg.clock.step_of(position))
    return step, position - seg.position_of(step)


def _kind(stage: StageLayout) -> str:
    if stage.spec.epochs is not None:
        return "epochs"
    return "open-ended" if stage.spec.steps is None else f"steps {stage.spec.steps}"


def describe_mix(stage: StageLayout) -> str:
    spec = stage.spec
    if spec.epochs is not None:
        return ", ".join(f"{name} x{reps} epochs" for name, reps in spec.epochs)
    parts = []
    for name, schedule in spec.mix or ():
        if schedule.kind == "constant":
            parts.append(f"{name} {_num(schedule.points[0][1])}")
        else:
            points = ", ".join(f"{step}: {_num(w)}" for step, w in schedule.points)
            parts.append(f"{name} {schedule.kind}{{{points}}}")
    unit = " (of tokens)" if spec.mix_unit == "tokens" else ""  # config/mix_unit.py
    return ", ".join(parts) + unit


def _num(value: float) -> str:
    return f"{value:g}"


def first_draw(plan: DrawPlan, index: int, name: str, counter: int) -> tuple[int, int] | None:
    """(step, row inside lane 0) of draw number `counter` of source `name` in segment `index`.

    None if the segment never reaches it. Bisection over the segment's steps: O(log steps).
    """
    seg = plan.segment_plan(index)
    lo = seg.segment.start_step
    stop = segment_stop(plan, index)

    def value(step: int) -> int:
        return seg.counters_at(step)[name]

    if value(lo) > counter:
        return None  # drawn before this segment began
    if stop is None:
        distance = 1
        while value(lo + distance) <= counter:
            if distance > SEARCH_LIMIT:
                return None
            distance *= 2
        hi = lo + distance
    else:
        hi = stop
        if value(hi) <= counter:
            return None
    # invariant: value(lo) <= counter < value(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if value(mid) <= counter:
            lo = mid
        else:
            hi = mid
    draws = plan.draws(lo, np.arange(seg.rows_per_lane(lo)))
    hit = np.flatnonzero(
        (np.asarray(draws.source_names)[draws.source] == name) & (draws.counter == counter)
    )
    return lo, int(hit[0])


@dataclass(frozen=True)
class EpochInfo:
    name: str
    segment_index: int
    rows_per_lane: int  # each lane's rows of an epoch: windows, or best_fit's packed rows
    lanes: int
    seq_len: int
    store_tokens: int
    rollovers: list[tuple[int, tuple[int, int] | None]]  # (epoch, (step, row) or None)
    packing: PackingStats | None = None  # a best_fit source's rows, padding, too-long documents
    transition: tuple[int, int] | None = None  # (epoch, rows per lane) a switch laid out anew

    @property
    def tokens_per_epoch(self) -> int:
        """Target tokens one epoch feeds the model (all lanes)."""
        return self.rows_per_lane * self.lanes * self.seq_len


def epoch_table(plan: DrawPlan, count: int) -> list[EpochInfo]:
    """Per segment and source: rows per lane per epoch and where epochs 1..count begin.

    A rollover is reported in the first segment whose counters reach it; a source whose weight
    falls to 0 for good never rolls over (None).
    """
    out = []
    for index in range(len(plan.ledger.segments)):
        seg = plan.segment_plan(index)
        for name in seg.config.source_names:
            layout = seg.layouts[name]
            windows = layout.windows_per_lane
            start = seg.counters_at(seg.segment.start_step)[name]
            first_epoch = layout.epoch_of(start) + 1
            rollovers = [
                (epoch, first_draw(plan, index, name, layout.epoch_start(epoch)))
                for epoch in range(first_epoch, first_epoch + count)
            ]
            began = layout.transition  # reported by the segment whose switch began it
            if began is not None and began.counter != seg.segment.counters[name]:
                began = None
            out.append(
                EpochInfo(
                    name,
                    index,
                    windows,
                    seg.config.lanes,
                    seg.config.seq_len,
                    layout.meta.num_tokens,
                    rollovers,
                    layout.stats,
                    None if began is None else (began.epoch, began.windows),
                )
            )
    return out


def rollovers_between(
    plan: DrawPlan, start: int, stop: int, limit: int = 500
) -> dict[str, list[int]]:
    """Steps in [start, stop) at which a source begins a new epoch (per source name)."""
    out: dict[str, list[int]] = {}
    for index, segment in enumerate(plan.ledger.segments):
        seg_stop = segment_stop(plan, index)
        lo, hi = max(start, segment.start_step), stop if seg_stop is None else min(stop, seg_stop)
        if lo >= hi:
            continue
        seg = plan.segment_plan(index)
        for name in seg.config.source_names:
            layout = seg.layouts[name]
            first = seg.counters_at(lo)[name]
            last = seg.counters_at(hi)[name]  # counter before step hi
            epoch = layout.epoch_of(first)  # the next epoch, unless `first` begins this one
            epoch = max(1, epoch if layout.epoch_start(epoch) == first else epoch + 1)
            steps = out.setdefault(name, [])
            while layout.epoch_start(epoch) < last and len(steps) < limit:
                found = first_draw(plan, index, name, layout.epoch_start(epoch))
                if found is not None and lo <= found[0] < hi:
                    steps.append(found[0])
                epoch += 1
    return out


def target_shares(plan: DrawPlan, steps: np.ndarray) -> dict[str, np.ndarray]:
    """Each source's normalised schedule weight at each step (averaged over a lane's rows)."""
    out: dict[str, np.ndarray] = {}
    steps = np.asarray(steps, dtype=np.int64)
    for i, step in enumerate(steps):
        index = plan.ledger.segment_index(int(step))
        seg = plan.segment_plan(index)
        rows_per_lane = seg.rows_per_lane(int(step))
        positions = seg.position_of(int(step)) + np.arange(rows_per_lane)
        stages = seg.table.stage_index(positions)
        for stage_index in np.unique(stages):
            stage = seg.table.stages[int(stage_index)]
            share = int(np.sum(stages == stage_index)) / rows_per_lane
            mixture = stage.mixture
            local = int(step) - seg.anchor - stage.first_step
            weights = mixture.weights_at(local)
            weights = weights / weights.sum()
            for column, weight in zip(stage.sources, weights):
                name = seg.config.source_names[column]
                out.setdefault(name, np.zeros(len(steps)))[i] += share * weight
    return out


class ScheduledSources:
    """`scheduled(step)`: the sources with a positive scheduled share at `step` (those
    `target_shares` gives a share > 0), for a feed that asks at every step.

    The answer changes only where a stage ends, a weight schedule or the batch schedule has a
    point, or the ledger switches, so it is kept for the steps up to the next of them and a
    step inside that span costs two comparisons (`target_shares` costs ~40 us per step).
    """

    def __init__(self, plan: DrawPlan) -> None:
        self.plan = plan
        self._span: tuple[int, int, frozenset[str]] = (0, 0, frozenset())

    def __call__(self, step: int) -> frozenset[str]:
        first, end, names = self._span
        if first <= step < end:
            return names
        names, end = self._at(step)
        self._span = (step, end, names)
        return names

    def _at(self, step: int) -> tuple[frozenset[str], float]:
        """The sources at `step`, and the step up to which they hold at least."""
        seg, end = batch_span(self.plan, step)
        local = step - seg.anchor
        first = seg.position_of(step)
        last = first + seg.rows_per_lane(step) - 1
        lo, hi = (int(k) for k in seg.table.stage_index(np.array([first, last])))
        names = set()
        for stage in seg.table.stages[lo : hi + 1]:
            if stage.end == stage.start:  # an empty stage between two others: no row
                continue
            weights = stage.mixture.weights_at(local - stage.first_step)
            names.update(seg.config.source_names[c] for c, w in zip(stage.sources, weights) if w)
        if lo != hi:  # the step straddles a stage boundary
            return frozenset(names), step + 1
        stage = seg.table.stages[lo]
        ends = [end]
        if stage.end is not None:  # the first step holding a row of the next stage
            ends.append(seg.anchor + int(seg.clock.step_of(stage.end)))
        points = np.append(stage.mixture.starts, stage.mixture.horizon) + stage.first_step
        later = points[points > local]
        if later.size:
            ends.append(seg.anchor + int(later[0]))
        return frozenset(names), min(ends)
