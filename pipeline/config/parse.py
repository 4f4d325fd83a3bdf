"""The data config: YAML in, a validated `DataConfig` out, before anything is read.

    seed: 1234
    seq_len: 1024
    global_batch_size: 64        # rows per optimizer step; or {step: {0: 64, 2000: 128}}
    grad_accum: 1                # micro-batches per optimizer step
    lanes: 1                     # canonical readers; changes only at a switch (docs/steering.md)
    sources:
      code: {path: ../data/python-code}     # relative to this file; $VARS are expanded
      docs: {path: ../data/python-docs}
      sft: {path: ../data/chat, packing: best_fit, too_long: truncate}  # whole documents
      web: {path: ../data/web, packing: best_fit, exclude: takedown.txt}  # ids left out
    mix: {code: 3, docs: 1}      # one open-ended stage; or `stages:` (docs/mixtures.md)
    objective: {code: 1, docs: 1}  # optional: each source's share of the loss (loss_weights)
    starts_at: run               # after a --switch-data, lay stages out from step 0 (or `switch`)
    feed: {prefetch: 2, threads: auto, verify: read, expand: auto}  # runtime only: never
                                            # changes the data (+ provenance, metrics_port,
                                            # input-bound detection: docs/observability.md)
    eval:                        # optional held-out stores (prepare --eval-fraction)
      sources: {docs: {path: ../data/python-docs-eval}}
      batches: 4                 # per eval set; default: every full batch of the store

    shared_vocabulary: false     # true: stores of different tokenizers may mix, on purpose

Every message names the file and the key, echoes the value and says what is allowed. The YAML
is read strictly (`strict_yaml`: UTF-8, no duplicate key, errors with line and column), and
sizes are bounded so that every step and position fits int64 (docs/data-plan.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from pipeline.config.exclude import ExcludeSpec, exclude_files, parse_exclude
from pipeline.config.mix_unit import parse_mix_unit
from pipeline.config.objective import Objective, objective_json, parse_objective
from pipeline.config.paths import anchored
from pipeline.config.remote_section import REMOTE_KEYS, RemoteOptions, remote_options
from pipeline.config.schedule import WeightSchedule, parse_schedule
from pipeline.config.strict_yaml import load_yaml
from pipeline.config.where import Where
from pipeline.errors import ConfigError
from pipeline.in_place import COLUMN_FORMATS, DEFAULT_COLUMN, IN_PLACE_FORMATS, default_index_dir
from pipeline.urls import is_url, location
from pipeline.wording import counted

TOP_KEYS = ("seed", "seq_len", "global_batch_size", "grad_accum", "lanes", "sources", "mix",
            "objective", "mix_unit", "stages", "starts_at", "feed", "eval",
            "shared_vocabulary")  # fmt: skip
ANCHORS = ("run", "switch")
STAGE_KEYS = ("name", "steps", "mix", "epochs", "objective", "mix_unit")
FEED_KEYS = ("prefetch", "threads", "provenance", "metrics_port", "input_bound_share",
             "stats_window", "verify", "ready_timeout_s", "expand", *REMOTE_KEYS)  # fmt: skip
PROVENANCE = ("source", "epoch", "window")
"""Per-row fields the feed can add to a batch, in this order (docs/observability.md)."""
VERIFY_POLICIES = ("off", "read", "open", "background")
EXPAND_MODES = ("auto", "device", "host")
"""`feed.expand`: where the six fields are built from what is transferred (pipeline.feed.expand)."""
EVAL_KEYS = ("sources", "batches")
# Bounds that keep every size in memory and every lane position in int64 (documented in
# docs/data-plan.md): a row is seq_len + 1 tokens, a step global_batch_size rows.
MAX_SEQ_LEN = 1 << 24
MAX_BATCH = 1 << 24
MAX_SEED = (1 << 63) - 1
MAX_EPOCHS = 1 << 20
MAX_THREADS = 1024
AUTO_THREADS = "auto"
"""`feed.threads`' default: one reader thread for local stores, more for remote ones
(`pipeline.feed.readers.reader_count`)."""
MAX_POSITION = 1 << 62  # lane positions: steps x rows, with room for sums


# The row layouts a source's `packing:` names, each by the module that declares it (its
# `LAYOUT`, a `pipeline.plan.row_layout.RowLayout`): a new layout is that module and one line
# here (docs/architecture.md).
PACKINGS = {"concat": "pipeline.plan.layout", "best_fit": "pipeline.plan.packing"}
TOO_LONG = ("truncate", "drop")
# a prepared store, or a corpus read in place (Megatron, Parquet/Arrow: in-place-corpora.md)
FORMATS = ("store", *IN_PLACE_FORMATS)


@dataclass(frozen=True)
class SourceSpec:
    """A source: its store, and how its documents become rows (docs/instruction-data.md)."""

    name: str
    path: Path
    packing: str = "concat"  # windows of the concatenated stream, or whole documents
    too_long: str = "truncate"  # best_fit: a document longer than a row is cut or dropped
    # read in place (megatron, parquet): `path` is the index directory (`pipeline index`),
    # `data` the corpus's path (PREFIX; a directory or glob) and `column` its token column
    format: str = "store"
    data: Path | None = None
    column: str | None = None
    exclude: ExcludeSpec | None = None  # documents left out (config/exclude.py)

    def to_json(self) -> dict[str, str]:
        """The source as config keys; defaults are left out, so concat sources read as ever."""
        out = {"path": str(self.path)}
        if self.format != "store":
            out = {"path": str(self.data), "format": self.format, "index": str(self.path)}
        if self.column is not None:
            out["column"] = self.column
        if self.packing != "concat":
            out.update(packing=self.packing, too_long=self.too_long)
        if self.exclude is not None:
            out["exclude"] = self.exclude.to_json()
        return out


@dataclass(frozen=True)
class StageSpec:
    """`steps` + `mix` (steps None: open-ended), or an epochized blend (`epochs`)."""

    name: str
    steps: int | None = None
    mix: tuple[tuple[str, WeightSchedule], ...] | None = None
    epochs: tuple[tuple[str, int], ...] | None = None
    # where `mix` is in its file (`mix` or `stages[i].mix`), for the errors the plan finds
    mix_key: str = field(default="stages[0].mix", compare=False)
    objective: Objective | None = None  # each source's share of the loss (config/objective.py)
    mix_unit: str = "rows"  # what the weights share out: rows or tokens (config/mix_unit.py)

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in (self.mix or self.epochs or ()))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.epochs is not None:
            out["epochs"] = dict(self.epochs)
        else:
            out["steps"] = self.steps
            out["mix"] = {name: schedule.to_json() for name, schedule in self.mix or ()}
        if self.objective is not None:  # only then: configs without one keep their bytes
            out["objective"] = objective_json(self.objective)
        if self.mix_unit != "rows":  # likewise
            out["mix_unit"] = self.mix_unit
        return out


@dataclass(frozen=True)
class FeedOptions:
    """How the feed runs; none of it changes a batch's six token fields."""

    prefetch: int = 2
    threads: int | str = AUTO_THREADS  # reader threads: an integer >= 1, or AUTO_THREADS
    provenance: tuple[str, ...] = ()  # extra per-row fields, a subset of PROVENANCE
    metrics_port: int | None = None  # serve Prometheus metrics on this port (extra `metrics`)
    input_bound_share: float = 0.1  # a step is input-bound when next() took more of it
    stats_window: int = 100  # steps per input-bound warning window
    ready_timeout_s: float | None = None  # wait this long for every host's first batch
    # What is checksummed: off (a shard's identity at first use only), read (also each block
    # of a flat sidecar on its first read), or read plus the full pass: open (before step 0),
    # background (while training). docs/token-store.md, "Verification".
    verify: str = "read"
    # Where the six fields are built: on the devices from the compact form transferred (device),
    # on the host, transferred as built (host), or device on accelerators, host on CPUs (auto).
    expand: str = "auto"
    remote: RemoteOptions = field(default_factory=RemoteOptions)  # feed.cache, .read_timeout_s

    @property
    def check_reads(self) -> bool:
        """Whether stores check each sidecar block on its first read (`TokenStore`)."""
        return self.verify != "off"


