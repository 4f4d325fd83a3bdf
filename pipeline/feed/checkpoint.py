"""The data state as an item of an Orbax `CheckpointManager`, next to the model state.

    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), data=DataSave(feed)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=DataRestore(feed)))

`DataSave(feed)` captures `feed.state()` (the next step and the ledger, a few KB of JSON) when
it is constructed, so an async save writes the state of the moment `save` was called, whatever
the feed does meanwhile. Only the primary process writes the file; the state is identical on
every host because it is a function of the step and the ledger.

`DataRestore(feed, switch=False)` reads the state, checks that every process read the same
state and runs with the same data config (a digest compared across processes), reconciles the
checkpoint's ledger with the feed's config (`resume.reconcile`: an undeclared change raises
`LedgerError` on every process; `switch=True` records a switch at the restored step) and seeks
the feed. The restored item is the feed's new state.

Orbax is imported here and nowhere else in the package.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import options as options_lib

from pipeline.errors import FeedError, LedgerError
from pipeline.feed.data_feed import DataFeed
from pipeline.plan.ledger import Ledger
from pipeline.plan.plan import Plan
from pipeline.plan.resume import reconcile

log = logging.getLogger("pipeline")

FILENAME = "data_state.json"
STATE_VERSION = 1


class DataCheckpointHandler(ocp.handlers.JsonCheckpointHandler):
    """Writes the data state as JSON (primary process only); restores it into a feed."""

    def __init__(
        self,
        filename: str | None = None,
        *,
        multiprocessing_options: options_lib.MultiprocessingOptions | None = None,
    ) -> None:
        options = multiprocessing_options or options_lib.MultiprocessingOptions()
        super().__init__(filename or FILENAME, multiprocessing_options=options)

    async def async_save(self, directory: epath.Path, item: Any = None, args: Any = None):
        if not isinstance(args, DataSave):
            raise FeedError("save the data state with args=DataSave(feed)")
        return await super().async_save(directory, args=ocp.args.JsonSave(args.state))

    def save(self, directory: epath.Path, item: Any = None, args: Any = None) -> None:
        if not isinstance(args, DataSave):
            raise FeedError("save the data state with args=DataSave(feed)")
        super().save(directory, args=ocp.args.JsonSave(args.state))

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> dict:
        if not isinstance(args, DataRestore):
            raise FeedError("restore the data state with args=DataRestore(feed)")
        path = directory / self._filename
        if not path.exists():
            raise LedgerError(f"{path}: the checkpoint has no data state")
        state = super().restore(directory)
        return restore_state(
            args.feed, state, switch=args.switch, switch_flag=args.switch_flag, origin=str(path)
        )


@ocp.args.register_with_handler(DataCheckpointHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    """Save the feed's data state; the state is captured now, at construction."""

    feed: DataFeed
    state: dict[str, Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.state = {"version": STATE_VERSION, **self.feed.state()}


@ocp.args.register_with_handler(DataCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    """Restore the data state into `feed`; `switch=True` declares a data config change.

    `switch_flag` is what the refusal of an undeclared change tells the user to set: a trainer
    passes the name of its own flag (e.g. `--switch-data`).
    """

    feed: DataFeed
    switch: bool = False
    switch_flag: str = "DataRestore(..., switch=True)"


def restore_state(
    feed: DataFeed,
    state: Any,
    *,
    switch: bool = False,
    switch_flag: str = "restore_state(..., switch=True)",
    origin: str = "<data state>",
) -> dict[str, Any]:
    """Check `state` (as `DataSave` wrote it) on every process, reconcile it, seek `feed`."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise LedgerError(f"{origin}: not a version-{STATE_VERSION} data state")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise LedgerError(f"{origin}: 'step' must be an integer >= 0, got {step!r}")
    _check_processes_agree(state, feed, origin)
    ledger = Ledger.from_json(state.get("ledger"), origin=f"{origin}: ledger")
    plan = Plan(ledger, feed.plan.stores())
    reconciled = reconcile(plan, feed.config, step, switch=switch, switch_flag=switch_flag)
    feed.adopt(reconciled, step)
    feed.start_prefetch()  # read the first batch while Orbax restores the other items
    log.info(
        "restored the data state at step %d (%d ledger segment%s)",
        step,
        len(reconciled.segments),
        "" if len(reconciled.segments) == 1 else "s",
    )
    return {"version": STATE_VERSION, **feed.state()}


def restore_or_start(
    mngr: ocp.CheckpointManager,
    feed: DataFeed,
    *,
    step: int | None = None,
    data_step: int | None = None,
    switch: bool = False,
) -> int:
    """Position `feed` for a (re)started run; returns the feed's next step.

    Restores the data item of checkpoint `step` (default: the latest). A checkpoint saved
    without a data item needs `data_step`, the first step whose batch has not been trained on;
    with no checkpoint at all the feed starts at `data_step` or 0.
    """
    step = mngr.latest_step() if step is None else step
    if step is None:
        feed.seek(0 if data_step is None else data_step)
        return feed.step
    directory = epath.Path(mngr.directory)
    has_data = any(
        (path / "data" / FILENAME).exists()
        for path in directory.iterdir()
        if path.is_dir() and path.name.split("_")[-1] == str(step)
    )
    if has_data:
        flag = "restore_or_start(..., switch=True)"
        data = DataRestore(feed, switch=switch, switch_flag=flag)
        mngr.restore(step, args=ocp.args.Composite(data=data))
        return feed.step
    if data_step is None:
        raise LedgerError(
            f"{directory}: checkpoint {step} has no 'data' item; pass data_step= (the first "
            "step whose batch has not been trained on, usually the checkpoint's step + 1)"
        )
    feed.seek(data_step)
    return feed.step


def _digest(value: Any) -> bytes:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()


def _check_processes_agree(state: dict[str, Any], feed: DataFeed, origin: str) -> None:
    """Every process must restore the same state under the same data config."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    order = feed.plan.ledger.last.order  # the data order this process's config produced
    mine = np.frombuffer(_digest({"state": state, "config": order})[:16], dtype=np.uint32)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    differ = [i for i in range(everyone.shape[0]) if not np.array_equal(everyone[i], everyone[0])]
    if differ:
        raise LedgerError(
            f"{origin}: processes {differ} read a different data state or run a different data "
            "config than process 0; every host must restore the same checkpoint with the same "
            "config file"
        )
