"""MaxText's data iterators, served by this pipeline: a drop-in `create_data_iterator`.

    # MaxText input_pipeline_interface.create_data_iterator, first lines (added by
    # `pipeline maxtext install`, docs/maxtext.md):
    from pipeline import maxtext as pipeline_maxtext
    if pipeline_maxtext.is_enabled(config):
        return pipeline_maxtext.create_data_iterator(config, mesh)

`create_data_iterator(config, mesh)` takes MaxText's config object (`pyconfig`'s
HyperParameters, or anything with the same attribute names) and MaxText's mesh and returns
`(train_iterator, eval_iterator_or_None)`, like MaxText's own:

* `next(train_iterator)` is a dict of the six MaxText fields, each a global int32 `jax.Array`
  of shape [global_batch_size_to_load, max_target_length], sharded
  `NamedSharding(mesh, P(batch_axes, None))` where `batch_axes` are the axes of
  `config.data_sharding` (e.g. `[['data', 'stage', 'fsdp', ...]]`) that the mesh has: the same
  sharding MaxText's own iterators produce.
* `train_iterator.local_iterator` is what MaxText's `iter` checkpoint item saves and restores.
  Its `get_state()` is the pipeline's data state (`pipeline.plan.data_state`: the next step,
  the ledger and a digest), the same on every process, so MaxText may store it once (its
  shared-state path for Grain's `ElasticIterator`, which this class registers with) or once per
  process; `set_state(state)` runs `pipeline.feed.restore.restore_state` (check, reconcile,
  seek).
* The eval iterator serves an EvalFeed: the same batches after every `reset()`.

Our keys (`pipeline.maxtext.keys`) are read from MaxText's config, else from their
environment variables. The checks made before any step runs are listed in docs/maxtext.md.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from pipeline.config import DataConfig, load_config
from pipeline.errors import ConfigError, LedgerError, PipelineError
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.eval_feed import EvalFeed
from pipeline.feed.host_stop import end_process_after
from pipeline.feed.restore import current_state, restore_state
from pipeline.maxtext.keys import (
    DATA_CONFIG,
    DATA_SKIP,
    DATA_SKIP_AT,
    DATA_SWITCH,
    EVAL_SOURCE,
    MaxTextKey,
    parse_bool,
    parse_count,
)
from pipeline.plan import data_state
from pipeline.store.meta import StoreMeta
from pipeline.urls import location

__all__ = [
    "DataStop",
    "EvalIterator",
    "LocalIterator",
    "TrainIterator",
    "create_data_iterator",
    "is_enabled",
    "read_iter_state",
]
"""The MaxText iterator's public names (its API reference page, docs/api.md, lists each)."""

CONFIG_KEY = DATA_CONFIG.name
CONFIG_ENV = DATA_CONFIG.env
EVAL_SOURCE_KEY = EVAL_SOURCE.name
SWITCH_FLAG = f"{DATA_SWITCH.name}=true (or {DATA_SWITCH.env}=true)"
"""How a MaxText user declares a data switch: what the refusal of an undeclared one names."""

_MISSING = object()

log = logging.getLogger("pipeline")


class DataStop(SystemExit):
    """A data error in `next()`, ending the process with its line and exit status 2.

    MaxText's loop wraps `next(data_iterator)` in `except Exception` (its
    `loader_exception_guard`) and turns whatever it catches into "Training stopped: ..." with
    exit status 0, as after a run's last step: a job scheduler would count a replaced shard or a
    failed read as a finished run. A `SystemExit` passes through that handler; MaxText's
    `finally` blocks still run (metrics flushed) and JAX's exit barrier still waits for the
    other hosts, which stop on the same line (`pipeline.feed.host_stop`). A process that has not
    ended `host_stop.GRACE_S` later (an Orbax checkpoint save waiting for a stopped peer keeps
    the interpreter alive) is ended with the line by `host_stop.end_process_after`.
    """

    def __init__(self, error: PipelineError) -> None:
        super().__init__(error.exit_code)
        self.line = str(error)

    def __str__(self) -> str:
        return self.line


def _next_or_stop(local: LocalIterator) -> dict[str, jax.Array]:
    try:
        if local.skip_steps and not local.restored:
            if local.skip_at is None:
                raise ConfigError(
                    f"{DATA_SKIP.name}={local.skip_steps}: no checkpoint was restored, so there "
                    "is no step to skip from; give it only to a run that resumes from a "
                    f"checkpoint, or name the step with {DATA_SKIP_AT.name}"
                )
            local.set_state(local.get_state())  # no checkpoint yet: the skip is scheduled
        return next(local.feed)
    except PipelineError as error:
        line = f"error: {error}"
        log.error("%s", line)
        end_process_after(line)
        raise DataStop(error) from error


