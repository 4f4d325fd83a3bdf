"""Steering a run through the ledger: skips (docs/steering.md), alone and with switches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import DataConfig, parse_config
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan import data_state
from pipeline.plan.data_state import DataState
from pipeline.plan.ledger import Ledger
from pipeline.plan.resume import reconcile
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

SHARDS = {"main": [[40, 13, 22, 8], [31, 9, 27]], "task": [[17, 5], [12, 12]], "extra": [[60, 20]]}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("steering")
    for name, shards in SHARDS.items():
        write_synthetic_store(root / name, shards)
    return root


def config(stores: Path, variant: int = 0) -> DataConfig:
    """Variant 0 is the run's config; the others are what a switch may move to: other weights,
    sources, batch sizes, stages, laid out from the run's start or from the switch."""
    names = ("main", "task", "extra")
    raw: dict = {
        "seed": 11, "seq_len": 4, "lanes": 2, "global_batch_size": 4,
        "sources": {n: {"path": str(stores / n)} for n in names[:2]},
        "stages": [{"name": "warm", "steps": 6, "mix": {"main": 1, "task": 1}},
                   {"name": "main", "mix": {"main": 3, "task": 1}}],
    }  # fmt: skip
    if variant == 1:
        raw["stages"][1]["mix"] = {"main": 1, "task": 2}
    elif variant == 2:
        raw["sources"] = {n: {"path": str(stores / n)} for n in names}
        raw["stages"] = [{"name": "wide", "mix": {"task": 2, "extra": 1, "main": 1}}]
        raw["global_batch_size"] = 8
        raw["starts_at"] = "switch"
    elif variant == 3:
        raw["stages"] = [{"name": "again", "steps": 5, "mix": {"task": 1}},
                         {"name": "rest", "mix": {"main": 1, "task": 1}}]  # fmt: skip
        raw["starts_at"] = "switch"
    return parse_config(raw, origin=f"variant{variant}.yaml")


def rows_of(plan: Plan, step: int) -> list[tuple]:
    """What identifies each row of a step: source name, lane, counter, epoch, window, start."""
    d = plan.draws(step)
    names = [d.source_names[s] for s in d.source.tolist()]
    return list(zip(names, *(a.tolist() for a in (d.lane, d.counter, d.epoch, d.window, d.start))))


def round_trip(ledger: Ledger) -> Ledger:
    return Ledger.from_json(json.loads(json.dumps(ledger.to_json())))


