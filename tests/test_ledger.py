"""The ledger and config switching: refusals, declared switches, carried counters."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.errors import LedgerError, StoreError
from pipeline.plan import data_state
from pipeline.plan.ledger import Ledger
from pipeline.plan.resume import reconcile
from pipeline.read.plan import Plan
from pipeline.store.token_store import TokenStore
from tests.storegen import write_synthetic_store


@pytest.fixture
def stores(tmp_path):
    write_synthetic_store(tmp_path / "main", [[40, 13, 22, 8], [31, 9, 27]])
    write_synthetic_store(tmp_path / "task", [[17, 5], [12, 12]])
    write_synthetic_store(tmp_path / "extra", [[60, 20]])
    return tmp_path


def config(stores, **overrides):
    raw = {
        "seed": 11, "seq_len": 4, "global_batch_size": 4, "lanes": 2,
        "sources": {n: {"path": str(stores / n)} for n in ("main", "task")},
        "mix": {"main": 3, "task": 1},
    }  # fmt: skip
    raw.update(overrides)
    return parse_config(raw, origin="run.yaml")


def test_unchanged_data_order_keeps_the_ledger_even_if_paths_and_feed_change(stores):
    plan = Plan.from_config(config(stores))
    shutil.copytree(stores / "main", stores / "moved")
    moved_sources = {
        "main": {"path": str(stores / "moved")},
        "task": {"path": str(stores / "task")},
    }
    moved = config(stores, sources=moved_sources, feed={"prefetch": 7, "threads": 1}, grad_accum=2)
    assert reconcile(plan, moved, step=10) is plan.ledger


def test_an_undeclared_change_is_refused_with_a_readable_diff(stores):
    plan = Plan.from_config(config(stores))
    with pytest.raises(LedgerError) as error:
        reconcile(plan, config(stores, global_batch_size=8), step=10)
    message = str(error.value)
    assert message.startswith("run.yaml: the data config differs")
    assert "declare the switch with reconcile(..., switch=True)" in message
    assert "--switch-data" not in message  # a library call has no trainer flag
    assert "global_batch_size: 4 -> 8" in message


def test_a_refused_added_or_replaced_source_is_named_by_its_store_path(stores):
    plan = Plan.from_config(config(stores))
    sources = {n: {"path": str(stores / n)} for n in ("main", "task", "extra")}
    sources["task"] = {"path": str(stores / "extra")}
    with pytest.raises(LedgerError) as error:
        reconcile(plan, config(stores, sources=sources), step=10)
    lines = str(error.value).splitlines()
    extra = TokenStore(stores / "extra").fingerprint
    task = TokenStore(stores / "task").fingerprint
    assert f"  sources.extra: <absent> -> {stores / 'extra'} (store {extra})" in lines
    assert (
        f"  sources.task: {stores / 'task'} (store {task}) -> {stores / 'extra'} (store {extra})"
        in lines
    )


def test_the_seed_cannot_change_even_as_a_switch(stores):
    """seq_len and lanes may (tests/test_geometry.py); the seed is the run's."""
    plan = Plan.from_config(config(stores))
    with pytest.raises(LedgerError, match="seed cannot change"):
        reconcile(plan, config(stores, seed=12), step=10, switch=True)


def test_a_declared_switch_carries_counters_and_keeps_the_past_reproducible(stores):
    before = Plan.from_config(config(stores))
    switch_step = 23
    sources = {n: {"path": str(stores / n)} for n in ("main", "task", "extra")}
    new = config(stores, sources=sources, mix={"task": 2, "extra": 1}, global_batch_size=8)
    ledger = reconcile(before, new, step=switch_step, switch=True)
    assert [s.start_step for s in ledger.segments] == [0, switch_step]
    assert ledger.segments[1].counters == {
        "main": before.segment_plan(0).counters_at(switch_step)["main"],
        "task": before.segment_plan(0).counters_at(switch_step)["task"],
        "extra": 0,
    }
    after = Plan(Ledger.from_json(json.loads(json.dumps(ledger.to_json()))))
    for step in (0, 7, switch_step - 1):
        for field, value in before.batch(step).items():
            np.testing.assert_array_equal(after.batch(step)[field], value)
    drawn: Counter = Counter()
    for step in range(switch_step + 40):
        draws = after.draws(step)
        for name_index, lane, epoch, window in zip(
            draws.source, draws.lane, draws.epoch, draws.window
        ):
            drawn[(draws.source_names[name_index], int(lane), int(epoch), int(window))] += 1
    assert max(drawn.values()) == 1, "a window repeated within its epoch across the switch"
    task_windows = after.segment_plan(1).layouts["task"].windows_per_lane
    completed = [k for k in drawn if k[0] == "task" and k[1] == 0 and k[2] == 0]
    assert len(completed) == task_windows  # the task epoch begun before the switch completed


