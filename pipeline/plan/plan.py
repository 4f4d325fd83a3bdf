"""The data plan: what every row of every global batch draws, from (ledger, step, row) alone.

Index vocabulary, used everywhere in this package:

    step            optimizer step, counted from the start of the run (0, 1, ...)
    segment         a ledger `Segment` (a config in force from its start step); its index
                    in the ledger is a `segment_index`, and its plan a `SegmentPlan`
    micro-batch     one of `grad_accum` consecutive slices of a step's rows
    row             index of a row in the step's global batch, 0 .. global_batch_size - 1
                    (the batch of that step, when `global_batch_size` is a schedule)
    lane            canonical reader; row r belongs to lane r // rows_per_lane, so a host
                    holding a contiguous block of rows serves whole lanes
    plan step       the step whose rows a step serves: the step plus the skips recorded so
                    far (`Ledger.shift`; the step itself when the run never skipped)
    anchor          the step a segment's stages and schedules count from: 0 (the run's start,
                    `starts_at: run`) or the segment's start step (`starts_at: switch`), as a
                    served step (`Segment.stages_from` less the segment's shift)
    lane position   clock.position(step - anchor) + r % rows_per_lane, i.e. (step - anchor) *
                    rows_per_lane + r % rows_per_lane with a constant batch: the position of
                    the row in its lane's sequence as the segment's config lays it out
    counter         how many windows a lane has drawn from a source before this row (per run)
    epoch, window   counter // windows_per_lane, and the window's index in the lane's epoch
                    order (a keyed bijection of counter % windows_per_lane); after a switch
                    that changed seq_len or lanes, piecewise (`epochs.Epochs`: the rest of
                    the epoch in progress is a transitional epoch, `transition`)
    token start     where the window starts in the source's epoch stream (layout.py)
    schedule start  the lane position of a stage's step 0 (its first row's step; stages.py)

A config's `origin` is only ever its file label, for messages.

A `packing: best_fit` source draws packed rows of whole documents instead of windows
(packing.py): its `window` is the packed row and its token start is -1.

Nothing here holds iterator state: resuming is calling `draws(step, rows)` with another step
(`pipeline.read.plan.Plan.batch` reads the drawn rows).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pipeline.config import DataConfig
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan import row_layout
from pipeline.plan.carry import holder
from pipeline.plan.clock import StepClock
from pipeline.plan.draws import Draws
from pipeline.plan.lazy_layouts import Layouts
from pipeline.plan.ledger import Ledger, MixEntry, Segment
from pipeline.plan.mix_table import NO_MIXES, MixTable
from pipeline.plan.objective import stage_objectives
from pipeline.plan.row_layout import OpenStore, RowLayout, SourceKinds
from pipeline.plan.sources import keyed, open_stores
from pipeline.plan.stages import Overrides, StageTable
from pipeline.plan.token_mix import TokenClock
from pipeline.plan.transition import continued
from pipeline.plan.vocabulary import check_one_vocabulary
from pipeline.store.meta import StoreMeta
from pipeline.store.store_set import StoreSet, meta_of
from pipeline.store.token_store import TokenStore


class SegmentPlan:
    """The plan of one ledger segment: its config, source layouts and stage table.

    The stage table lays the config out from the segment's anchor (`Segment.stages_from`), so
    from its start step on the segment draws exactly the sources an uninterrupted run of its
    config would. Counters are the run's: the table is offset so that at the segment's start
    each source's counter is the one the ledger carried, and counts on from there (a table
    anchored before the start holds meaningless counters before it, which nothing reads).
    The layout is a pure function of the segment's entry in the ledger and its stores'
    metadata (`StoreMeta`): no shard file is opened, but a best_fit source's store is (its
    packing needs the document index). After a switch that changed the geometry (`seq_len`,
    `lanes`), the layouts of the sources whose counters carried continue the previous
    segment's (`previous`, `transition.continued`).
    """

    def __init__(
        self,
        segment: Segment,
        config: DataConfig,
        metas: Mapping[str, StoreMeta],
        open_store: OpenStore | None = None,
        shift: int = 0,
        mixes: MixTable = NO_MIXES,
        previous: Mapping[str, RowLayout] | None = None,
        objectives: MixTable = NO_MIXES,
    ):
        open_store = open_store or StoreSet(check_reads=config.feed.check_reads).open
        self.segment = segment
        self.config = config
        # served steps: its step t is plan step t + shift (`Ledger.shift`)
        self.anchor = segment.stages_from - shift
        self.clock = StepClock(config.batch_sizes, config.lanes)
        previous = previous or {}
        # laid out at their first use, but those a stage lays its mixture out from (`_table`)
        self.staged = _staged(config)
        self.layouts = Layouts(config, metas, open_store, {*previous, *self.staged})
        for name, before in previous.items():  # a geometry change: epochs go on
            after = continued(before, self.layouts[name], segment.counters[name])
            self.layouts.replace(name, after)
        # in source order, as draws index them (one list for every step, not one a step),
        # None until laid out (`Layouts.ready`)
        self.ordered_layouts = self.layouts.ordered
        # each one's class and kind of rows, for a step's draws to group its sources by
        # (`row_layout.by_kind`)
        self.layout_types = SourceKinds(self.layouts.types)
        self.row_kinds = SourceKinds(kind.row_kind for kind in self.layout_types)
        carried = np.array([segment.counters[name] for name in config.source_names])
        joined = self.anchor != segment.start_step
        if joined:  # continue the layout where it places the start
            carried = self._anchor_counters(carried)
        tokens = any(stage.mix_unit == "tokens" for stage in config.stages)
        if joined and tokens and (carried < 0).any():
            self._refuse_late_join(segment)
        self.table = self._table(carried, mixes)  # laid out once, with the mixes
        if joined and tokens:
            self._check_tokens_continue(segment)
        # [stages, sources] each stage's quantized objective weights, None: none has one
        specs = [stage.spec for stage in self.table.stages]
        self.objectives = stage_objectives(specs, config.source_names)
        self.set_objectives(objectives)

    def set_objectives(self, entries: MixTable) -> None:
        """Take the segment's objective entries (`Ledger.objectives`, `plan.objective`); one
        that weights a source the segment does not have raises (`MixTable.columns`)."""
        self.objective_weights = entries.columns(self.config.source_names)
        self.objective_entries = entries

    def _anchor_counters(self, carried: np.ndarray) -> np.ndarray:
        """The counters at the anchor that make each source's counter at the segment's start
        the one the ledger `carried`: a table from `carried` at the anchor tells what the rows
        before the start draw. Without mixes: they are at or after the start, so they change no
        counter before it."""
        segment, config = self.segment, self.config
        table = self._table(carried)
        first, end = self.position_of(segment.start_step), table.end
        shift = segment.stages_from - self.anchor
        if end is not None and first >= end and segment.skip:
            raise ConfigError(
                f"{config.origin}: the stages end at plan step {self._plan_step_at(end)}, "
                f"so skipping {segment.skip} steps at step {segment.start_step} (to plan "
                f"step {segment.start_step + shift}) would leave no step to serve; skip "
                "fewer steps, or make the last stage open-ended or longer"
            )
        if end is not None and first >= end:
            raise ConfigError(
                f"{config.origin}: the stages, laid out from step {self.anchor} "
                f"(starts_at: run), end at step {self._step_at(end - 1)}, before this "
                f"segment starts at step {segment.start_step}; make the last stage "
                "open-ended or longer, or use starts_at: switch"
            )
        return 2 * carried - table.counters(first)

    def _check_tokens_continue(self, segment: Segment) -> None:
        """A `mix_unit: tokens` stage's rows depend on the counters at its start (token_mix.py),
        so the layout cannot be continued from the counters the ledger carried into it: a
        segment that joins one after its first step (a skip, a `starts_at: run` switch) is
        refused unless its counters come out as carried."""
        position = self.position_of(segment.start_step)
        if self.table.end is not None:
            position = min(position, self.table.end)
        want = [segment.counters[name] for name in self.config.source_names]
        if self.table.counters(position).tolist() != want:
            self._refuse_late_join(segment)

    def _refuse_late_join(self, segment: Segment) -> None:
        raise ConfigError(
            f"{self.config.origin}: a stage with mix_unit: tokens cannot be joined after its "
            f"first step (ledger segment from step {segment.start_step}: a skip or a "
            "starts_at: run switch); switch with starts_at: switch, or mix by rows there"
        )

    def _table(self, counters: np.ndarray, mixes: MixTable = NO_MIXES) -> StageTable:
        """The stage table from `counters` at the anchor, with the weights `mixes` set."""
        config = self.config
        staged = self.staged  # laid out at the start (`Layouts`)
        windows = {name: self.layouts[name].windows_per_lane for name in staged}
        overrides = self._overrides(mixes) if mixes else None
        clocks = None
        if any(stage.mix_unit == "tokens" for stage in config.stages):  # token_mix.py
            clocks = {n: TokenClock(self.layouts[n], config.origin) for n in staged}
        return StageTable(
            config.stages,
            config.source_names,
            windows,
            self.clock,
            counters,
            config.origin,
            overrides,
            clocks,
        )

    def _overrides(self, mixes: MixTable) -> Overrides:
        """`mixes` placed in this segment's layout (vectorised: a restore may hold many)."""
        weights = mixes.columns(self.config.source_names)
        self._from_anchor(int(mixes.steps[-1]))  # refused past the last step the plan addresses
        local = mixes.steps - self.anchor
        return Overrides(mixes.steps, local, self.clock.position(local), weights)

    def steered(self, mixes: MixTable) -> SegmentPlan:
        """This segment's plan with the mix entries `mixes` instead of its own; its layouts
        are reused (no store is opened or packed again)."""
        plan = copy.copy(self)
        plan.table = self._table(self.table.stages[0].counters_at_start, mixes)
        return plan

    def position_of(self, step: int) -> int:
        """The lane position of the first row of `step` (an absolute step of the run)."""
        return int(self.clock.position(self._from_anchor(step)))

    def rows_per_lane(self, step: int) -> int:
        """Rows per lane of `step` (the batch schedule's, counted from the anchor)."""
        return int(self.clock.rows_per_lane(self._from_anchor(step)))

    def _from_anchor(self, step: int) -> int:
        """`step - anchor`, refused past the last step int64 lane positions hold (which would
        overflow, or wrap silently to another step's rows)."""
        last = self.anchor + self.clock.last_step
        if step > last:
            raise LedgerError(
                f"step {step:,} is beyond the last step this plan can address ({last:,}); "
                "past it, lane positions overflow int64"
            )
        return step - self.anchor

    def batch_size(self, step: int) -> int:
        return self.rows_per_lane(step) * self.config.lanes

    def positions(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lane, lane position) of rows of a step."""
        lane, in_lane = np.divmod(rows, self.rows_per_lane(step))
        return lane, self.position_of(step) + in_lane

    def stage_at(self, step: int) -> int:
        """The index of the stage that holds the first row of `step`."""
        return int(self.table.stage_index(np.array([self.position_of(step)]))[0])

    def counters_at(self, step: int) -> dict[str, int]:
        """Each source's counter before the first row of `step` (past a last stage that ends:
        the counters at its end)."""
        position = self.position_of(step)
        if self.table.end is not None:
            position = min(position, self.table.end)
        counters = self.table.counters(position)
        return {name: int(c) for name, c in zip(self.config.source_names, counters)}

    def end_step(self) -> int | None:
        """The step at which the last stage ends (None: open-ended)."""
        end = self.table.end
        if end is None:
            return None
        return self._step_at(end - 1) + 1

    def _step_at(self, position: int) -> int:
        """The absolute step that holds a lane position."""
        return self.anchor + int(self.clock.step_of(position))

    def _plan_step_at(self, position: int) -> int:
        """The plan step (`Ledger.shift`) that holds a lane position."""
        return self.segment.stages_from + int(self.clock.step_of(position))


P = TypeVar("P", bound="DrawPlan")


class DrawPlan:
    """The draws of a whole run (all ledger segments): which rows every step holds.

    `stores` are open `TokenStore`s or only their `StoreMeta` (or a `StoreSet` of them):
    metadata is enough to compute draws; a layout that needs a store's files (a best-fit
    packing) opens it through the set, checking its reads unless `check_reads` is False (the
    config's `feed: {verify: off}`). Reading the rows is `pipeline.read.plan.Plan`'s.

    A plan pickles (for another process: a Grain worker of `host_dataset`) to what rebuilds
    it, not its open stores: there it opens each store on first use, with `StoreSet`'s identity
    check, so a store replaced since is refused in the worker with the line the parent gives.
    `exclude_files` are offered, as stores are, to a recorded exclude file that moved (found
    by its SHA-256: `DataConfig.exclude_files`, `exclude.relocated`).
    """

    def __init__(
        self,
        ledger: Ledger,
        stores: StoreSet | Iterable[TokenStore | StoreMeta] = (),
        *,
        check_reads: bool = True,
        exclude_files: tuple[Path, ...] = (),
    ) -> None:
        self.ledger = ledger
        self.exclude_files = exclude_files
        self.store_set = (
            stores if isinstance(stores, StoreSet) else StoreSet(stores, check_reads=check_reads)
        )
        self._segments: dict[int, SegmentPlan] = {}
        # configs to lay segments out from instead of the ledger's (an unpickled plan's)
        self._configs: dict[int, DataConfig] = {}

    @property
    def check_reads(self) -> bool:
        """Whether a store given as metadata is opened with its reads checked (`StoreSet`)."""
        return self.store_set.check_reads

    def __getstate__(self) -> dict[str, Any]:
        """The ledger, the store metadata, the configs of the segments laid out so far (a
        config keeps its origin, the file that messages name) and whether reads are checked,
        without stores or lock."""
        configs = {**self._configs, **{i: plan.config for i, plan in self._segments.items()}}
        return {
            "ledger": self.ledger, "metas": self.store_set.metas(), "configs": configs,
            "check_reads": self.check_reads, "exclude_files": self.exclude_files,
        }  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(
            state["ledger"], state["metas"], check_reads=state["check_reads"],
            exclude_files=state["exclude_files"],
        )  # fmt: skip
        self._configs = state["configs"]

    @classmethod
    def from_config(
        cls: type[P],
        config: DataConfig,
        stores: Mapping | None = None,
        into: StoreSet | None = None,
    ) -> P:
        """A fresh run's plan, laid out now so every config error names the config file:
        `stores` (`TokenStore`s or `StoreMeta`s) by source name (default: each source's store,
        opened) kept in the plan's `StoreSet` (`into`: a feed's, which hands back what a failed
        plan opened), which opens a store when a read or a best-fit layout needs it. Stores of
        different tokenizers are refused here."""
        stores = open_stores(config) if stores is None else stores
        metas = {name: meta_of(store) for name, store in stores.items()}
        check_one_vocabulary(config, {f"sources.{name}": m for name, m in metas.items()})
        ledger = Ledger.start(config, {name: meta.fingerprint for name, meta in metas.items()})
        store_set = (into or StoreSet(check_reads=config.feed.check_reads)).add(*stores.values())
        plan = cls(ledger, store_set, exclude_files=config.exclude_files)
        plan._segments[0] = SegmentPlan(plan.ledger.segments[0], config, metas, plan.store_set.open)
        return plan

    @property
    def config(self) -> DataConfig:
        """The config of the last segment (the one a running job follows)."""
        return self.segment_plan(len(self.ledger.segments) - 1).config

    def segment_plan(self, index: int) -> SegmentPlan:
        """The plan of ledger segment `index`."""
        if index not in self._segments:
            segment = self.ledger.segments[index]
            config = self._configs.get(index) or self.ledger.parsed(index, self.exclude_files)
            metas = {name: self._known(segment, config, name) for name in config.source_names}
            shift, mixes = self.ledger.shift(index), self.ledger.mixes_of(index)
            opener = self.store_set.open
            previous = self._carried_layouts(index)
            objectives = self.ledger.mixes_of(index, self.ledger.objectives)
            self._segments[index] = SegmentPlan(
                segment, config, metas, opener, shift, mixes, previous, objectives
            )
        return self._segments[index]

    def _carried_layouts(self, index: int) -> dict[str, RowLayout]:
        """The layouts that segment `index` continues, when a segment up to `index` changed
        the geometry or an exclusion: for each source whose counter carried, the layout of
        the last segment before it that held the source (`holder`), so its epochs go on where
        they were (`transition.continued`), also for a source left out in between. None
        otherwise, when every layout is a function of its own segment."""
        if index == 0 or not self.ledger.relaid(index):
            return {}
        segment = self.ledger.segments[index]
        out = {}
        for name, entry in segment.config["sources"].items():
            held = holder(self.ledger.segments, index - 1, name, segment.fingerprints[name], entry)
            if held is not None:
                out[name] = self.segment_plan(held).layouts[name]
        return out

    def with_mix(self: P, entry: MixEntry) -> P:
        """This plan with `entry` recorded in its ledger (`Ledger.with_mix`): the plan of the
        segment it falls in is laid out again with it (an entry it cannot take raises, and
        nothing changes), and the counters of the skips scheduled after it follow it
        (`rederived`); stores and the earlier segments' plans are shared."""
        ledger, index = self._recorded(entry, Ledger.with_mix)
        steered = self.segment_plan(index).steered(ledger.mixes_of(index))
        kept = {i: plan for i, plan in self._segments.items() if i < index}
        plan = self._with_ledger(ledger, {**kept, index: steered})
        return plan.rederived(index + 1)

    def _recorded(
        self, entry: MixEntry, record: Callable[[Ledger, MixEntry], Ledger]
    ) -> tuple[Ledger, int]:
        """The ledger with `entry` recorded by `record` in the segment it falls in, before the
        skips scheduled after it, and that segment's index."""
        ledger = self.ledger
        index = ledger.segment_index(entry.step) if entry.step >= 0 else len(ledger.segments) - 1
        later = ledger.segments[index + 1 :]
        if not all(map(ledger.skips_only, range(index + 1, len(ledger.segments)))):
            later = ()  # not skips scheduled after the entry: `Ledger.with_mix` refuses it
        head = Ledger(ledger.segments[: len(ledger.segments) - len(later)], *ledger.tables())
        head = record(head, entry)
        return Ledger((*head.segments, *later), *head.tables()), index

    def rederived(self: P, first: int) -> P:
        """This plan with the counters of segments `first`.. (skips scheduled after a mix
        entry) carried anew (`carried_counters`), as a restore that scheduled them after the
        entry would have."""
        plan = self
        for index in range(first, len(self.ledger.segments)):
            segment = plan.ledger.segments[index]
            counters = plan.carried_counters(
                index - 1,
                segment.start_step + segment.skip,
                segment.fingerprints,
                segment.config["sources"],
            )
            if counters == segment.counters:
                continue
            segments = list(plan.ledger.segments)
            segments[index] = replace(segment, counters=counters)
            kept = {i: p for i, p in plan._segments.items() if i < index}
            plan = plan._with_ledger(Ledger(tuple(segments), *plan.ledger.tables()), kept)
        return plan

    def with_ledger(self: P, ledger: Ledger) -> P:
        """This plan's stores following `ledger` (segments laid out anew, as needed)."""
        return self._with_ledger(ledger, {})

    def with_objective(self: P, entry: MixEntry) -> P:
        """This plan with the objective `entry` recorded (`Ledger.with_objective`) in the
        segment it falls in, which takes it (its rows are unchanged: the objective only weighs
        them)."""
        ledger, index = self._recorded(entry, Ledger.with_objective)
        plan = copy.copy(self.segment_plan(index))
        plan.set_objectives(ledger.mixes_of(index, ledger.objectives))
        return self._with_ledger(ledger, {**self._segments, index: plan})

    def without_mixes_from(self: P, step: int) -> P:
        """This plan with the ledger's mix entries at or after `step` dropped, as a restore at
        `step` drops them (`Ledger.append`): what its new segment's counters are counted by,
        and re-derived by (`data_state.verify`). Stores are shared; segments laid out anew."""
        mixes, objectives = self.ledger.mixes, self.ledger.objectives
        cut, kept = mixes.first_at(step), objectives.first_at(step)
        if cut == len(mixes) and kept == len(objectives):
            return self
        ledger = Ledger(self.ledger.segments, mixes[:cut], objectives[:kept])
        return self._with_ledger(ledger, {})

    def _with_ledger(self: P, ledger: Ledger, segments: dict[int, SegmentPlan]) -> P:
        """A shallow copy (stores shared; `copy.copy` would pickle, without stores) with
        `ledger` and the segment plans laid out for it so far."""
        plan = object.__new__(type(self))
        plan.__dict__.update(self.__dict__)
        plan.ledger = ledger
        plan._segments = segments
        return plan

    def segment_plan_at(self, step: int) -> SegmentPlan:
        """The plan of the ledger segment that decides `step`."""
        return self.segment_plan(self.ledger.segment_index(step))

    def batch_size(self, step: int) -> int:
        """Rows of the global batch of `step` (the config's batch schedule at that step)."""
        return self.segment_plan_at(step).batch_size(step)

    def carried_counters(
        self, index: int, step: int, fingerprints: dict[str, str], sources: Mapping[str, dict]
    ) -> dict[str, int]:
        """The counters a segment that takes over from segment `index` at its `step` begins
        with (a new segment that skips N steps from step s: `step` is s + N, since what it
        skips counts as drawn); `fingerprints` and `sources` (config entries) are the new
        segment's.

        A source carries its counter from the last segment up to `index` that drew from the
        same store under the same name and packing (the same rows, `holder`): segment
        `index` at `step`, or an earlier one where it ended, for a source left out (or
        drawn from another store) in between and brought back. So nothing drawn in its
        epoch repeats and nothing is skipped; a source no segment held starts at 0.
        `resume.reconcile` writes them, `data_state.verify` re-derives them.
        """
        return {
            name: count
            for name, (count, _, _) in self.carried(index, step, fingerprints, sources).items()
        }

    def carried(
        self, index: int, step: int, fingerprints: dict[str, str], sources: Mapping[str, dict]
    ) -> dict[str, tuple[int, int | None, int]]:
        """`carried_counters` with where each counter comes from: (counter, the segment it
        is carried from or None, the step that segment's counters are taken at)."""
        segments = self.ledger.segments
        # laid out even if no source carries: a store of it prepared again in place is refused
        before = self.segment_plan(index).counters_at(step)
        out: dict[str, tuple[int, int | None, int]] = {}
        for name, fingerprint in fingerprints.items():
            held = holder(segments, index, name, fingerprint, sources[name])
            if held is None:
                out[name] = (0, None, step)
            elif held == index:
                out[name] = (before[name], held, step)
            else:
                at = segments[held + 1].start_step + segments[held + 1].skip
                out[name] = (self.segment_plan(held).counters_at(at)[name], held, at)
        return out

    def draws(self, step: int, rows: Iterable[int] | None = None) -> Draws:
        """What rows `rows` (default: all) of `step` hold, a pure function of (ledger, step)."""
        index = self.ledger.segment_index(step)
        plan = self.segment_plan(index)
        rows = np.arange(plan.batch_size(step)) if rows is None else np.asarray(rows)
        lane, position = plan.positions(step, rows)
        stage, source, counter = plan.table.draws(position)
        names, drawn = plan.config.source_names, sorted(set(source.tolist()))
        plan.layouts.ready(drawn)  # laid out at their first draw (`lazy_layouts`)
        epoch, window, start = row_layout.draw(
            plan.ordered_layouts, source, counter, lane, drawn, plan.layout_types
        )
        stages = tuple(stage.spec.name for stage in plan.table.stages)
        return Draws(
            step, rows, index, lane, stage, stages, source, names, counter, epoch, window, start,
            drawn,
        )  # fmt: skip

    def planned(self) -> list[SegmentPlan]:
        """The segment plans made so far, latest segment first."""
        return [plan for _, plan in sorted(self._segments.items(), reverse=True)]

    def _known(self, segment: Segment, config: DataConfig, name: str) -> StoreMeta:
        """The metadata of a segment's source: given, or its store opened (files checked as
        the segment's config says; an error named by the source's key in the segment,
        `sources.path_key`); its reads checked as the plan's maker says (the config in
        force's `feed.verify`: a recorded config holds no runtime settings)."""
        with keyed(config, name):
            path, fingerprint = config.source(name).path, segment.fingerprints[name]
            return self.store_set.meta(path, fingerprint, self.check_reads)


def _staged(config: DataConfig) -> set[str]:
    """The sources whose layouts a stage lays its mixture out from: an epochized blend's (its
    windows per lane) and a `mix_unit: tokens` stage's (`TokenClock`)."""
    return {
        name
        for stage in config.stages
        if stage.epochs is not None or stage.mix_unit == "tokens"
        for name in stage.source_names
    }