# (steps after the previous intervention, steps to skip, config variant to switch to or None)
interventions = st.lists(
    st.tuples(st.integers(1, 12), st.integers(0, 9), st.one_of(st.none(), st.integers(1, 3))),
    min_size=1,
    max_size=4,
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(interventions)
def test_served_steps_are_the_unskipped_plans_steps_shifted_by_the_skips_before(stores, steps):
    """served(t) == plan_without_skips(t + skips recorded at or before t), with switches."""
    steered = Plan.from_config(config(stores))
    plain = Plan.from_config(config(stores))
    at = skipped = 0
    shifts = []  # (served step, total skips from it on)
    current = 0
    for gap, skip, variant in steps:
        at += gap
        if variant is not None:
            current = variant
        ledger = reconcile(steered, config(stores, current), at, switch=True, skip=skip)
        steered = Plan(round_trip(ledger), steered.stores())
        skipped += skip
        shifts.append((at, skipped))
        if variant is not None:  # the same switch, where the skips put it in the plan
            plain = Plan(reconcile(plain, config(stores, current), at + skipped, switch=True))
    for t in range(at + 15):
        shift = max([s for start, s in shifts if start <= t], default=0)
        assert steered.ledger.plan_step(t) == t + shift
        assert rows_of(steered, t) == rows_of(plain, t + shift), t
    data_state.verify_ledger(steered.ledger, steered, "<steered>")  # counters re-derive


def test_a_skip_serves_the_plans_later_steps_and_counts_what_it_passes_as_drawn(stores):
    before = Plan.from_config(config(stores))
    ledger = reconcile(before, config(stores), 20, skip=10)
    after = Plan(round_trip(ledger), before.stores())
    assert [(s.start_step, s.skip) for s in after.ledger.segments] == [(0, 0), (20, 10)]
    for t in range(15):
        assert rows_of(after, t) == rows_of(before, t)
        assert rows_of(after, 20 + t) == rows_of(before, 30 + t)
    assert after.segment_plan(1).counters_at(20) == before.segment_plan(0).counters_at(30)
    served = {row for t in range(40) for row in rows_of(after, t)}
    for t in range(20, 30):  # never served: the skipped steps' rows of this epoch
        assert not served & set(rows_of(before, t))


def test_a_skip_after_a_switch_from_the_switch_passes_over_its_curriculum(stores):
    run = Plan.from_config(config(stores))
    switched = Plan(reconcile(run, config(stores, 3), 8, switch=True), run.stores())
    skipped = Plan(reconcile(switched, config(stores, 3), 12, skip=4), run.stores())
    assert skipped.ledger.segments[2].stages_from == 8  # the curriculum keeps its start
    for t in range(12, 30):
        assert rows_of(skipped, t) == rows_of(switched, t + 4)


def test_restores_at_a_skips_first_step_add_the_skips_up(stores):
    run = Plan.from_config(config(stores))
    once = Plan(reconcile(run, config(stores), 20, skip=10), run.stores())
    twice = reconcile(once, config(stores), 20, skip=5)
    assert [(s.start_step, s.skip) for s in twice.segments] == [(0, 0), (20, 15)]
    again = Plan(twice, run.stores())
    assert rows_of(again, 20) == rows_of(run, 35)


def test_a_skip_at_step_0_or_a_negative_one_is_refused(stores):
    run = Plan.from_config(config(stores))
    with pytest.raises(LedgerError, match="cannot skip data at step 0"):
        reconcile(run, config(stores), 0, skip=3)
    with pytest.raises(LedgerError, match="skip_steps: expected an integer >= 0, got -1"):
        reconcile(run, config(stores), 5, skip=-1)


def test_ledgers_without_skips_keep_their_format_and_old_states_restore(stores, tmp_path):
    run = Plan.from_config(config(stores))
    switched = reconcile(run, config(stores, 1), 9, switch=True)
    raw = switched.to_json()
    assert raw["version"] == 3  # readable by releases before skips
    assert all("skip" not in segment for segment in raw["segments"])
    state = DataState(12, switched)
    text = state.dumps()
    restored = data_state.parse(text, "old.json")  # a state written before skips existed
    assert restored.ledger == switched
    skipped = reconcile(Plan(switched, run.stores()), config(stores, 1), 12, skip=4)
    assert skipped.to_json()["version"] == 4
    assert skipped.to_json()["segments"][2]["skip"] == 4


def test_an_edited_skip_is_refused(stores):
    run = Plan.from_config(config(stores))
    raw = reconcile(run, config(stores), 20, skip=10).to_json()
    raw["segments"][1]["skip"] = 11
    with pytest.raises(LedgerError, match=r"segments\[1\] fingerprint does not match"):
        Ledger.from_json(raw)
    del raw["segments"][1]["skip"]
    with pytest.raises(LedgerError, match=r"segments\[1\] fingerprint does not match"):
        Ledger.from_json(raw)


def test_counters_a_skip_did_not_carry_are_named_by_verify(stores):
    run = Plan.from_config(config(stores))
    raw = reconcile(run, config(stores), 20, skip=10).to_json()
    entry = raw["segments"][1]
    entry["counters"]["main"] = run.segment_plan(0).counters_at(20)["main"]  # as if no skip
    entry.pop("fingerprint")
    ledger = Ledger.from_json(raw)
    with pytest.raises(LedgerError, match=r"segments\[1\]\.counters\.main: .* at step 30"):
        data_state.verify_ledger(ledger, Plan(ledger, run.stores()), "edited")


def test_a_skip_past_the_end_of_the_stages_is_refused(stores):
    finite = parse_config(
        {"seed": 11, "seq_len": 4, "lanes": 2, "global_batch_size": 4,
         "sources": {"task": {"path": str(stores / "task")}},
         "stages": [{"name": "only", "steps": 30, "mix": {"task": 1}}]},
        origin="finite.yaml",
    )  # fmt: skip
    run = Plan.from_config(finite)
    with pytest.raises(ConfigError, match=r"skipping 15 steps at step 20 .* no step to serve"):
        reconcile(run, finite, 20, skip=15)
    last = Plan(reconcile(run, finite, 20, skip=9), run.stores())
    np.testing.assert_array_equal(last.draws(20).counter, run.draws(29).counter)


def checkpoint_at_20(tmp_path: Path) -> tuple[Path, DataConfig, Plan, Path]:
    """The two-stage config written as a file, its config and plan, and a real Orbax checkpoint
    directory holding the feed's data state at step 20."""
    import orbax.checkpoint as ocp
    import yaml

    from pipeline.feed.checkpoint import DataSave
    from pipeline.feed.data_feed import DataFeed
    from tests.feedstores import two_stage_raw
    from tests.test_checkpoint import manager, mesh

    raw = two_stage_raw(tmp_path / "stores")
    config_file = tmp_path / "data.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    data = parse_config(raw, origin="data.yaml")
    directory = tmp_path / "ckpt"
    with DataFeed(data, mesh()) as feed, manager(directory, async_save=False) as mngr:
        feed.seek(20)
        mngr.save(20, args=ocp.args.Composite(data=DataSave(feed)))
    return config_file, data, Plan.from_config(data), directory


def test_a_restore_with_skip_steps_serves_the_plans_later_steps_and_dump_replays_them(
    tmp_path, capsys
):
    """Restored at step 20 with skip_steps=10 from a real Orbax checkpoint, steps 20.. serve
    the plan's steps 30..; `pipeline dump --ledger` of a later checkpoint gives them again,
    `pipeline stages --ledger` lists the skip, and `verify --ledger` passes across it."""
    import orbax.checkpoint as ocp

    from pipeline.commands.cli import main
    from pipeline.feed.checkpoint import DataRestore, DataSave
    from pipeline.feed.data_feed import DataFeed
    from tests.test_checkpoint import manager, mesh

    config_file, data, plan, directory = checkpoint_at_20(tmp_path)
    served = []
    with DataFeed(data, mesh()) as feed, manager(directory, async_save=False) as mngr:
        mngr.restore(20, args=ocp.args.Composite(data=DataRestore(feed, skip_steps=10)))
        assert feed.step == 20
        for step in range(20, 26):
            batch = next(feed)
            expected = plan.batch(step + 10)
            for field, values in expected.items():
                np.testing.assert_array_equal(np.asarray(batch[field]), values)
            served.append(np.asarray(batch["inputs"]))
        mngr.save(26, args=ocp.args.Composite(data=DataSave(feed)))
    out = tmp_path / "dump.npz"
    step_dir = directory / "26"
    argv = ["dump", config_file, "--ledger", step_dir, "--steps", "20:26", "--out", out]
    assert main([str(a) for a in argv]) == 0
    np.testing.assert_array_equal(np.load(out)["inputs"], np.stack(served))
    capsys.readouterr()
    assert main(["stages", str(config_file), "--ledger", str(step_dir)]) == 0
    listing = capsys.readouterr().out
    assert "ledger segment from step 20: skip 10 steps (step 20 serves plan step 30)" in listing
    assert main(["verify", str(config_file), "--ledger", str(step_dir), "--steps", "0:40"]) == 0


@pytest.mark.parametrize("at", [7, 9])  # a set_mix at the restored step, and one ahead of it
def test_a_skip_after_a_set_mix_at_or_past_the_restore_gives_checkpoints_that_restore(stores, at):
    """A controller's `set_mix(step=feed.step)` just before the save, then a restore there with
    a skip: the restore drops the entry, so the skipped steps must count under the weights
    without it, or every later checkpoint is refused as edited."""
    from pipeline.plan.ledger import MixEntry, quantize

    run = config(stores)
    plan = Plan.from_config(run).with_mix(MixEntry(at, quantize({"main": 1.0, "task": 0.0})))
    state = DataState(7, round_trip(plan.ledger))
    restored = Plan(state.ledger, plan.stores())
    data_state.verify(state, restored)
    steered = reconcile(restored, run, 7, skip=4)
    assert len(steered.mixes) == 0
    later = DataState(10, round_trip(steered))
    data_state.verify(later, Plan(later.ledger, plan.stores()))  # the next restore
    unsteered = Plan.from_config(run)  # the skip counted under the weights the ledger keeps
    assert steered.segments[1].counters == unsteered.segment_plan(0).counters_at(11)


# -- skips at a named step (skip_at): one skip, however often the restore is repeated ---------

MIXES = [{"main": 3, "task": 1}, {"main": 1, "task": 1}, {"main": 1, "task": 4}]


def served_run(stores: Path, at: int, skip: int, mixing: bool, stop: int) -> dict[int, list]:
    """Each step's rows in one uninterrupted run that skips `skip` steps at step `at` (with a
    controller's `set_mix` before every step when `mixing`)."""
    from pipeline.plan.ledger import MixEntry, quantize

    run = config(stores)
    plan, rows = Plan.from_config(run), {}
    for t in range(stop):
        if t == at:
            plan = Plan(reconcile(plan, run, at, skip=skip), plan.stores())
        if mixing:
            plan = plan.with_mix(MixEntry(t, quantize(MIXES[t % 3])))
        rows[t] = rows_of(plan, t)
    return rows


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    at=st.integers(1, 24),
    skip=st.integers(1, 6),
    every=st.integers(1, 6),
    mixing=st.booleans(),
    first=st.integers(1, 30),  # the first launch, without the skip's arguments, stops here
    restarts=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=5),
)
def test_a_skip_at_a_step_is_made_once_however_often_the_restore_repeats(
    stores, at, skip, every, mixing, first, restarts
):
    """A run killed at random steps, restored each time from a checkpoint (the latest or an
    earlier one) with the same `skip=N, skip_at=S`: every step serves what one uninterrupted
    run skipping N at S serves, and the last ledger holds exactly that skip. A checkpoint past
    S without it (the first launch ran past S) is refused in one line, then an earlier one is
    restored, as an operator would."""
    from pipeline.plan.ledger import MixEntry, quantize

    run, stop = config(stores), 40
    expected = served_run(stores, at, skip, mixing, stop)
    saved: dict[int, Ledger] = {0: Plan.from_config(run).ledger}

    def serve(plan: Plan, start: int, end: int, rows: dict[int, list]) -> Plan:
        for t in range(start, min(end, stop)):
            if mixing:
                plan = plan.with_mix(MixEntry(t, quantize(MIXES[t % 3])))
            assert rows_of(plan, t) == rows[t], t
            if (t + 1) % every == 0:
                saved[t + 1] = round_trip(plan.ledger)  # checkpoint t + 1 holds data step t + 1
        return plan

    unskipped = served_run(stores, stop, 0, mixing, stop)
    serve(Plan.from_config(run), 0, first, unskipped)  # launched without the skip's arguments
    for kill, pick in [*restarts, (stop, 0)]:
        steps = sorted(saved)
        step = steps[max(0, len(steps) - 1 - pick)]
        state = DataState.from_json(DataState(step, saved[step]).to_json(), f"ckpt/{step}")
        plan = Plan(state.ledger, [])
        data_state.verify(state, plan)
        try:
            ledger = reconcile(plan, run, step, skip=skip, skip_at=at)
        except LedgerError as error:
            assert step > at and f"skip_at {at}: the restored step {step} is past it" in str(error)
            assert not [s for s in state.ledger.segments if s.skip]  # only if it lacks the skip
            step = max(s for s in steps if s <= at)  # the operator restores one at or before S
            plan = Plan(saved[step], [])
            ledger = reconcile(plan, run, step, skip=skip, skip_at=at)
        plan = serve(Plan(round_trip(ledger), []), step, step + kill, expected)
    assert [(s.start_step, s.skip) for s in plan.ledger.segments if s.skip] == [(at, skip)]
    data_state.verify_ledger(plan.ledger, plan, "<run>")


