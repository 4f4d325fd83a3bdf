"""The ledger: the whole data state of a run, small enough to live in every checkpoint.

A ledger is a list of segments. Each segment says: from `start_step` on, the data follows this
resolved config, whose stages and schedules count steps from `stages_from` (0: laid out from the
run's start, `starts_at: run`; `start_step`: from the switch, `starts_at: switch`), and each
source had already been drawn `counters[name]` windows per lane. The first segment starts at
step 0 with zero counters; a declared config switch appends one. With the step, the ledger
determines every batch the run has seen or will see.

A segment may also *skip* (`skip: N`, a restore with `skip_steps=N`, docs/steering.md): from
its start on, every step is served the rows the plan had N steps later. Skips add up along the
ledger: a step t of segment i is the *plan step* t + `Ledger.shift(i)`, the sum of the skips
of segments 0..i. Segment start steps are the trainer's steps (what it serves); `stages_from`
and the schedules count plan steps. A segment's counters are those of the plan step its start
serves (the previous segment's at `start_step + skip`), so what a skip passes over counts as
drawn.

The *data-order fingerprint* of a segment covers what decides the batches (seed, seq_len, batch
size, lanes, stages, and each source's store content), not store paths or feed options.

A ledger may also hold *mix entries* (`MixEntry`, `DataFeed.set_mix`, docs/mixtures.md
"Adaptive mixtures"): from its step on, the stage in force takes the entry's weights (integers
in units of 2^-20 of their total) until the next entry, the end of the stage, or the next
segment; appending a segment drops the entries at or after its start. They are held and
written as arrays (`mix_table.MixTable`), so that 10,000 of them restore in a few ms.

A ledger also records its *order version* (`ORDER_VERSION`: which shard and window
permutations made its batches): the same ledger gives other batches under another one, so a
ledger of any other order version is refused (docs/data-plan.md, "Order versions"). Ledgers
of versions 1 (pipeline 0.1) and 2 (before `order_version`) all have order version 1.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import DataConfig, parse_config
from pipeline.config.parse import batch_schedule_json
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan.mix_table import MIX_UNIT, NO_MIXES, MixEntry, MixTable
from pipeline.plan.mix_table import quantize as quantize  # where callers found it first
from pipeline.plan.row_layout import order_key
from pipeline.urls import write_atomically
from pipeline.version import VERSION_KEY, __version__

LEDGER_VERSION = 7  # 2 "stages_from", 3 "order_version", 4 "skip", "mixes"; 5 `MixTable`;
# 6: a geometry change (`GEOMETRY`) or a source's "exclude" (docs/steering.md); 7 "objectives"
RELAID_VERSION = 6
"""The version a ledger with a geometry change or an exclusion, and no objective entries, is
written as."""
MIXES_VERSION = 5
"""The version a ledger with mixes and no geometry change is written as."""
UNSTEERED_VERSION = 3
"""The version a ledger without skips or mixes is written as: older releases read it too."""
SKIPPED_VERSION = 4
"""The version a ledger with skips and no mixes is written as (version 4 wrote mixes as a list:
`_mixes` reads it)."""
ORDER_VERSION = 2  # 1: NumPy/Grain permutations (ledger versions 1-2); 2: plan.permutation
GEOMETRY = ("seq_len", "lanes")
"""What a switch may change from ledger version 6 on (docs/steering.md, "Context extension"):
the segment after lays the rest of each source's epoch out anew (`plan.transition`)."""


def config_mapping(config: DataConfig) -> dict[str, Any]:
    """A config as the mapping `parse_config` accepts, with absolute store paths."""
    return {
        "seed": config.seed,
        "seq_len": config.seq_len,
        "global_batch_size": batch_schedule_json(config.batch_sizes),
        "grad_accum": config.grad_accum,
        "lanes": config.lanes,
        "sources": {s.name: s.to_json() for s in config.sources},
        "stages": [stage.to_json() for stage in config.stages],
    }