@dataclass(frozen=True)
class DataConfig:
    """A validated data config. `batch_sizes` is the batch schedule: (step, rows) points, the
    first at step 0, each size holding until the next point (one point: a constant batch)."""

    seed: int
    seq_len: int
    batch_sizes: tuple[tuple[int, int], ...]
    sources: tuple[SourceSpec, ...]
    stages: tuple[StageSpec, ...]
    grad_accum: int = 1
    lanes: int = 1
    feed: FeedOptions = field(default_factory=FeedOptions)
    origin: str = "<config>"
    eval_sources: tuple[SourceSpec, ...] = ()
    eval_batches: int | None = None
    starts_at: str = "run"  # where a switched-to config's stages count from: "run" or "switch"
    shared_vocabulary: bool = False  # stores of different tokenizers may mix, on purpose
    home: Path | None = field(default=None, compare=False)  # its directory (None: a URL's)
    sources_key: str = field(default="sources", compare=False)  # "eval.sources" for an eval set

    @property
    def exclude_files(self) -> tuple[Path, ...]:
        """What this config offers a ledger's exclude file that moved (`exclude.relocated`)."""
        return exclude_files(self.sources, self.home)

    @property
    def batch_is_scheduled(self) -> bool:
        """Whether `global_batch_size` changes with the step (a batch ramp)."""
        return len(self.batch_sizes) > 1

    @property
    def global_batch_size(self) -> int:
        """The batch of a config whose batch is constant (a schedule has no single one)."""
        if self.batch_is_scheduled:
            raise ConfigError(
                f"{self.origin}: global_batch_size is a schedule "
                f"({batch_schedule_json(self.batch_sizes)}); this use needs a constant batch"
            )
        return self.batch_sizes[0][1]

    @property
    def rows_per_lane(self) -> int:
        """Rows per lane of a constant batch (with a schedule: `SegmentPlan.rows_per_lane`)."""
        return self.global_batch_size // self.lanes

    @property
    def final_batch_size(self) -> int:
        """The batch the schedule ends at (the batch itself when constant)."""
        return self.batch_sizes[-1][1]

    @cached_property
    def source_names(self) -> tuple[str, ...]:
        """Asked for at every step: built once (a mixture may have hundreds of sources)."""
        return tuple(s.name for s in self.sources)

    def source(self, name: str) -> SourceSpec:
        """The source called `name` (one of `source_names`)."""
        return self._by_name[name]

    @cached_property
    def in_buckets(self) -> frozenset[str]:
        """The sources whose stores are in a bucket (a URL), by name: asked of each of a
        mixture's hundreds at the start (planned or opened, read in parallel or not)."""
        return frozenset(s.name for s in self.sources if is_url(s.path))

    @cached_property
    def _by_name(self) -> dict[str, SourceSpec]:
        """The sources by name: a plan asks for each of hundreds once."""
        return {s.name: s for s in self.sources}