def _get(config: Any, key: str, default: Any = _MISSING) -> Any:
    """`config.key`; MaxText's HyperParameters raise ValueError (not AttributeError) if absent."""
    try:
        return getattr(config, key)
    except (AttributeError, ValueError, KeyError):
        if default is _MISSING:
            raise ConfigError(f"MaxText config: missing key '{key}'") from None
        return default


def _plain(value: Any) -> Any:
    """A config value as the user wrote it: an enum member (pydantic's `DatasetType.GRAIN`)
    becomes its value (`grain`), so comparisons and messages use the spelling of the key."""
    return value.value if isinstance(value, enum.Enum) else value


def setting(config: Any, key: MaxTextKey) -> str | bool | int:
    """A key of ours from MaxText's config, else from its environment variable.

    A key MaxText does not declare (no `pipeline maxtext install`) reads as unset, so the
    variable alone works; for the switch, either one set to true declares it.
    """
    value = _plain(_get(config, key.name, None))
    if key.type is bool:
        if isinstance(value, str):
            value = parse_bool(value, f"MaxText config: {key.name}")
        return bool(value) or bool(key.parse_env())
    if key.type is int:  # MaxText's value when it declares the key and sets it, else the variable
        if value in (None, "", 0):
            return key.parse_env()
        return parse_count(value, f"MaxText config: {key.name}")
    return str(value) if value else key.parse_env()


# -- the checkpointed state ------------------------------------------------------------------


class StateDict(dict):
    """The data state as a dict; `decode()` gives its JSON text.

    MaxText's and Grain's checkpoint handlers write `json.dumps(get_state())` for a Grain
    `DatasetIterator` and `get_state().decode()` for any other iterator (whose state is bytes),
    so this one value serves both paths; `set_state` takes the dict, JSON text or bytes back.
    """

    def decode(self, encoding: str = "utf-8") -> str:
        del encoding
        return json.dumps(self, indent=1, sort_keys=True)


class LocalIterator:
    """`train_iterator.local_iterator`: the handle MaxText's `iter` checkpoint item saves."""

    def __init__(
        self,
        feed: DataFeed,
        *,
        switch: bool = False,
        skip_steps: int = 0,
        skip_at: int | None = None,
    ) -> None:
        self.feed = feed
        self.switch = switch
        self.skip_steps = skip_steps  # `pipeline_data_skip`: passed over at the restore
        self.skip_at = skip_at  # `pipeline_data_skip_at`: ... at that step, once in the run
        self.restored = False  # a skip without a restore would silently skip nothing

    def get_state(self) -> StateDict:
        """The next step, the ledger and a digest: identical on every process, a few KB."""
        self.feed.log_restore_events()  # the checkpoint records them
        return StateDict(current_state(self.feed).to_json())

    def set_state(self, state: dict[str, Any] | str | bytes) -> None:
        """Check the state on every process, reconcile its ledger with the config, seek."""
        origin = "MaxText 'iter' checkpoint item"
        if isinstance(state, (str, bytes, bytearray)):
            parsed = data_state.parse(state, origin)
        else:
            parsed = data_state.DataState.from_json(dict(state), origin)
        restore_state(
            self.feed,
            parsed,
            switch=self.switch,
            switch_flag=SWITCH_FLAG,
            skip_steps=self.skip_steps,
            skip_at=self.skip_at,
        )
        self.restored = True

    def start_prefetch(self) -> None:
        """Called by Grain's handler after `set_state`; `set_state` has already started it."""
        self.feed.start_prefetch()

    def __iter__(self) -> LocalIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return _next_or_stop(self)


def _restore_on_any_process_count() -> None:
    """Make MaxText checkpoint `local_iterator` as one state shared by every host.

    MaxText (since mid-2026) saves and restores a Grain `ElasticIterator` as a single
    `process_0.json`, written by process 0 and read by every process whatever their number now,
    because its state is global. Ours is too (the step and the ledger), so `LocalIterator` is
    registered as a virtual subclass (`abc` registration: no Grain code is inherited), and
    MaxText's own `isinstance` dispatch takes that path: a restore with a different host count
    needs no change to MaxText. Older MaxText versions never ask, and write one file per
    process, which `read_iter_state` reads too.
    """
    try:
        from grain.experimental import ElasticIterator
    except ImportError:  # a Grain without it: MaxText of that age has no elastic path either
        return
    ElasticIterator.register(LocalIterator)