def data_order(mapping: dict[str, Any], fingerprints: dict[str, str]) -> dict[str, Any]:
    """The part of a config mapping that decides the batches, stores named by content."""
    order = {k: mapping[k] for k in ("seed", "seq_len", "global_batch_size", "lanes", "stages")}
    order["sources"] = {name: fingerprints[name] for name in sorted(mapping["sources"])}
    keys = {name: order_key(entry) for name, entry in sorted(mapping["sources"].items())}
    packed = {name: key for name, key in keys.items() if key is not None}
    if packed:  # only then: the orders of configs of concat sources alone are unchanged
        order["packing"] = packed
    excluded = {
        name: entry["exclude"]["sha256"]
        for name, entry in sorted(mapping["sources"].items())
        if "exclude" in entry
    }
    if excluded:  # only then, likewise: the excluded ids' digest per source
        order["exclude"] = excluded
    return order


def fingerprint_of(order: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(order, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Segment:
    start_step: int
    config: dict[str, Any]
    fingerprints: dict[str, str]
    counters: dict[str, int]
    stages_from: int = 0  # the plan step the config's stages and schedules count from
    skip: int = 0  # plan steps passed over at the segment's start (a restore's skip_steps)

    @property
    def order(self) -> dict[str, Any]:
        return data_order(self.config, self.fingerprints)

    @property
    def fingerprint(self) -> str:
        """What the ledger file records against edits: the data order, the anchoring when it
        is not the segment's own start, and the skip when there is one."""
        extra: dict[str, Any] = {} if self.skip == 0 else {"skip": self.skip}
        if self.stages_from != self.start_step:
            extra["stages_from"] = self.stages_from
        return fingerprint_of({**self.order, **extra})

    def parsed(self, where: str, offered: tuple[Path, ...] = ()) -> DataConfig:
        """The recorded config; `offered`: where an exclude file that moved may be found."""
        try:
            return parse_config(self.config, origin=where, offered=offered)
        except ConfigError as error:  # its message starts with `where` (the origin)
            reason = str(error).removeprefix(f"{where}: ")
            raise LedgerError(f"{where}: the recorded config is invalid: {reason}") from error

    def to_json(self) -> dict[str, Any]:
        return {
            "start_step": self.start_step,
            "config": self.config,
            "fingerprints": self.fingerprints,
            "counters": self.counters,
            "stages_from": self.stages_from,
            "fingerprint": self.fingerprint,
            **({"skip": self.skip} if self.skip else {}),
        }


@dataclass(frozen=True)
class Ledger:
    segments: tuple[Segment, ...]
    mixes: MixTable = NO_MIXES  # by step, strictly increasing
    objectives: MixTable = NO_MIXES  # objective entries, likewise

    def __post_init__(self) -> None:
        for name in ("mixes", "objectives"):
            table = getattr(self, name)
            if not isinstance(table, MixTable):  # a sequence of `MixEntry`
                object.__setattr__(self, name, MixTable.from_entries(tuple(table)))

    @classmethod
    def start(cls, config: DataConfig, fingerprints: dict[str, str]) -> Ledger:
        """A new run's ledger: one segment from step 0, every counter at 0."""
        counters = dict.fromkeys(config.source_names, 0)
        return cls((Segment(0, config_mapping(config), dict(fingerprints), counters),))

    @property
    def last(self) -> Segment:
        """The segment in force from its start step on."""
        return self.segments[-1]

    def parsed(self, index: int, offered: tuple[Path, ...] = ()) -> DataConfig:
        """Segment `index`'s recorded config, parsed; an error names the segment (a recorded
        exclude file edited since, say). `offered`: `Segment.parsed`."""
        segment = self.segments[index]
        where = f"ledger segment {index} (from step {segment.start_step})"
        return segment.parsed(where, offered)

    def segment_index(self, step: int) -> int:
        """The index of the segment that decides `step`."""
        if step < 0:
            raise LedgerError(f"step {step} is negative")
        return max(i for i, s in enumerate(self.segments) if s.start_step <= step)

    def shift(self, index: int) -> int:
        """Plan step minus served step in segment `index`: the skips of segments 0..index."""
        return sum(segment.skip for segment in self.segments[: index + 1])

    def plan_step(self, step: int) -> int:
        """The plan step whose rows `step` serves (`step` itself when nothing was skipped)."""
        return step + self.shift(self.segment_index(step))

    def entry(self, index: int) -> str:
        """What segment `index` records, for `pipeline stages --ledger`: `start`, `switch:
        <keys> changed`, `geometry seq_len a -> b, ...` (a switch that changed `GEOMETRY`),
        `exclude sources.NAME: the ids of FILE (sha256 ...)`, `skip N steps (step s serves
        plan step p)`, `; `-joined."""
        if index == 0:
            return "start"
        segment, before = self.segments[index], self.segments[index - 1]
        changed = sorted(
            {line.split(":")[0] for line in describe_diff(before.order, segment.order)}
        )
        excluded = [key.removeprefix("exclude.") for key in changed if key.startswith("exclude.")]
        changed = [key for key in changed if not key.startswith("exclude.")]
        what = [f"switch: {', '.join(changed)} changed"] if changed else []
        for name in excluded:  # a take-down, with what it takes down (docs/steering.md)
            entry = segment.config["sources"].get(name, {}).get("exclude")
            what.append(
                f"exclude sources.{name}: the ids of {entry['file']} (sha256 "
                f"{entry['sha256'][:12]})"
                if entry
                else f"exclude sources.{name}: none (the exclusion was dropped)"
            )
        reshaped = [
            f"{key} {before.config[key]} -> {segment.config[key]}"
            for key in GEOMETRY
            if before.config[key] != segment.config[key]
        ]
        if reshaped:  # the intervention itself, with its values (docs/steering.md)
            what.append(f"geometry {', '.join(reshaped)}: the epochs go on, laid out anew")
        if segment.skip:
            what.append(
                f"skip {segment.skip} steps (step {segment.start_step:,} serves plan step "
                f"{self.plan_step(segment.start_step):,})"
            )
        return "; ".join(what) or "switch: stages laid out anew"

    def relaid(self, index: int) -> bool:
        """Whether a segment at or before `index` changed the geometry or a source's
        exclusion (`sources.NAME.exclude`): then its layouts continue those of the segment
        before it (`DrawPlan.segment_plan`)."""
        return self.reshaped(index) or any(
            _exclusions(a) != _exclusions(b)
            for a, b in itertools.pairwise(self.segments[: index + 1])
        )

    def reshaped(self, index: int) -> bool:
        """Whether a segment at or before `index` changed the geometry (`GEOMETRY`): then its
        layouts continue those of the segment before it (`DrawPlan.segment_plan`)."""
        return any(
            _geometry(a) != _geometry(b) for a, b in itertools.pairwise(self.segments[: index + 1])
        )

    def append(self, segment: Segment) -> Ledger:
        """The ledger with `segment` appended; mix entries at or after its start are dropped
        (they were set ahead of the restore that appends it)."""
        start = segment.start_step
        mixes, objectives = (table[: table.first_at(start)] for table in self.tables())
        return Ledger((*self.segments, segment), mixes, objectives)

    def tables(self) -> tuple[MixTable, MixTable]:
        """The mix and objective entries, in the order `Ledger` takes them."""
        return self.mixes, self.objectives

    def with_mix(self, entry: MixEntry) -> Ledger:
        """The ledger with `entry` recorded; one at the same step as the last is replaced.
        (Before skips scheduled after it: `DrawPlan.with_mix`, which carries their counters
        anew.)"""
        return Ledger(self.segments, self._recorded(self.mixes, entry, "mixes"), self.objectives)

    def with_objective(self, entry: MixEntry) -> Ledger:
        """The ledger with the objective `entry` recorded, as `with_mix` records a mix."""
        recorded = self._recorded(self.objectives, entry, "objectives")
        return Ledger(self.segments, self.mixes, recorded)

    def _recorded(self, table: MixTable, entry: MixEntry, what: str) -> MixTable:
        last = int(table.steps[-1]) if len(table) else -1
        if last == entry.step:
            table = table[:-1]
        elif last > entry.step:
            raise LedgerError(
                f"set_mix at step {entry.step}: {what} already set from step {last}; set "
                f"{what} in step order"
            )
        if entry.step < self.last.start_step:
            raise LedgerError(
                f"set_mix at step {entry.step}: before the ledger's last segment (from step "
                f"{self.last.start_step})"
            )
        return table.appended(entry)

    def skips_only(self, index: int) -> bool:
        """Whether segment `index` only skips: the data order and anchoring of the segment
        before it, N steps later. Only such a segment may start after a data state's step (a
        skip scheduled there, `skips.resolve`)."""
        if index == 0:
            return False
        segment, before = self.segments[index], self.segments[index - 1]
        return (
            segment.skip > 0
            and segment.stages_from == before.stages_from
            and fingerprint_of(segment.order) == fingerprint_of(before.order)
        )

    def until(self, step: int) -> Ledger:
        """The segments that start at or before `step` (and every mix and objective entry):
        the ledger without the skips scheduled after `step`."""
        kept = tuple(segment for segment in self.segments if segment.start_step <= step)
        if len(kept) == len(self.segments):
            return self
        return Ledger(kept, self.mixes, self.objectives)

    def mixes_of(self, index: int, table: MixTable | None = None) -> MixTable:
        """The mix entries (or those of `table`: `objectives`) inside segment `index`
        (bisection: O(log entries))."""
        table = self.mixes if table is None else table
        stop = len(table)
        if index + 1 < len(self.segments):
            stop = table.first_at(self.segments[index + 1].start_step)
        return table[table.first_at(self.segments[index].start_step) : stop]

    def to_json(self) -> dict[str, Any]:
        """The JSON a checkpoint saves: the lowest ledger version that holds it, the order
        version, the segments, set mixes, and the release that wrote it."""
        version = UNSTEERED_VERSION
        if any(segment.skip for segment in self.segments):
            version = SKIPPED_VERSION
        if self.mixes:
            version = MIXES_VERSION
        if self.reshaped(len(self.segments) - 1) or any(map(_exclusions, self.segments)):
            version = RELAID_VERSION
        if self.objectives:
            version = LEDGER_VERSION
        raw = {
            "version": version,
            "order_version": ORDER_VERSION,
            "segments": [s.to_json() for s in self.segments],
            VERSION_KEY: __version__,  # who wrote it; reading ignores it (older ledgers lack it)
        }
        if self.mixes:
            raw["mixes"] = self.mixes.to_json()
        if self.objectives:
            raw["objectives"] = self.objectives.to_json()
        return raw

    @classmethod
    def from_json(cls, raw: Any, origin: str = "<ledger>") -> Ledger:
        """A ledger from its JSON, checked: version, order version, each segment's
        fingerprint and start; a bad one is one `LedgerError` naming `origin`."""
        version = raw.get("version") if isinstance(raw, dict) else None
        known = (1, 2, UNSTEERED_VERSION, SKIPPED_VERSION, MIXES_VERSION, RELAID_VERSION)
        if version not in (*known, LEDGER_VERSION):
            raise LedgerError(
                f"{origin}: not a ledger of versions 1 to {LEDGER_VERSION} (found {version!r}); "
                "a later release of pipeline wrote it?"
            )
        order = raw.get("order_version") if version >= UNSTEERED_VERSION else 1
        if order != ORDER_VERSION:
            raise LedgerError(
                f"{origin}: written under order version {order}, but this release of "
                f"pipeline computes order version {ORDER_VERSION} (the shard and window "
                "permutations changed), so its steps would get other batches; start the data "
                "from a fresh ledger, or finish the run with the release that wrote it "
                "(pipeline 0.1 for order version 1)"
            )
        segments, fingerprints = [], []
        for index, entry in enumerate(raw.get("segments") or []):
            try:
                segment = Segment(
                    int(entry["start_step"]),
                    dict(entry["config"]),
                    dict(entry["fingerprints"]),
                    {k: int(v) for k, v in entry["counters"].items()},
                    int(entry["stages_from"]),
                    int(entry.get("skip", 0)),
                )
                _check_recorded_exclusions(segment.config, f"{origin}: segments[{index}]")
                fingerprints.append(segment.fingerprint)  # the config holds the data order
            except (AttributeError, KeyError, TypeError, ValueError) as error:
                reason = f"no key {error}" if isinstance(error, KeyError) else error
                raise LedgerError(f"{origin}: segments[{index}] is malformed: {reason}") from error
            segments.append(segment)
        _check_lined_up(segments, origin, version)
        for index, (entry, fingerprint) in enumerate(zip(raw["segments"], fingerprints)):
            if entry.get("fingerprint") not in (None, fingerprint):
                raise LedgerError(
                    f"{origin}: segments[{index}] fingerprint does not match its content "
                    "(the ledger was edited)"
                )
        if version == SKIPPED_VERSION:
            mixes = MixTable.from_entries(_mixes(raw.get("mixes") or [], origin))
        elif version == MIXES_VERSION or (version >= RELAID_VERSION and "mixes" in raw):
            mixes = MixTable.from_json(raw.get("mixes"), f"{origin}: mixes")
        else:
            mixes = NO_MIXES
        objectives = NO_MIXES
        if version == LEDGER_VERSION and "objectives" in raw:
            objectives = MixTable.from_json(raw["objectives"], f"{origin}: objectives")
        if not (mixes or objectives):
            return cls(tuple(segments))
        ledger = cls(tuple(segments), mixes, objectives)
        for name, table in (("mixes", mixes), ("objectives", objectives)):
            table.check(f"{origin}: {name}")  # either form: checked once, vectorised
            _check_mix_sources(ledger, table, f"{origin}: {name}")
        return ledger

    def save(self, path: str | Path) -> None:
        """Write the ledger's JSON to a local path or a `gs://` URL; a run killed while saving
        leaves the previous ledger whole (`write_atomically`)."""
        text = json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n"
        write_atomically(path, text.encode())


def _check_mix_sources(ledger: Ledger, table: MixTable, where: str) -> None:
    """Refuse an entry of `table` that weights a source its segment does not have
    (vectorised)."""
    for index, segment in enumerate(ledger.segments):
        try:
            ledger.mixes_of(index, table).columns(tuple(segment.config["sources"]))
        except LedgerError as error:
            raise LedgerError(f"{where}: {error}, segments[{index}]") from None


def _mixes(raw: Any, origin: str) -> tuple[MixEntry, ...]:
    """The `mixes` of a version-4 ledger's JSON (a list of `[step, {source: weight}]`), each
    entry's form checked: integer weights > 0, which a `MixTable` cannot tell from a left-out
    source once read. Their order, totals and sources are the table's checks
    (`MixTable.check`, `_check_mix_sources`), as for a version-5 ledger."""
    out: list[MixEntry] = []
    for index, item in enumerate(raw):
        where = f"{origin}: mixes[{index}]"
        if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int):
            raise LedgerError(f"{where} is malformed: expected [step, {{source: weight}}]")
        step, weights = item
        if (
            not isinstance(weights, dict)
            or not weights
            or any(type(w) is not int or w <= 0 for w in weights.values())
        ):
            raise LedgerError(
                f"{where}: weights must be integers > 0 (units of 1/{MIX_UNIT} of their total); "
                f"got {weights}"
            )
        out.append(MixEntry(step, tuple(sorted(weights.items()))))
    return tuple(out)


def _check_recorded_exclusions(config: dict[str, Any], where: str) -> None:
    """Refuse a recorded `exclude` that is not `{file, missing, sha256}` (what `config_mapping`
    writes): the data order reads its digest."""
    for name, entry in config["sources"].items():
        recorded = entry.get("exclude")
        if recorded is not None and not (
            isinstance(recorded, dict) and isinstance(recorded.get("sha256"), str)
        ):
            raise LedgerError(
                f"{where}.config.sources.{name}.exclude is malformed: expected "
                f"{{file, missing, sha256}}, got {recorded!r}"
            )


def _exclusions(segment: Segment) -> dict[str, str]:
    """Each source's excluded ids' digest (sources that exclude none are absent)."""
    return segment.order.get("exclude", {})


def _geometry(segment: Segment) -> tuple[Any, ...]:
    return tuple(segment.config.get(key) for key in GEOMETRY)


def _check_lined_up(segments: list[Segment], origin: str, version: int) -> None:
    if not segments:
        raise LedgerError(f"{origin}: a ledger has at least one segment")
    if segments[0].start_step != 0:
        raise LedgerError(f"{origin}: segments[0] starts at step {segments[0].start_step}, not 0")
    for index, (before, after) in enumerate(itertools.pairwise(segments), start=1):
        if after.start_step <= before.start_step:
            raise LedgerError(
                f"{origin}: segments[{index}] starts at step {after.start_step}, not after "
                f"segments[{index - 1}] (step {before.start_step}); segments must line up in order"
            )
        changed = [k for k in GEOMETRY if after.config.get(k) != before.config.get(k)]
        if changed and version < RELAID_VERSION:
            raise LedgerError(
                f"{origin}: segments[{index}] changes {' and '.join(changed)}, which a ledger "
                f"of version {version} cannot (from version {RELAID_VERSION} on, a switch may)"
            )
    for index, segment in enumerate(segments):
        names = set(segment.config.get("sources", {}))
        if set(segment.counters) != names or set(segment.fingerprints) != names:
            raise LedgerError(
                f"{origin}: segments[{index}] counters/fingerprints do not name its sources "
                f"{sorted(names)}"
            )
        if any(v < 0 for v in segment.counters.values()):
            raise LedgerError(f"{origin}: segments[{index}] has a negative counter")
        if segment.skip < 0 or (index == 0 and segment.skip):
            raise LedgerError(
                f"{origin}: segments[{index}] skips {segment.skip} steps; a skip is > 0, "
                "and segments[0] has none"
            )
        plan_start = segment.start_step + sum(s.skip for s in segments[: index + 1])
        kept = segments[index - 1].stages_from if index and segment.skip else 0
        if segment.stages_from not in (0, plan_start, kept):
            raise LedgerError(
                f"{origin}: segments[{index}] lays its stages out from plan step "
                f"{segment.stages_from}; only 0 (starts_at: run) or its start step "
                f"{plan_start} (starts_at: switch; in plan steps, after the skips) are "
                "possible, or the previous segment's for a segment that skips"
            )


def describe_diff(
    before: dict[str, Any],
    after: dict[str, Any],
    paths: tuple[dict[str, str], dict[str, str]] = ({}, {}),
) -> list[str]:
    """Readable `key: old -> new` lines between two data orders. An order names a source's
    store by fingerprint only; `paths` (source name -> store path, before and after) shows the
    path beside it, which is what a reader recognises."""
    old, new = _flatten(before), _flatten(after)
    lines = []
    for key in sorted(set(old) | set(new), key=str):
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            lines.append(f"{key}: {_shown(key, old, paths[0])} -> {_shown(key, new, paths[1])}")
    return lines


def _shown(key: str, values: dict[str, Any], paths: dict[str, str]) -> Any:
    name = key.removeprefix("sources.")
    if key not in values:
        return "<absent>"
    if key.startswith("sources.") and name in paths:
        return f"{paths[name]} (store {values[key]})"
    return values[key]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list):
        out = {}
        for index, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}[{index}]"))
        return out
    return {prefix: value}
