"""Stages of one ledger segment laid out in lane positions, with each source's draw counter.

A segment's lane positions count from its anchor, the step its stages are laid out from (the
run's step 0, or the switch step for `starts_at: switch`): the first row of step t is at
`clock.position(t)` (t * rows_per_lane with a constant batch). Stage k covers positions
[start_k, end_k). A `steps: N` stage ends where its N-th step ends, counting the step that
holds its first row as step 0. An epochized stage ends exactly when its sources have drawn
their epochs, which may be inside a step: the next stage starts at the next row. Inside a
stage, a `Mixture` decides the source of each position, counting steps from the one that holds
the stage's first row, so a schedule point at step S changes the first row of step S.

The run may set a stage's weights from a step on (`DataFeed.set_mix`, a ledger `MixEntry`): an
`Overrides` entry. Its stage's mixture becomes a `Steered` one, which follows the set weights
from the entry's first row to the next entry or the end of the stage.

A source's *counter* is how many windows one lane has drawn from it so far in the run; it
carries across stages (and, through the ledger, across segments), which is what makes epochs
survive curricula and restarts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pipeline.config import StageSpec
from pipeline.config.schedule import WeightSchedule
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan.clock import StepClock
from pipeline.plan.mix_table import quantize
from pipeline.plan.mixing import Mixture, Steered, mixture_of
from pipeline.plan.token_mix import TokenClock, TokenMixture


@dataclass(frozen=True)
class Overrides:
    """Weights set from steps on (a segment's ledger `MixEntry`s), placed in its layout: one
    entry per call, in step order."""

    steps: np.ndarray  # [E] the run's steps, for messages
    local_steps: np.ndarray  # [E] counted from the segment's anchor
    positions: np.ndarray  # [E] the lane position of each call's first row (segment-local)
    weights: np.ndarray  # [E, num sources of the segment] integers, 0 for sources left out

    def within(self, start: int, end: int | None) -> Overrides | None:
        """The entries whose first row is in lane positions [start, end), None if none."""
        lo = int(np.searchsorted(self.positions, start))
        hi = len(self.positions) if end is None else int(np.searchsorted(self.positions, end))
        if lo == hi:
            return None
        part = slice(lo, hi)
        return Overrides(
            self.steps[part], self.local_steps[part], self.positions[part], self.weights[part]
        )


@dataclass(frozen=True)
class StageLayout:
    spec: StageSpec
    start: int  # first lane position (segment-local)
    end: int | None  # one past the last, None if open-ended
    sources: tuple[int, ...]  # indices into the segment's source list
    mixture: Mixture | Steered | TokenMixture
    schedule_start: int  # lane position of the stage's step 0 (start rounded down to a step)
    counters_at_start: np.ndarray  # [num sources of the segment]
    first_step: int  # the step that holds the stage's first row (anchor-relative)

    @cached_property
    def source_indexes(self) -> np.ndarray:
        """`sources` as an array, to index with a step's draws (built once, not per step)."""
        return np.array(self.sources, dtype=np.int64)

    @cached_property
    def offsets(self) -> np.ndarray:
        """[stage sources] the mixture's counts before the stage's first row (a draw's
        counter is counted from there); asked for on every step, so computed once; none
        when the stage starts with a step (rows before its schedule's first: a mixture of
        hundreds of sources would walk its whole tree to find them 0)."""
        if self.start == self.schedule_start:
            return np.zeros(len(self.sources), dtype=np.int64)
        return self.mixture.counts(np.array([self.start - self.schedule_start]))[0]


class StageTable:
    def __init__(
        self,
        stages: tuple[StageSpec, ...],
        source_names: tuple[str, ...],
        windows_per_lane: dict[str, int],
        clock: StepClock,
        counters: np.ndarray,
        where: str = "<config>",
        overrides: Overrides | None = None,
        clocks: Mapping[str, TokenClock] | None = None,
    ) -> None:
        self.source_names = source_names
        self.clock = clock
        self.stages: list[StageLayout] = []
        start = 0
        counters = np.asarray(counters, dtype=np.int64)
        index = {name: k for k, name in enumerate(source_names)}  # not .index: O(sources**2)
        for spec in stages:
            sources = tuple(index[name] for name in spec.source_names)
            first_step = int(clock.step_of(start))
            schedule_start = int(clock.position(first_step))
            if spec.epochs is not None:
                draws = np.array([reps * windows_per_lane[n] for n, reps in spec.epochs], float)
                mixture = mixture_of(np.zeros((0, len(sources))), draws, 1)
                end: int | None = start + int(draws.sum())
            elif spec.mix_unit == "tokens":  # by virtual finish time (token_mix.py)
                at = counters[list(sources)]
                mixture = _token_mixture(spec, clocks or {}, at, start - schedule_start, where)
                end = None if spec.steps is None else int(clock.position(first_step + spec.steps))
            else:
                mixture = _scheduled_mixture(spec, clock, first_step, f"{where}: {spec.mix_key}")
                end = None if spec.steps is None else int(clock.position(first_step + spec.steps))
            mine = None if overrides is None else overrides.within(start, end)
            if mine is not None:
                steered = (spec, sources, mixture, mine, first_step, schedule_start)
                mixture = _steered(*steered, source_names)
            layout = StageLayout(
                spec, start, end, sources, mixture, schedule_start, counters, first_step
            )
            self.stages.append(layout)
            if end is None:
                break
            counters = self._counters_in(layout, np.array([end]))[0]
            start = end
        self.starts = np.array([s.start for s in self.stages], dtype=np.int64)

    @property
    def token_stages(self) -> bool:
        """Whether a stage mixes by tokens (`mix_unit: tokens`)."""
        return any(stage.spec.mix_unit == "tokens" for stage in self.stages)

    @property
    def end(self) -> int | None:
        return self.stages[-1].end

    def stage_index(self, positions: np.ndarray) -> np.ndarray:
        index = np.searchsorted(self.starts, positions, side="right") - 1
        last = self.stages[-1]
        if last.end is not None and np.any(np.asarray(positions) >= last.end):
            raise ConfigError(
                f"the last stage '{last.spec.name}' ends at lane position {last.end}; "
                "give the last stage no 'steps' to make it open-ended"
            )
        return index

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(stage index, source index, that source's counter) of each lane position."""
        positions = np.asarray(positions, dtype=np.int64)
        stage = self.stage_index(positions)
        indexes = sorted(set(stage.tolist()))
        if len(indexes) == 1:  # the common step: every row in one stage, none picked out
            return stage, *_drawn(self.stages[indexes[0]], positions)
        source = np.empty_like(positions)
        counter = np.empty_like(positions)
        for index in indexes:
            mask = stage == index
            source[mask], counter[mask] = _drawn(self.stages[index], positions[mask])
        return stage, source, counter

    def counters(self, position: int) -> np.ndarray:
        """Every source's counter before `position` (what a ledger carries across a switch);
        `position` may be `end`: the counters after the last stage."""
        if position == self.end:
            layout = self.stages[-1]
        else:
            layout = self.stages[int(self.stage_index(np.array([position]))[0])]
        return self._counters_in(layout, np.array([position]))[0]

    @staticmethod
    def _counters_in(layout: StageLayout, positions: np.ndarray) -> np.ndarray:
        counts = layout.mixture.counts(positions - layout.schedule_start)
        out = np.repeat(layout.counters_at_start[None, :], len(positions), axis=0)
        out[:, list(layout.sources)] += counts - layout.offsets
        return out


def _drawn(layout: StageLayout, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source index, that source's counter) of lane positions inside stage `layout`."""
    local, count = layout.mixture.sources(positions - layout.schedule_start)
    source = layout.source_indexes[local]
    counter = layout.counters_at_start[source] + count - layout.offsets[local]
    return source, counter.astype(np.int64, copy=False)


def _steered(
    spec: StageSpec,
    sources: tuple[int, ...],
    mixture: Mixture,
    overrides: Overrides,
    first_step: int,
    schedule_start: int,
    source_names: tuple[str, ...],
) -> Steered:
    """The stage's mixture with the weights the run set inside it."""
    if spec.mix_unit == "tokens":
        raise LedgerError(
            f"set_mix at step {int(overrides.steps[0])}: stage '{spec.name}' shares its tokens "
            "by constant weights (mix_unit: tokens); set weights in a stage that mixes by rows"
        )
    others = [k for k in range(len(source_names)) if k not in sources]
    outside = overrides.weights[:, others].any(axis=1)
    if spec.epochs is not None or outside.any():
        first = int(np.argmax(outside)) if spec.epochs is None else 0
        if spec.epochs is not None:
            why = "is an epochized blend, whose shares its epochs fix"
        else:
            names = [source_names[k] for k in others if overrides.weights[first, k]]
            why = f"does not draw from {', '.join(names)}"
        raise LedgerError(
            f"set_mix at step {int(overrides.steps[first])}: stage '{spec.name}' {why}; set "
            f"weights of its sources {list(spec.source_names)} in a stage that mixes by weight"
        )
    return Steered(
        mixture,
        overrides.local_steps - first_step,
        overrides.positions - schedule_start,
        overrides.weights[:, list(sources)],
    )


def _token_mixture(
    spec: StageSpec,
    clocks: Mapping[str, TokenClock],
    counters: np.ndarray,
    start: int,
    where: str,
) -> TokenMixture:
    """The stage's `mix_unit: tokens` mixture from its sources' `counters` at its first row,
    lane position `start` (relative to its schedule start)."""
    key = f"{where}: {spec.mix_key}"
    weights = dict(quantize({name: s.points[0][1] for name, s in spec.mix or ()}, key))
    units = np.array([weights.get(name, 0) for name in spec.source_names])
    return TokenMixture(units, [clocks[name] for name in spec.source_names], counters, start)


def _scheduled_mixture(spec: StageSpec, clock: StepClock, first_step: int, where: str) -> Mixture:
    """The stage's mixture over its own steps, whose rows per lane follow the batch schedule."""
    schedules = [schedule for _, schedule in spec.mix or ()]
    horizon = max(schedule.horizon for schedule in schedules)  # past it only omega's tail counts
    if spec.steps is not None:
        horizon = min(horizon, spec.steps)
    # Pieces: where a weight may change, and where the batch schedule changes rows per step.
    batch_points = clock.points - first_step
    varying = [k for k, schedule in enumerate(schedules) if schedule.kind != "constant"]
    pieces = [schedules[k].piece_starts() for k in varying]  # a constant's is [0] alone
    starts = np.unique(np.concatenate([batch_points[batch_points > 0], np.zeros(1, int), *pieces]))
    steps = np.append(starts[starts < horizon], horizon)  # the pieces, then the tail
    weights = _weights(schedules, varying, steps)
    used = weights if spec.steps is None or spec.steps > horizon else weights[:-1]
    zero = np.flatnonzero(used.sum(axis=1) <= 0)
    if zero.size:
        raise ConfigError(
            f"{where}: all weights are 0 at step {int(steps[zero[0]])} of stage "
            f"'{spec.name}'; at least one source needs a positive weight at every step"
        )
    rows = clock.rows_per_lane(first_step + steps[:-1])
    return mixture_of(weights[:-1], weights[-1], rows, steps[:-1], horizon)


def _weights(schedules: list[WeightSchedule], varying: list[int], steps: np.ndarray) -> np.ndarray:
    """[steps, sources] each schedule's weight at `steps`: the constant ones (most, in a
    mixture of hundreds of sources) set in one assignment, not one array each."""
    weights = np.empty((steps.size, len(schedules)), dtype=np.float64)
    weights[:] = [schedule.points[0][1] for schedule in schedules]  # every constant's weight
    for k in varying:
        weights[:, k] = schedules[k].at(steps)
    return weights
