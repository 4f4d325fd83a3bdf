"""Restoring a data state into a feed: check it everywhere, reconcile it, seek (no Orbax here).

Shared by the Orbax item (`pipeline.feed.checkpoint`) and the MaxText adapter
(`pipeline.maxtext.adapter`), which differ only in where the state's JSON lives.
"""

from __future__ import annotations

import hashlib
import json

import jax
import numpy as np

from pipeline.errors import LedgerError
from pipeline.feed.data_feed import DataFeed
from pipeline.plan import data_state
from pipeline.plan.data_state import DataState
from pipeline.plan.resume import reconcile
from pipeline.plan.skips import Skip
from pipeline.read.plan import Plan


def current_state(feed: DataFeed) -> DataState:
    """The feed's data state now: the next step and the ledger."""
    return DataState(feed.step, feed.ledger)


def restore_state(
    feed: DataFeed,
    state: DataState,
    *,
    switch: bool = False,
    switch_flag: str = "restore_state(..., switch=True)",
    checkpoint_step: int | None = None,
    saved_after_step: bool = False,
    skip_steps: int = 0,
    skip_at: int | None = None,
) -> DataState:
    """Check `state` on every process, re-derive what it implies, reconcile it, seek `feed`.

    `checkpoint_step` (when the caller knows it) is the step of the checkpoint the state was
    saved in; the state's step must be exactly it, or the next one when the trainer saves
    checkpoint N after training step N (`saved_after_step`; `data_state.verify`).
    `switch_flag` is what the refusal of an undeclared config change tells the user to set
    (`reconcile`). `skip_steps=N`: the restored step serves the plan's step N later, and so
    on (a ledger segment that skips: docs/steering.md); with `skip_at=S`, from step S on, once
    in the run however often the restore is repeated (`pipeline.plan.skips`).
    """
    skip = Skip.of(skip_steps, skip_at)  # a bad value is one line before anything is compared
    _check_processes_agree(state, feed, switch, skip)
    plan = Plan(state.ledger, feed.plan.store_set, exclude_files=feed.plan.exclude_files)
    data_state.verify(state, plan, checkpoint_step, saved_after_step=saved_after_step)
    # the switch or skip, then the state restored: logged once the whole restore succeeded (at
    # the first next() or a save, `DataFeed.log_restore_events`), not while Orbax (or Grain's
    # handler in MaxText) may still fail to restore the checkpoint's other items
    events: list[str] = []
    reconciled = reconcile(
        plan,
        feed.config,
        state.step,
        switch=switch,
        switch_flag=switch_flag,
        skip=skip.steps,
        skip_at=skip.at,
        events=events,
    )
    segments = len(reconciled.segments)
    events.append(
        f"restored the data state at step {state.step} "
        f"({segments} ledger segment{'' if segments == 1 else 's'})"
    )
    feed.adopt(reconciled, state.step, events)
    feed.start_prefetch()  # read the first batch while Orbax restores the other items
    return current_state(feed)


def _check_processes_agree(state: DataState, feed: DataFeed, switch: bool, skip: Skip) -> None:
    """Every process must restore the same state under the same data config, and declare the
    same switch and skip: one that skips otherwise serves its rows of another plan step."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    order = feed.plan.ledger.last.order  # the data order this process's config produced
    mine = {
        "state": state.to_json(), "config": order, "switch": switch,
        "skip": [skip.steps, skip.at],
    }  # fmt: skip
    both = json.dumps(mine, sort_keys=True).encode()
    mine = np.frombuffer(hashlib.sha256(both).digest()[:16], dtype=np.uint32)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    differ = [i for i in range(everyone.shape[0]) if not np.array_equal(everyone[i], everyone[0])]
    if differ:
        raise LedgerError(
            f"{state.origin}: processes {differ} read a different data state, run a different "
            "data config, or declare a different switch or skip than process 0; every host must "
            "restore the same checkpoint with the same config file and the same flags"
        )
