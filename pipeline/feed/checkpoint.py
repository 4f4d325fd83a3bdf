"""The data state as an item of an Orbax `CheckpointManager`, next to the model state.

    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), data=DataSave(feed)))
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=DataRestore(feed)))

`DataSave(feed)` captures the data state (`pipeline.plan.data_state`: the next step, the
ledger and a digest, a few KB of JSON) when it is constructed, so an async save writes the
state of the moment `save` was called, whatever the feed does meanwhile. Only the primary
process writes the file; the state is identical on every host because it is a function of the
step and the ledger.

`DataRestore(feed, switch=False, skip_steps=0)` reads the state and hands it to
`restore.restore_state`: every process checks its digest, that all read the same state under
the same data config, re-derives each segment's start counters and the step (exactly, from
this checkpoint's step and the trainer's numbering: `saved_after_step`), then reconciles the
ledger with the feed's config (`resume.reconcile`: an undeclared change raises `LedgerError`
on every process; `switch=True` records a switch at the restored step, `skip_steps=N` a skip
of N steps there, or at step `skip_at`) and seeks the feed. The restored item is the feed's
new state: the JSON as read when the restore changed nothing (an older ledger version stays
as written), else the state the restore made.

Orbax is imported here and nowhere else in the package.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import options as options_lib

from pipeline.errors import FeedError, LedgerError
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.restore import current_state, restore_state
from pipeline.plan import data_state
from pipeline.plan.data_state import FILENAME, ITEM


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
        raw = data_state.loads(path.read_bytes(), str(path))
        state = data_state.DataState.from_json(raw, str(path))
        step = _checkpoint_step(directory)
        restored = restore_state(
            args.feed,
            state,
            switch=args.switch,
            switch_flag=args.switch_flag,
            checkpoint_step=step,
            saved_after_step=args.saved_after_step,
            skip_steps=args.skip_steps,
            skip_at=args.skip_at,
        )
        # unchanged (no switch, no skip): the state as read, checked, whose JSON is at hand
        # (10,000 set_mix calls take ms to encode again, beside the first batch's reads)
        return raw if restored == state else restored.to_json()


@ocp.args.register_with_handler(DataCheckpointHandler, for_save=True)
@dataclasses.dataclass
class DataSave(ocp.args.CheckpointArgs):
    """Save the feed's data state; the state is captured now, at construction."""

    feed: DataFeed
    state: dict[str, Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.feed.log_restore_events()  # the checkpoint records them
        self.state = current_state(self.feed).to_json()


@ocp.args.register_with_handler(DataCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class DataRestore(ocp.args.CheckpointArgs):
    """Restore the data state into `feed`; `switch=True` declares a data config change.

    `switch_flag` is what the refusal of an undeclared change tells the user to set: a trainer
    passes the name of its own flag (e.g. `--switch-data`). `saved_after_step` is the trainer's
    checkpoint numbering, against which the saved step is checked exactly: False when
    checkpoint N is saved before training step N (`mngr.save(feed.step, ...)`: it holds data
    step N), True when it is saved after training step N (`mngr.save(step, ...)` at the end of
    the loop body, as MaxText and Orbax's examples do: it holds data step N + 1).
    `skip_steps=N` passes over N steps of data: the restored step s serves what the plan had
    for step s + N, and so on (docs/steering.md); it may come with a switch. With `skip_at=S`
    (a training step) the skip is made at step S, once in the run: a restore before S
    schedules it, one from a checkpoint that holds it skips nothing more, so a restart loop
    may repeat the same arguments forever (`pipeline.plan.skips`).
    """

    feed: DataFeed
    switch: bool = False
    switch_flag: str = "DataRestore(..., switch=True)"
    saved_after_step: bool = False
    skip_steps: int = 0
    skip_at: int | None = None


def restore_or_start(
    mngr: ocp.CheckpointManager,
    feed: DataFeed,
    *,
    step: int | None = None,
    data_step: int | None = None,
    switch: bool = False,
    saved_after_step: bool = False,
) -> int:
    """Position `feed` for a (re)started run; returns the feed's next step.

    Restores the data item of checkpoint `step` (default: the latest), checked against the
    trainer's checkpoint numbering (`DataRestore.saved_after_step`). A checkpoint saved
    without a data item needs `data_step`, the first step whose batch has not been trained on;
    with no checkpoint at all the feed starts at `data_step` or 0.
    """
    step = mngr.latest_step() if step is None else step
    if step is None:
        feed.seek(0 if data_step is None else data_step)
        return feed.step
    directory = epath.Path(mngr.directory)
    has_data = any(
        (path / ITEM / FILENAME).exists()
        for path in directory.iterdir()
        if path.is_dir() and path.name.split("_")[-1] == str(step)
    )
    if has_data:
        flag = "restore_or_start(..., switch=True)"
        data = DataRestore(feed, switch=switch, switch_flag=flag, saved_after_step=saved_after_step)
        mngr.restore(step, args=ocp.args.Composite(data=data))
        return feed.step
    if data_step is None:
        raise LedgerError(
            f"{directory}: checkpoint {step} has no 'data' item; pass data_step= (the first "
            "step whose batch has not been trained on, usually the checkpoint's step + 1)"
        )
    feed.seek(data_step)
    return feed.step


def _checkpoint_step(item_directory: epath.Path) -> int | None:
    """The step of the checkpoint holding an item (`[PREFIX_]STEP/data`), if its name says."""
    name = item_directory.parent.name.split("_")[-1]
    return int(name) if name.isdigit() else None