def test_a_ledger_from_another_run_is_refused(stores, tmp_path):
    ledger = Plan.from_config(config(stores)).ledger
    write_synthetic_store(tmp_path / "other", [[5, 5, 5, 5, 5, 5, 5, 5, 5, 5]])
    shutil.rmtree(stores / "task")
    shutil.copytree(tmp_path / "other", stores / "task")
    with pytest.raises(StoreError, match=r"sources.task.path: \S+/task: the store has content fi"):
        Plan(ledger).batch(0)


def written_by_pipeline_0_1(raw: dict) -> None:
    """A ledger as pipeline 0.1 wrote it: version 1, no order version (it used order version 1)."""
    raw.update(version=1)
    del raw["order_version"]
    for segment in raw["segments"]:
        del segment["stages_from"]


def written_before_order_version_2(raw: dict) -> None:
    """A version-2 ledger (`stages_from`, no order version yet): also order version 1."""
    raw.update(version=2)
    del raw["order_version"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: raw["segments"][0].update(start_step=3), "segments\\[0\\] starts at step 3"),
        (lambda raw: raw["segments"].append(dict(raw["segments"][0])), "segments must line up"),
        (lambda raw: raw["segments"][0]["counters"].update(main=-1), "negative counter"),
        (lambda raw: raw["segments"][0]["config"].update(seed=1), "fingerprint does not match"),
        (lambda raw: raw.update(version=99), "not a ledger of versions 1 to 7 \\(found 99\\)"),
        (lambda raw: raw.update(order_version=3), "order version 3, but this release"),
        (written_by_pipeline_0_1, "written under order version 1, .* fresh ledger, or .* 0.1"),
        (written_before_order_version_2, "written under order version 1, .* fresh ledger"),
    ],
)
def test_malformed_ledgers_are_refused_with_one_line(stores, tmp_path, edit, message):
    raw = Plan.from_config(config(stores)).ledger.to_json()
    edit(raw)
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(LedgerError, match=message) as error:
        data_state.load_ledger(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_an_invalid_recorded_config_is_named_once(stores):
    """The segment's place is said once, before the config's own complaint."""
    [segment] = Plan.from_config(config(stores)).ledger.segments
    segment = dataclasses.replace(segment, config={**segment.config, "seq_len": 0})
    with pytest.raises(LedgerError) as error:
        segment.parsed("ledger segment 0 (from step 0)")
    message = str(error.value)
    assert message.startswith("ledger segment 0 (from step 0): the recorded config is invalid: ")
    assert message.count("ledger segment 0") == 1 and "seq_len" in message


def test_a_save_that_fails_leaves_the_previous_ledger_whole(stores, tmp_path, monkeypatch):
    """The new JSON is written beside the ledger and renamed over it: a save that dies half way
    leaves the old file as it was, and no partial file beside it."""
    plan = Plan.from_config(config(stores))
    path = tmp_path / "run" / "ledger.json"
    path.parent.mkdir()
    plan.ledger.save(path)
    before = path.read_bytes()
    switched = reconcile(plan, config(stores, mix={"main": 1, "task": 1}), 8, switch=True)

    def dies(*args):
        raise OSError("killed while saving")

    monkeypatch.setattr("os.replace", dies)
    with pytest.raises(OSError, match="killed while saving"):
        switched.save(path)
    assert path.read_bytes() == before and list(path.parent.iterdir()) == [path]
    monkeypatch.undo()
    switched.save(path)
    assert data_state.load_ledger(path) == switched