def load_config(path: str | Path) -> DataConfig:
    """Read a config from a local path or a URL (`gs://bucket/run.yaml`, never made local)."""
    url = is_url(path)
    raw = load_yaml(path)
    return parse_config(raw, origin=str(path), base_dir=None if url else Path(path).parent)


def parse_config(
    raw: Any,
    origin: str = "<config>",
    base_dir: Path | None = Path(),
    offered: tuple[Path, ...] = (),
) -> DataConfig:
    """`base_dir` anchors relative store paths; None (a config read from a URL) refuses them.
    `offered`: where a recorded exclude file that moved may be found (`exclude.relocated`)."""
    where = Where(origin)
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: a data config is a mapping, got {type(raw).__name__}")
    where.keys(raw, TOP_KEYS, "")
    for key in ("seq_len", "global_batch_size", "sources"):
        if key not in raw:
            raise ConfigError(f"{origin}: missing required key '{key}'")
    seed = where.integer(raw.get("seed", 0), "seed", minimum=0, maximum=MAX_SEED)
    seq_len = where.integer(raw["seq_len"], "seq_len", minimum=1, maximum=MAX_SEQ_LEN)
    batches = _batch_sizes(raw["global_batch_size"], where)
    grad_accum = where.integer(raw.get("grad_accum", 1), "grad_accum", minimum=1)
    lanes = where.integer(raw.get("lanes", 1), "lanes", minimum=1)
    for step, batch in batches:
        at = "" if len(batches) == 1 else f" (the batch from step {step})"
        for key, value in (("lanes", lanes), ("grad_accum", grad_accum)):
            if batch % value:
                raise ConfigError(
                    f"{origin}: global_batch_size {batch}{at} is not divisible by {key} {value}"
                )
    starts_at = raw.get("starts_at", "run")
    if starts_at not in ANCHORS:
        raise where.fail("starts_at", f"expected 'run' or 'switch', got {starts_at!r}")
    sources = _sources(raw["sources"], where, base_dir, offered=offered)
    stages = _stages(raw, where, {s.name for s in sources})
    _check_steps_fit(stages, batches, where, "" if "mix" in raw else "stages[{}].")
    feed = _feed(raw.get("feed", {}), where)
    eval_sources, eval_batches = _eval(raw.get("eval"), where, base_dir)
    shared = raw.get("shared_vocabulary", False)
    if not isinstance(shared, bool):
        raise where.fail("shared_vocabulary", f"expected true or false, got {shared!r}")
    return DataConfig(
        seed, seq_len, batches, sources, stages, grad_accum, lanes, feed, origin,
        eval_sources, eval_batches, starts_at, shared,
        None if base_dir is None else base_dir.resolve(),
    )  # fmt: skip