def test_a_skip_scheduled_at_a_restore_replays_restores_again_and_is_listed(tmp_path, capsys):
    """Restored at step 20 from a real Orbax checkpoint with skip_steps=10, skip_at=24: steps
    20..23 are the plan's, 24.. the plan's 34..; checkpoint 22, saved before the skip, holds
    it scheduled: `pipeline stages/dump/verify --ledger` of it say so and replay it, and a
    restore of it with the same arguments skips nothing more."""
    import orbax.checkpoint as ocp

    from pipeline.commands.cli import main
    from pipeline.feed.checkpoint import DataRestore, DataSave
    from pipeline.feed.data_feed import DataFeed
    from tests.test_checkpoint import manager, mesh

    config_file, data, plan, directory = checkpoint_at_20(tmp_path)

    def restored(step: int, first: int, stop: int, save: int | None = None) -> list[np.ndarray]:
        served = []
        with DataFeed(data, mesh()) as feed, manager(directory, async_save=False) as mngr:
            skip = DataRestore(feed, skip_steps=np.int64(10), skip_at=np.int64(24))
            mngr.restore(step, args=ocp.args.Composite(data=skip))
            assert feed.step == first
            for t in range(first, stop):
                if t == save:
                    mngr.save(t, args=ocp.args.Composite(data=DataSave(feed)))
                batch = next(feed)
                np.testing.assert_array_equal(
                    np.asarray(batch["inputs"]), plan.batch(t + 10 * (t >= 24))["inputs"]
                )
                served.append(np.asarray(batch["inputs"]))
        return served

    served = restored(20, 20, 28, save=22)
    restored(22, 22, 27)  # held: the same skip, not another one (checked against the plan)
    step_dir = directory / "22"
    capsys.readouterr()
    assert main(["stages", str(config_file), "--ledger", str(step_dir)]) == 0
    listing = capsys.readouterr().out
    assert listing.startswith(
        "scheduled: skip 10 steps at step 24 (the checkpoint holds step 22; the run serves "
        "steps 22..23 as planned, then passes over 10)\n"
    )
    assert "ledger segment from step 24: skip 10 steps (step 24 serves plan step 34)" in listing
    out = tmp_path / "dump.npz"
    argv = ["dump", config_file, "--ledger", step_dir, "--steps", "20:28", "--out", out]
    assert main([str(a) for a in argv]) == 0
    np.testing.assert_array_equal(np.load(out)["inputs"], np.stack(served))
    assert main(["verify", str(config_file), "--ledger", str(step_dir), "--steps", "0:40"]) == 0