_restore_on_any_process_count()


class TrainIterator:
    """`next()` gives step `feed.step`'s global batch; `local_iterator` carries the state."""

    def __init__(
        self,
        feed: DataFeed,
        *,
        switch: bool = False,
        skip_steps: int = 0,
        skip_at: int | None = None,
    ) -> None:
        self.feed = feed
        self.local_iterator = LocalIterator(
            feed, switch=switch, skip_steps=skip_steps, skip_at=skip_at
        )

    @property
    def step(self) -> int:
        """The step whose batch `next()` gives (the feed's)."""
        return self.feed.step

    def set_mix(
        self,
        weights: Mapping[str, float] | None,
        step: int,
        *,
        objective: Mapping[str, float] | None = None,
    ) -> None:
        """`DataFeed.set_mix`: the stage's weights (and/or objective) from `step` on, recorded
        in the state MaxText checkpoints (docs/maxtext.md, "Setting the mixture from the
        training loop")."""
        self.feed.set_mix(weights, step, objective=objective)

    def restore_from(self, directory: str | os.PathLike) -> None:
        """Restore from an `iter` item directory saved with any number of processes; its
        parent's name is the checkpoint step N, and MaxText saves checkpoint N after training
        step N, so the saved step must be N + 1 exactly."""
        step = location(directory).parent.name
        checkpoint_step = int(step) if step.isdigit() else None
        state = read_iter_state(directory)
        restore_state(
            self.feed,
            state,
            switch=self.local_iterator.switch,
            switch_flag=SWITCH_FLAG,
            checkpoint_step=checkpoint_step,
            saved_after_step=True,
            skip_steps=self.local_iterator.skip_steps,
            skip_at=self.local_iterator.skip_at,
        )
        self.local_iterator.restored = True

    def close(self) -> None:
        """Stop the feed's reader threads and close its stores."""
        self.feed.close()

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        return _next_or_stop(self.local_iterator)


class EvalIterator:
    """The first `batches` eval batches, from the first one again after `reset()`.

    Iterating (`for batch in it`) also starts from the first batch, and so does `next()` after
    the last batch has been served and `reset()` called: an eval never depends on the last one.
    """

    def __init__(self, feed: EvalFeed) -> None:
        self.feed = feed
        self._batches: Iterator[dict[str, jax.Array]] | None = None

    @property
    def name(self) -> str:
        """The eval source's name (`pipeline_eval_source`)."""
        return self.feed.name

    @property
    def batches(self) -> int:
        """How many batches one eval serves."""
        return self.feed.batches

    def reset(self) -> None:
        """Serve the first batch again next."""
        self._batches = None

    def close(self) -> None:
        """Stop the eval feed's reader threads and close its stores."""
        self.feed.close()

    def __iter__(self) -> EvalIterator:
        self.reset()
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._batches is None:
            self._batches = iter(self.feed)  # EvalFeed's iterator seeks to its first batch
        return next(self._batches)


def read_iter_state(directory: str | os.PathLike) -> data_state.DataState:
    """The data state in a MaxText `iter` item directory, from any process's file
    (`data_state.maxtext_iter_file`)."""
    path = location(directory)  # a local directory or a gs:// checkpoint
    file = data_state.maxtext_iter_file(path)
    if file is None:
        raise LedgerError(
            f"{path}: no process_0.json or process_<i>-of-<n>.json file (not a MaxText 'iter' item)"
        )
    return data_state.load(file)


# -- building the iterators -------------------------------------------------------------------