def batch_schedule_json(batch_sizes: tuple[tuple[int, int], ...]) -> Any:
    """The `global_batch_size` value that parses back to `batch_sizes` (an int if constant)."""
    if len(batch_sizes) == 1:
        return batch_sizes[0][1]
    return {"step": {str(step): size for step, size in batch_sizes}}


def _batch_sizes(raw: Any, where: Where) -> tuple[tuple[int, int], ...]:
    """`global_batch_size`: rows per optimizer step, or `{step: {STEP: ROWS}}` from step 0."""
    key = "global_batch_size"
    if not isinstance(raw, dict):
        return ((0, where.integer(raw, key, minimum=1, maximum=MAX_BATCH)),)
    if list(raw) != ["step"] or not isinstance(raw["step"], dict) or not raw["step"]:
        raise where.fail(
            key, f"expected rows per step or {{step: {{0: ROWS, STEP: ROWS, ...}}}}, got {raw!r}"
        )
    points = []
    for step, size in raw["step"].items():
        if isinstance(step, str) and step.isdigit():
            step = int(step)  # JSON (a ledger) keeps mapping keys as strings
        step = where.integer(step, f"{key}.step", minimum=0)
        size = where.integer(size, f"{key}.step.{step}", minimum=1, maximum=MAX_BATCH)
        points.append((step, size))
    steps = [step for step, _ in points]
    if steps[0] != 0 or steps != sorted(set(steps)):
        raise where.fail(f"{key}.step", f"steps start at 0 and increase, got {steps}")
    return tuple(points)


