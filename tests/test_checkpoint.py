"""The data state through a real Orbax CheckpointManager, next to a model state."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh

from pipeline.config import parse_config
from pipeline.errors import LedgerError
from pipeline.feed.checkpoint import FILENAME, DataRestore, DataSave, restore_or_start
from pipeline.feed.data_feed import DataFeed
from pipeline.plan import data_state
from pipeline.plan.ledger import Ledger
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.feedstores import two_stage_config, two_stage_raw


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:2]), ("data",))


def manager(directory: os.PathLike, *, async_save: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=async_save)
    return ocp.CheckpointManager(directory, options=options)


def switched_through_orbax(
    directory: os.PathLike,
    before,
    after,
    switch: int,
    expected: Plan,
    steps: int,
    check: Callable[[DataFeed], None] = lambda feed: None,
) -> list[np.ndarray]:
    """Save at step `switch` under config `before`, restore there under `after` with
    `DataRestore(feed, switch=True)`, check that the next `steps` batches are `expected`'s, save
    again after them (at `switch + steps`; `check(feed)` first); returns the inputs served.
    `assert_dump_replays`
    checks them against `pipeline dump --ledger` of that checkpoint."""
    with DataFeed(before, mesh()) as feed, manager(directory, async_save=False) as mngr:
        feed.seek(switch)
        mngr.save(switch, args=ocp.args.Composite(data=DataSave(feed)))
    served = []
    with DataFeed(after, mesh()) as feed, manager(directory, async_save=False) as mngr:
        mngr.restore(switch, args=ocp.args.Composite(data=DataRestore(feed, switch=True)))
        for step in range(switch, switch + steps):
            batch = next(feed)
            for field, values in expected.batch(step).items():
                np.testing.assert_array_equal(np.asarray(batch[field]), values, err_msg=field)
            served.append(np.asarray(batch["inputs"]))
        check(feed)
        mngr.save(switch + steps, args=ocp.args.Composite(data=DataSave(feed)))
    return served


def assert_dump_replays(config_file: os.PathLike, step_dir: str, first: int, served: list) -> None:
    """`pipeline dump --ledger step_dir` of steps first.. gives the inputs `served`."""
    from pipeline.commands.cli import main

    out = os.path.join(os.path.dirname(os.path.dirname(step_dir)), "dump.npz")  # beside ckpt/
    steps = f"{first}:{first + len(served)}"
    argv = ["dump", str(config_file), "--ledger", step_dir, "--steps", steps, "--out", out]
    assert main(argv) == 0
    np.testing.assert_array_equal(np.load(out)["inputs"], np.stack(served))


def assert_next_is(feed: DataFeed, plan: Plan, step: int) -> None:
    assert feed.step == step
    batch = next(feed)
    expected = plan.batch(step)
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(batch[field]), expected[field])


def save(mngr: ocp.CheckpointManager, step: int, feed: DataFeed) -> None:
    model = {"w": jnp.arange(4.0) * step}
    mngr.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(model), data=DataSave(feed))
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_restores_the_step_and_the_batches(tmp_path, async_save):
    config = two_stage_config(tmp_path / "stores")
    plan = Plan.from_config(config)
    with DataFeed(config, mesh()) as feed:
        for _ in range(6):
            next(feed)
        with manager(tmp_path / "ckpt", async_save=async_save) as mngr:
            save(mngr, 6, feed)
            for _ in range(5):  # the state was captured at save(): later steps do not leak in
                next(feed)
            mngr.wait_until_finished()
    saved = json.loads((tmp_path / "ckpt" / "6" / "data" / FILENAME).read_text())
    assert saved["step"] == 6
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
        restored = mngr.restore(
            6,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=DataRestore(feed)
            ),
        )
        np.testing.assert_array_equal(restored["state"]["w"], np.arange(4.0) * 6)
        assert restored["data"]["step"] == 6
        assert_next_is(feed, plan, 6)
        assert_next_is(feed, plan, 7)


def test_a_changed_config_is_refused_with_a_diff(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        next(feed)
        save(mngr, 1, feed)
    changed = two_stage_config(
        tmp_path / "stores", stages=[{"name": "main", "mix": {"code": 1, "docs": 2}}]
    )
    with DataFeed(changed, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        with pytest.raises(LedgerError, match="stages") as info:
            mngr.restore(1, args=ocp.args.Composite(data=DataRestore(feed)))
        assert "with DataRestore(..., switch=True) to switch at step 1" in str(info.value)
        assert feed.step == 0  # untouched
        assert len(feed.ledger.segments) == 1


def test_a_declared_switch_is_recorded_in_the_ledger(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    old = Plan.from_config(config)
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        for _ in range(4):
            next(feed)
        save(mngr, 4, feed)
    raw = two_stage_raw(tmp_path / "stores", stages=[{"name": "main", "mix": {"docs": 1}}])
    changed = parse_config(raw, origin="changed.yaml")
    with DataFeed(changed, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        restored = mngr.restore(4, args=ocp.args.Composite(data=DataRestore(feed, switch=True)))
        ledger = Ledger.from_json(restored["data"]["ledger"])
        assert [s.start_step for s in ledger.segments] == [0, 4]
        assert feed.ledger == ledger
        carried = old.segment_plan(0).counters_at(4)
        assert ledger.segments[1].counters == carried
        after = Plan(ledger)
        for step in (0, 3):  # the past is unchanged
            for field, value in after.batch(step).items():
                np.testing.assert_array_equal(value, old.batch(step)[field])
        assert_next_is(feed, after, 4)
        draws = after.draws(4)
        assert {draws.source_names[s] for s in draws.source} == {"docs"}
        save(mngr, 6, feed)
    # Any checkpoint step directory (or its data_state.json) is enough to reproduce the run.
    step_dir = tmp_path / "ckpt" / "6"
    assert data_state.load_ledger(step_dir) == ledger
    assert data_state.load_ledger(step_dir / "data" / "data_state.json") == ledger


def test_the_restore_and_its_switch_are_logged_once_the_whole_restore_succeeded(tmp_path, caplog):
    """Orbax restores the data item before the model state ('data' < 'state'): a model state
    that does not fit fails the restore after the switch was made, and the log must say
    neither that the run switched nor that it restored its data state; the restore that
    succeeds says both once, when the run asks for data."""
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        feed.seek(4)
        save(mngr, 4, feed)
    raw = two_stage_raw(tmp_path / "stores", stages=[{"name": "main", "mix": {"docs": 1}}])
    changed = parse_config(raw, origin="changed.yaml")

    def restore(shape: tuple[int, ...]) -> None:
        model = ocp.args.StandardRestore({"w": jax.ShapeDtypeStruct(shape, jnp.float32)})
        data = DataRestore(feed, switch=True)
        mngr.restore(4, args=ocp.args.Composite(state=model, data=data))

    def switches() -> list[str]:
        said = ("ledger switch", "restored the data state")
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(said)]

    caplog.set_level(logging.INFO, logger="pipeline")
    with DataFeed(changed, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        with pytest.raises(ValueError):  # the data item was read and reconciled first
            restore((5,))
        assert feed.ledger.segments[-1].start_step == 4
        assert switches() == []
        restore((4,))
        assert switches() == []  # the trainer has not taken the restored state yet
        next(feed), next(feed)
        switch, restored = switches()
        assert switch.startswith("ledger switch at step 4: stages changed; carried counters ")
        assert restored == "restored the data state at step 4 (2 ledger segments)"


def test_a_save_before_the_first_next_logs_the_switch_it_records(tmp_path, caplog):
    """A trainer that checkpoints right after its restore writes the switch into the ledger
    it saves: the log says so then, once, not again at the first `next()`."""
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        feed.seek(4)
        save(mngr, 4, feed)
    raw = two_stage_raw(tmp_path / "stores", stages=[{"name": "main", "mix": {"docs": 1}}])
    caplog.set_level(logging.INFO, logger="pipeline")

    def switches() -> list[str]:
        return [r.getMessage() for r in caplog.records if "ledger switch" in r.getMessage()]

    changed = parse_config(raw, origin="changed.yaml")
    with DataFeed(changed, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        mngr.restore(4, args=ocp.args.Composite(data=DataRestore(feed, switch=True)))
        assert switches() == []
        save(mngr, 5, feed)
        assert len(switches()) == 1
        assert len(data_state.load_ledger(tmp_path / "ckpt" / "5").segments) == 2
        next(feed)
        assert len(switches()) == 1


def test_a_checkpoint_without_data_needs_an_explicit_step(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    plan = Plan.from_config(config)
    with manager(tmp_path / "ckpt", async_save=False) as mngr:
        mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.ones(2)})))
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        with pytest.raises(LedgerError, match="has no 'data' item; pass data_step="):
            restore_or_start(mngr, feed)
        assert restore_or_start(mngr, feed, data_step=4) == 4
        assert_next_is(feed, plan, 4)


def test_restore_or_start(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    plan = Plan.from_config(config)
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=True) as mngr:
        assert restore_or_start(mngr, feed) == 0
        for step in range(12):
            next(feed)
            if step % 5 == 4:
                save(mngr, step, feed)
        mngr.wait_until_finished()
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        assert mngr.latest_step() == 9
        # checkpoint N was saved after training step N: it holds data step N + 1
        assert restore_or_start(mngr, feed, saved_after_step=True) == 10
        assert_next_is(feed, plan, 10)
        assert restore_or_start(mngr, feed, step=4, saved_after_step=True) == 5
        assert_next_is(feed, plan, 5)
        with pytest.raises(LedgerError, match=r"which holds step 4 \(saved before training step 4"):
            restore_or_start(mngr, feed, step=4)  # the other numbering: refused, not off by one


def test_a_malformed_state_is_refused(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        save(mngr, 0, feed)
        path = tmp_path / "ckpt" / "0" / "data" / FILENAME
        state = json.loads(path.read_text())
        state["ledger"]["segments"][0]["config"]["seed"] = 8  # edited by hand, digest redone
        del state["digest"]
        path.write_text(json.dumps({**state, "digest": data_state.digest_of(state)}))
        with pytest.raises(LedgerError, match="fingerprint does not match"):
            mngr.restore(0, args=ocp.args.Composite(data=DataRestore(feed)))


def test_a_state_of_another_format_is_refused(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        save(mngr, 0, feed)
        path = tmp_path / "ckpt" / "0" / "data" / FILENAME
        path.write_text(json.dumps({"version": 1, "step": 3}))
        with pytest.raises(LedgerError, match=r"not a version-2 data state \(found version 1"):
            mngr.restore(0, args=ocp.args.Composite(data=DataRestore(feed)))


def test_a_state_written_under_the_old_data_order_is_refused(tmp_path):
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        save(mngr, 0, feed)
        path = tmp_path / "ckpt" / "0" / "data" / FILENAME
        state = json.loads(path.read_text())
        del state["ledger"]["order_version"]
        state["ledger"]["version"] = 1  # as pipeline 0.1 wrote it, under order version 1
        old = {"version": 1, "step": state["step"], "ledger": state["ledger"]}  # and no digest
        path.write_text(json.dumps(old))
        with pytest.raises(LedgerError, match=r"order version 1, .* fresh ledger") as error:
            mngr.restore(0, args=ocp.args.Composite(data=DataRestore(feed)))
        assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_restore_starts_reading_the_first_batch_before_next(tmp_path):
    """`DataRestore` submits the restored step to the reader threads as it adopts the state,
    so the first batch is read while Orbax finishes and before the trainer's first `next()`."""
    config = two_stage_config(tmp_path / "stores")
    with (
        DataFeed(config, mesh(), step=9) as feed,
        manager(tmp_path / "ckpt", async_save=False) as mngr,
    ):
        save(mngr, 9, feed)
    plan = Plan.from_config(config)
    with (
        DataFeed(config, mesh(), prefetch=2) as feed,
        manager(tmp_path / "ckpt", async_save=False) as mngr,
    ):
        assert feed.prefetched == ()  # a fresh feed reads nothing before its step is known
        mngr.restore(9, args=ocp.args.Composite(data=DataRestore(feed)))
        assert [step for step, _ in feed.prefetched] == [9, 10]
        while not feed.prefetched[0][1]:  # read by the reader threads alone: no next() yet
            time.sleep(0.01)
        assert_next_is(feed, plan, 9)


def test_a_restore_that_changes_nothing_returns_the_state_it_read_which_the_feed_now_has(tmp_path):
    """The restored item is the feed's state: with nothing declared, the JSON as read (not
    encoded again), which equals what the feed would save now, set_mix table included."""
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        for step in range(4):
            feed.set_mix({"code": 1 + step, "docs": 1}, step=feed.step)
            next(feed)
        save(mngr, 4, feed)
    with DataFeed(config, mesh()) as feed, manager(tmp_path / "ckpt", async_save=False) as mngr:
        restored = mngr.restore(4, args=ocp.args.Composite(data=DataRestore(feed)))
        assert len(feed.ledger.mixes) == 4
        assert restored["data"] == DataSave(feed).state
        assert data_state.DataState.from_json(restored["data"], "restored").ledger == feed.ledger