def create_data_iterator(config: Any, mesh: Mesh) -> tuple[TrainIterator, EvalIterator | None]:
    """MaxText's `create_data_iterator(config, mesh)`, served by the data config it names."""
    data = load_data_config(config)
    axes = batch_axes(config, mesh)
    batch = global_batch_size(config, mesh)
    check_data_config(config, data, batch)
    _check_all_rows_trained(config, mesh, batch)
    switch = bool(setting(config, DATA_SWITCH))
    skip = int(setting(config, DATA_SKIP))
    skip_at = int(setting(config, DATA_SKIP_AT)) or None  # 0: at the restored step
    if skip_at is not None and not skip:
        raise ConfigError(
            f"{DATA_SKIP_AT.name}={skip_at}: without {DATA_SKIP.name}=N there is nothing to skip"
        )
    feed = DataFeed(data, mesh, axes)
    train = TrainIterator(feed, switch=switch, skip_steps=skip, skip_at=skip_at)
    evaluation = None
    try:
        evaluation = _eval_iterator(config, data, mesh, axes, batch)
        feeds = [train.feed] + ([evaluation.feed] if evaluation else [])
        check_vocab_size(config, [meta for feed in feeds for meta in feed.plan.store_set.metas()])
        return train, evaluation
    except BaseException:
        close_all(train, evaluation)
        raise


def close_all(*iterators: TrainIterator | EvalIterator | None) -> None:
    for iterator in iterators:
        if iterator is not None:
            iterator.close()


def is_enabled(config: Any) -> bool:
    """Whether the MaxText config (or the environment) names a pipeline data config."""
    return bool(setting(config, DATA_CONFIG))


def data_config_path(config: Any) -> str:
    path = setting(config, DATA_CONFIG)
    if not path:
        raise ConfigError(
            f"MaxText config: '{CONFIG_KEY}' is not set; give the path of the pipeline's data "
            f"config YAML ({CONFIG_KEY}=data.yaml, or the {CONFIG_ENV} environment variable)"
        )
    return str(path)


def load_data_config(config: Any) -> DataConfig:
    return load_config(data_config_path(config))