@pytest.mark.parametrize(
    "skip, at, message",
    [
        (np.int64(3), np.int32(10), None),  # NumPy integers, as set_mix takes them
        (-1, None, "skip_steps: expected an integer >= 0, got -1"),
        (True, None, "skip_steps: expected an integer >= 0, got True"),
        (3, False, "skip_at: expected an integer >= 0, got False"),
        (3, np.int64(-2), "skip_at: expected an integer >= 0, got np.int64(-2)"),
        (2**64, None, "skip_steps: expected an integer of at most 9,007,199,254,740,992, got"),
        (3, 10**30, "skip_at: expected an integer of at most 9,007,199,254,740,992, got"),
        (3.0, None, "skip_steps: expected an integer >= 0, got 3.0"),
    ],
)
def test_skip_values_are_integers_numpy_ones_too_and_others_are_one_line(stores, skip, at, message):
    run = Plan.from_config(config(stores))
    if message is None:
        ledger = reconcile(run, config(stores), 5, skip=skip, skip_at=at)
        assert [(s.start_step, s.skip) for s in ledger.segments] == [(0, 0), (10, 3)]
        assert json.loads(json.dumps(ledger.to_json()))["segments"][1]["skip"] == 3
        return
    with pytest.raises(LedgerError) as error:
        reconcile(run, config(stores), 5, skip=skip, skip_at=at)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_a_data_state_may_hold_only_skips_ahead_of_its_step(stores):
    """A skip scheduled after the state's step restores; a switch there cannot be scheduled,
    so a state whose step is before one is refused as before."""
    run = Plan.from_config(config(stores))
    scheduled = reconcile(run, config(stores), 5, skip=3, skip_at=10)
    assert DataState.from_json(DataState(7, scheduled).to_json(), "c").ledger == scheduled
    switched = reconcile(run, config(stores, 1), 10, switch=True)
    with pytest.raises(LedgerError, match="step 7 is before the ledger's last segment"):
        DataState.from_json(DataState(7, switched).to_json(), "c")