def _sources(
    raw: Any,
    where: Where,
    base_dir: Path | None,
    parent: str = "sources",
    offered: tuple[Path, ...] = (),
) -> tuple[SourceSpec, ...]:
    sources = []
    directories: dict[str, tuple[str, Path]] = {}  # stores' parents, resolved once (`resolved`)
    for name, entry in where.mapping(raw, parent).items():
        key = f"{parent}.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            raise where.fail(key, "source names are identifiers (letters, digits, _)")
        allowed = ("path", "format", "index", "column")  # an eval set may be read in place
        if parent == "sources":
            allowed = (*allowed, "packing", "too_long", "exclude")
        where.keys(where.mapping(entry, key), allowed, key)
        if not isinstance(entry.get("path"), str):
            raise where.fail(
                f"{key}.path", f"expected a store directory, got {entry.get('path')!r}"
            )
        path = os.path.expandvars(entry["path"])
        if "$" in path:
            raise where.fail(f"{key}.path", f"unset environment variable in {entry['path']!r}")
        packing = entry.get("packing", "concat")
        if packing not in PACKINGS:
            raise where.fail(f"{key}.packing", f"expected {' or '.join(PACKINGS)}, got {packing!r}")
        too_long = entry.get("too_long", "truncate")
        if too_long not in TOO_LONG:
            raise where.fail(f"{key}.too_long", f"expected truncate or drop, got {too_long!r}")
        if "too_long" in entry and packing == "concat":
            raise where.fail(f"{key}.too_long", "a packing: concat source has no too_long")
        kind = entry.get("format", "store")
        if kind not in FORMATS:
            raise where.fail(
                f"{key}.format",
                f"expected {', '.join(FORMATS[:-1])} or {FORMATS[-1]}, got {kind!r}",
            )
        if "index" in entry and kind == "store":
            raise where.fail(f"{key}.index", "only a source read in place has an index")
        if "column" in entry and kind not in COLUMN_FORMATS:
            raise where.fail(f"{key}.column", "only a format: parquet source has a column")
        column = entry.get("column", DEFAULT_COLUMN) if kind in COLUMN_FORMATS else None
        if column is not None and not isinstance(column, str):
            raise where.fail(f"{key}.column", f"expected a column name, got {column!r}")
        remote = is_url(path)
        if remote and kind != "store":
            raise where.fail(f"{key}.path", f"a format: {kind} corpus is read from a local path")
        exclude = None
        if "exclude" in entry:
            exclude = parse_exclude(
                entry["exclude"], f"{key}.exclude", base_dir, where.fail, offered
            )
        if remote:  # a gs:// store, read directly (never made a local path)
            sources.append(SourceSpec(name, location(path), packing, too_long, exclude=exclude))
            continue
        example = " (e.g. ${PIPELINE_DATA_DIR}/NAME)"
        resolved = anchored(path, f"{key}.path", base_dir, where.fail, example, directories)
        if kind != "store" and exclude is not None:
            raise where.fail(f"{key}.exclude", "a corpus read in place records no document ids")
        if kind != "store":
            index = entry.get("index")
            if index is not None and not isinstance(index, str):
                raise where.fail(f"{key}.index", f"expected a directory, got {index!r}")
            if index is None and any(c in path for c in "*?["):
                raise where.fail(f"{key}.index", "a glob's index directory must be named")
            store = default_index_dir(resolved) if index is None else (base_dir or Path()) / index
            spec = SourceSpec(name, store.resolve(), packing, too_long, kind, resolved, column)
            sources.append(spec)
            continue
        sources.append(SourceSpec(name, resolved, packing, too_long, exclude=exclude))
    return tuple(sorted(sources, key=lambda s: s.name))


def _mix(raw: Any, where: Where, names: set[str], key: str) -> tuple:
    mix = where.mapping(raw, key)
    return tuple(
        (where.known(name, names, key), parse_schedule(value, f"{where.origin}: {key}.{name}"))
        for name, value in sorted(mix.items())
    )