def batch_axes(config: Any, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes of MaxText's `data_sharding` (e.g. `[['data', 'stage', 'fsdp', ...]]`).

    MaxText shards the batch dimension over `P(*data_sharding)`; its one entry names one axis or
    a list of axes. Axes the mesh lacks are dropped; the rest keep their order, size-1 axes
    included, so the sharding equals the one MaxText's own iterators produce.
    """
    raw = _get(config, "data_sharding", (("data",),))
    entries = [raw] if isinstance(raw, str) else list(raw)
    if len(entries) != 1:
        raise ConfigError(
            f"MaxText config: data_sharding {raw!r} shards {len(entries)} dimensions; the input "
            "pipeline shards only the batch dimension: give one entry, e.g. [['data', 'fsdp']]"
        )
    entry = entries[0]
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    axes = tuple(name for name in names if name in mesh.axis_names)
    if not axes:
        raise ConfigError(
            f"MaxText config: data_sharding {raw!r} names none of the mesh axes "
            f"{tuple(mesh.axis_names)}"
        )
    return axes


def global_batch_size(config: Any, mesh: Mesh) -> int:
    """MaxText's `global_batch_size_to_load`: rows per step that the input pipeline serves.

    Taken from the config when it has it (pyconfig computes it); otherwise computed the way
    pyconfig does: devices x per_device_batch_size (as if 1 when below 1) x
    expansion_factor_real_data (when > 0) x gradient_accumulation_steps.
    """
    loaded = _get(config, "global_batch_size_to_load", None)
    if loaded is not None:
        return int(loaded)
    devices = mesh.devices.size
    per_device = float(_get(config, "per_device_batch_size"))
    expansion = float(_get(config, "expansion_factor_real_data", -1))
    accum = int(_get(config, "gradient_accumulation_steps", 1))
    factor = expansion if expansion > 0 else 1
    rows = devices * factor if per_device < 1 else int(devices * per_device * factor)
    return int(rows * accum)


def _batch_trained_on(config: Any, mesh: Mesh) -> int:
    trained = _get(config, "global_batch_size_to_train_on", None)
    if trained is not None:
        return int(trained)
    per_device = float(_get(config, "per_device_batch_size"))
    accum = int(_get(config, "gradient_accumulation_steps", 1))
    return int(mesh.devices.size * per_device) * accum


def check_data_config(config: Any, data: DataConfig, batch: int) -> None:
    """The data config must produce exactly the batches MaxText trains on."""
    where = data.origin
    seq = int(_get(config, "max_target_length"))
    if data.seq_len != seq:
        raise ConfigError(
            f"{where}: seq_len {data.seq_len} != MaxText max_target_length {seq}; set "
            f"seq_len: {seq} in the data config or max_target_length={data.seq_len} in MaxText"
        )
    if data.batch_is_scheduled:
        raise ConfigError(
            f"{where}: global_batch_size is a schedule; the MaxText adapter serves MaxText's one "
            f"global_batch_size_to_load ({batch}) and does not follow MaxText's own "
            "enable_rampup_batch_size, so give a constant global_batch_size (docs/maxtext.md)"
        )
    if data.global_batch_size != batch:
        raise ConfigError(
            f"{where}: global_batch_size {data.global_batch_size} != MaxText's global batch "
            f"{batch} (global_batch_size_to_load = devices x per_device_batch_size x "
            "gradient_accumulation_steps); set global_batch_size: "
            f"{batch} in the data config, or change per_device_batch_size in MaxText"
        )
    if data.grad_accum != 1:
        raise ConfigError(
            f"{where}: grad_accum {data.grad_accum}: with MaxText set grad_accum: 1 and "
            f"gradient_accumulation_steps={data.grad_accum} in MaxText, which splits each "
            "[global_batch, seq_len] batch into micro-batches itself"
        )
    dataset_type = _plain(_get(config, "dataset_type", "grain"))
    if dataset_type != "grain":
        raise ConfigError(
            f"MaxText config: dataset_type {dataset_type}: set dataset_type=grain with "
            f"{CONFIG_KEY}; MaxText saves the data iterator's state (its 'iter' checkpoint "
            "item) only for grain, and without it a resumed run would restart the data"
        )


def check_vocab_size(config: Any, stores: list[StoreMeta]) -> None:
    """MaxText's `vocab_size` must hold every token id of every store it is fed (`stores`: their
    metadata, as a feed plans from it before it opens them).

    An embedding lookup of an id past the table does not fail under JAX (it clamps or returns
    garbage), so a small `vocab_size` would train silently on wrong tokens.
    """
    vocab = int(_get(config, "vocab_size", 0)) or None
    if vocab is None:
        return
    for store in sorted(stores, key=lambda store: -store.vocab_size):
        if store.vocab_size > vocab:
            raise ConfigError(
                f"MaxText config: vocab_size {vocab} is smaller than the vocabulary of the "
                f"store {store.path} ({store.vocab_size} ids); set vocab_size={store.vocab_size} "
                "or more"
            )


def _check_all_rows_trained(config: Any, mesh: Mesh, batch: int) -> None:
    trained = _batch_trained_on(config, mesh)
    if trained != batch:
        raise ConfigError(
            f"MaxText config: the pipeline would load {batch} rows per step but MaxText "
            f"trains on {trained} (per_device_batch_size "
            f"{_get(config, 'per_device_batch_size')}, expansion_factor_real_data "
            f"{_get(config, 'expansion_factor_real_data', -1)}) and drops the rest, which the "
            "data plan counts as used; use per_device_batch_size >= 1 and "
            "expansion_factor_real_data=-1 (every host reads only its own rows anyway)"
        )


def _eval_iterator(
    config: Any, data: DataConfig, mesh: Mesh, axes: tuple[str, ...], train_batch: int
) -> EvalIterator | None:
    if int(_get(config, "eval_interval", -1)) <= 0:
        return None
    if not data.eval_sources:
        raise ConfigError(
            f"{data.origin}: MaxText eval_interval {_get(config, 'eval_interval')} > 0 but the "
            "data config has no 'eval:' section; add one (eval: {sources: {NAME: {path: "
            "EVAL_STORE}}}) or set eval_interval=-1"
        )
    wanted = setting(config, EVAL_SOURCE) or data.eval_sources[0].name
    names = [source.name for source in data.eval_sources]
    if wanted not in names:
        raise ConfigError(
            f"MaxText config: {EVAL_SOURCE_KEY} {wanted!r} ({EVAL_SOURCE.env}) is not an eval "
            f"source of {data.origin} (eval sources: {', '.join(names)})"
        )
    source = data.eval_sources[names.index(wanted)]
    batch = eval_batch_size(config, mesh, train_batch)
    eval_data = dataclasses.replace(data, batch_sizes=((0, batch),))
    return EvalIterator(EvalFeed(eval_data, source, mesh, axes))


def eval_batch_size(config: Any, mesh: Mesh, train_batch: int) -> int:
    """MaxText's eval batch: `global_batch_size_to_load_eval`, else from
    `eval_per_device_batch_size` when > 0, else the training batch."""
    loaded = _get(config, "global_batch_size_to_load_eval", None)
    if loaded is not None:
        return int(loaded)
    per_device = float(_get(config, "eval_per_device_batch_size", 0))
    if per_device > 0:
        return max(1, int(per_device * mesh.devices.size))
    return train_batch