def _stages(raw: dict, where: Where, names: set[str]) -> tuple[StageSpec, ...]:
    if ("mix" in raw) == ("stages" in raw):
        raise where.fail("mix", "give exactly one of 'mix' (one open-ended stage) or 'stages'")
    default = None
    if "objective" in raw:  # every stage's without its own
        default = parse_objective(raw["objective"], where.origin, "objective", names)
    if "mix" in raw:
        mix = _mix(raw["mix"], where, names, "mix")
        unit = parse_mix_unit(raw.get("mix_unit", "rows"), mix, where.origin, "mix_unit")
        return (StageSpec("main", None, mix, mix_key="mix", objective=default, mix_unit=unit),)
    entries = raw["stages"]
    if not isinstance(entries, list) or not entries:
        raise where.fail("stages", f"expected a non-empty list of stages, got {entries!r}")
    stages = []
    for index, entry in enumerate(entries):
        key = f"stages[{index}]"
        where.keys(where.mapping(entry, key), STAGE_KEYS, key)
        name = str(entry.get("name", f"stage{index}"))
        objective = default
        if "objective" in entry:
            objective = parse_objective(entry["objective"], where.origin, f"{key}.objective", names)
        if "epochs" in entry:
            if "mix" in entry or "steps" in entry:
                raise where.fail(key, "an epochized stage ('epochs') takes no 'mix' or 'steps'")
            epochs = tuple(
                (where.known(n, names, f"{key}.epochs"),
                 where.integer(r, f"{key}.epochs.{n}", minimum=1, maximum=MAX_EPOCHS))
                for n, r in sorted(where.mapping(entry["epochs"], f"{key}.epochs").items())
            )  # fmt: skip
            if "mix_unit" in entry:
                parse_mix_unit(entry["mix_unit"], None, where.origin, f"{key}.mix_unit")
            stages.append(StageSpec(name, None, None, epochs, objective=objective))
            continue
        if "mix" not in entry:
            raise where.fail(key, "a stage has 'mix' (with optional 'steps') or 'epochs'")
        steps = entry.get("steps")
        if steps is None and index != len(entries) - 1:
            raise where.fail(f"{key}.steps", "only the last stage may be open-ended")
        if steps is not None:
            where.integer(steps, f"{key}.steps", minimum=1)
        mix = _mix(entry["mix"], where, names, f"{key}.mix")
        _check_step_points_inside(mix, steps, where, f"{key}.mix")
        unit_key = f"{key}.mix_unit" if "mix_unit" in entry else "mix_unit"
        unit = entry.get("mix_unit", raw.get("mix_unit", "rows"))
        unit = parse_mix_unit(unit, mix, where.origin, unit_key)
        stages.append(StageSpec(name, steps, mix, mix_key=f"{key}.mix", objective=objective,
                                mix_unit=unit))  # fmt: skip
    if len({s.name for s in stages}) != len(stages):
        raise where.fail("stages", "stage names must be unique")
    return tuple(stages)


def _check_step_points_inside(mix: tuple, steps: int | None, where: Where, key: str) -> None:
    """A `step` point at or past its stage's end never takes effect: most likely a step counted
    from the run's start rather than the stage's, so it is refused rather than ignored. (A
    `linear` point past the end still sets the ramp's slope, as in configs/demo-switch.yaml.)"""
    if steps is None:
        return
    for name, schedule in mix:
        late = [point for point, _ in schedule.points if point >= steps]
        if schedule.kind == "step" and late:
            raise where.fail(
                f"{key}.{name}.step",
                f"point {late[0]} is not inside the stage's {counted(steps, 'step')} "
                f"(0..{steps - 1}), so it would never take effect; schedule steps count from the "
                "stage's first step",
            )


def last_step(batches: tuple[tuple[int, int], ...]) -> int:
    """The last step whose lane positions fit int64 under the batch schedule `batches` (the
    largest batch's)."""
    return MAX_POSITION // max(size for _, size in batches)


def _check_steps_fit(
    stages: tuple[StageSpec, ...], batches: tuple[tuple[int, int], ...], where: Where, prefix: str
) -> None:
    """Every step a config names (batch schedule points, stage ends, schedule points) times the
    largest batch fits int64 lane positions."""
    batch = max(size for _, size in batches)
    limit = last_step(batches)
    beyond = f"beyond the last step a batch of {counted(batch, 'row')} can address ({limit:,})"
    if batches[-1][0] > limit:
        raise where.fail("global_batch_size.step", f"step {batches[-1][0]} is {beyond}")
    start = 0
    for index, stage in enumerate(stages):
        for name, schedule in stage.mix or ():
            point = schedule.points[-1][0]
            if start + point > limit:
                raise where.fail(f"{prefix.format(index)}mix.{name}", f"step {point} is {beyond}")
        start += stage.steps or 0
        if start > limit:
            raise where.fail(f"stages[{index}].steps", f"the stages end at step {start}, {beyond}")


def _feed(raw: Any, where: Where) -> FeedOptions:
    if not isinstance(raw, dict):
        raise where.fail("feed", f"expected a mapping, got {raw!r}")
    where.keys(raw, FEED_KEYS, "feed")
    provenance = raw.get("provenance", [])
    if not isinstance(provenance, list) or any(p not in PROVENANCE for p in provenance):
        raise where.fail(
            "feed.provenance", f"expected a list of {', '.join(PROVENANCE)}, got {provenance!r}"
        )
    port = raw.get("metrics_port")  # absent: no endpoint; an empty `metrics_port:` is an error
    if "metrics_port" in raw and where.integer(port, "feed.metrics_port", minimum=1) > 65535:
        raise where.fail("feed.metrics_port", f"expected a TCP port 1..65535, got {port!r}")
    share = raw.get("input_bound_share", 0.1)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise where.fail("feed.input_bound_share", f"expected a number in [0, 1], got {share!r}")
    ready = raw.get("ready_timeout_s")  # absent: no barrier
    if "ready_timeout_s" in raw and (
        isinstance(ready, bool) or not isinstance(ready, (int, float)) or not ready > 0
    ):
        raise where.fail("feed.ready_timeout_s", f"expected seconds > 0, got {ready!r}")
    verify = raw.get("verify", "read")
    verify = "off" if verify is False else verify  # YAML 1.1 reads a bare `off` as false
    if verify not in VERIFY_POLICIES:
        raise where.fail(
            "feed.verify", f"expected one of {', '.join(VERIFY_POLICIES)}, got {verify!r}"
        )
    expand = raw.get("expand", "auto")
    if expand not in EXPAND_MODES:
        raise where.fail(
            "feed.expand", f"expected one of {', '.join(EXPAND_MODES)}, got {expand!r}"
        )
    return FeedOptions(
        verify=verify,
        expand=expand,
        prefetch=where.integer(
            raw.get("prefetch", 2), "feed.prefetch", minimum=1, maximum=MAX_THREADS
        ),
        threads=_threads(raw.get("threads", AUTO_THREADS), where),
        provenance=tuple(p for p in PROVENANCE if p in provenance),
        metrics_port=port,
        input_bound_share=float(share),
        stats_window=where.integer(raw.get("stats_window", 100), "feed.stats_window", minimum=1),
        ready_timeout_s=None if ready is None else float(ready),
        remote=remote_options(raw, where),
    )


def is_count(value: Any, maximum: int | None = None) -> bool:
    """Whether `value` is an integer >= 1 (True is not one) and at most `maximum` if given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return False
    return maximum is None or value <= maximum


def is_thread_count(value: Any, maximum: int | None = None) -> bool:
    """Whether `value` is a reader-thread count, of the config's `feed.threads` or of
    `DataFeed(threads=)`: `auto` (lower case only, like every other word of the config) or an
    integer >= 1 (at most `maximum` if given)."""
    return value == AUTO_THREADS or is_count(value, maximum)


def _threads(value: Any, where: Where) -> int | str:
    if not is_thread_count(value):
        raise where.fail("feed.threads", f"expected an integer >= 1 or auto, got {value!r}")
    if value == AUTO_THREADS:
        return AUTO_THREADS
    return where.integer(value, "feed.threads", minimum=1, maximum=MAX_THREADS)


def _eval(
    raw: Any, where: Where, base_dir: Path | None
) -> tuple[tuple[SourceSpec, ...], int | None]:
    if raw is None:
        return (), None
    where.keys(where.mapping(raw, "eval"), EVAL_KEYS, "eval")
    if "sources" not in raw:
        raise where.fail("eval", "missing 'sources' (name: {path: EVAL_STORE})")
    batches = raw.get("batches")
    if batches is not None:
        where.integer(batches, "eval.batches", minimum=1, maximum=MAX_POSITION)
    return _sources(raw["sources"], where, base_dir, parent="eval.sources"), batches
