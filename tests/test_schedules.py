"""Run-anchored switches and batch-size schedules: what a run draws across both."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import load_config, parse_config
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan.ledger import Ledger
from pipeline.plan.report import ScheduledSources, target_shares
from pipeline.plan.resume import reconcile
from pipeline.plan.rows import host_rows
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
SHARDS = {
    "s0": [[30, 7, 12, 40], [25, 9, 16]],
    "s1": [[11, 60, 3], [8, 21, 33], [14]],
    "s2": [[19, 44], [6, 27, 30]],
}


def write_stores(directory: Path) -> Path:
    for name, shards in SHARDS.items():
        if not (directory / name).exists():
            write_synthetic_store(directory / name, shards)
    return directory


def raw_config(directory: Path, names=("s0", "s1"), **overrides) -> dict:
    raw = {
        "seed": 5, "seq_len": 4, "lanes": 2, "global_batch_size": 6,
        "sources": {n: {"path": str(directory / n)} for n in names},
    }  # fmt: skip
    raw.update(overrides)
    return raw


def source_names(plan: Plan, step: int) -> list[str]:
    draws = plan.draws(step)
    return [draws.source_names[s] for s in draws.source]


def switched(before: dict, after: dict, step: int) -> Plan:
    """The plan of a run of `before` switched to `after` at `step` (through a saved ledger)."""
    plan = Plan.from_config(parse_config(before, origin="before.yaml"))
    ledger = reconcile(plan, parse_config(after, origin="after.yaml"), step, switch=True)
    return Plan(Ledger.from_json(json.loads(json.dumps(ledger.to_json()))), plan.stores())


# -- run-anchored switches ----------------------------------------------------------------------


@st.composite
def fading_switches(draw):
    """A fading schedule, then the same schedule text with a source added or a weight changed."""
    ramp = draw(st.integers(2, 40))
    rows_per_lane = draw(st.integers(1, 4))
    stages = [
        {"name": "fade", "steps": ramp + draw(st.integers(0, 10)),
         "mix": {"s0": {"linear": {0: 1, ramp: 0.1}}, "s1": {"linear": {0: 0, ramp: 1}}}},
        {"name": "main", "mix": {"s0": 1, "s1": 2}},
    ]  # fmt: skip
    changed = json.loads(json.dumps(stages))
    if draw(st.booleans()):
        changed[1]["mix"]["s2"] = draw(st.integers(1, 3))  # a new source, later in the run
    else:
        changed[1]["mix"]["s1"] = draw(st.integers(3, 6))  # another weight, later in the run
    return {
        "before": {"stages": stages, "global_batch_size": 2 * rows_per_lane},
        "after": {"stages": changed, "global_batch_size": 2 * rows_per_lane},
        "switch": draw(st.integers(1, ramp + 15)),
        "added": "s2" in changed[1]["mix"],
    }


@SETTINGS
@given(fading_switches())
def test_a_switch_with_an_unchanged_schedule_continues_it(case):
    with tempfile.TemporaryDirectory() as tmp:
        stores = write_stores(Path(tmp))
        after_names = ("s0", "s1", "s2") if case["added"] else ("s0", "s1")
        before = raw_config(stores, **case["before"])
        after = raw_config(stores, after_names, **case["after"])
        plan = switched(before, after, case["switch"])
        uninterrupted = Plan.from_config(parse_config(after, origin="after.yaml"))
        stop = case["switch"] + 25
        for step in range(case["switch"], stop):
            assert source_names(plan, step) == source_names(uninterrupted, step), step
        before_plan = Plan.from_config(parse_config(before, origin="before.yaml"))
        for step in range(case["switch"]):
            assert source_names(plan, step) == source_names(before_plan, step), step
        report = audit(plan, 0, stop, process_counts=[1, 2])
        assert report.ok, report.violations[:3]


def test_a_switch_that_changes_nothing_before_it_is_the_new_config_from_step_zero(tmp_path):
    stores = write_stores(tmp_path)
    stages = [
        {"name": "warm", "steps": 6, "mix": {"s0": {"linear": {0: 1, 6: 0}}, "s1": 1}},
        {"name": "blend", "epochs": {"s0": 1}},
        {"name": "main", "mix": {"s0": 1, "s1": 1}},
    ]
    longer = json.loads(json.dumps(stages))
    longer[2]["steps"] = 50  # the same run, then one more stage (from step 61)
    longer.append({"name": "tail", "mix": {"s1": 1, "s2": 1}})
    before = raw_config(stores, stages=stages)
    after = raw_config(stores, ("s0", "s1", "s2"), stages=longer)
    uninterrupted = Plan.from_config(parse_config(after, origin="after.yaml"))
    blend = next(r for r in _stage_starts(uninterrupted) if r[0] == "blend")[1]
    for at in (3, blend + 2, 40):  # in `warm`, inside the epochized blend, in `main`
        plan = switched(before, after, at)
        for step in range(0, 75):
            for field, value in uninterrupted.batch(step).items():
                np.testing.assert_array_equal(plan.batch(step)[field], value, err_msg=field)


def _stage_starts(plan: Plan) -> list[tuple[str, int]]:
    from pipeline.plan.report import stage_rows

    return [(row.name, row.start_step) for row in stage_rows(plan)]


def test_a_switch_into_a_stage_the_old_config_lacked_keeps_its_steps(tmp_path):
    """The documented case that cannot be honoured in full: an epochized stage that the new
    config places before the switch step. The run joins it where it is; it ends at the step
    the config places its end, having drawn only its rows from the switch on."""
    stores = write_stores(tmp_path)
    before = raw_config(stores, mix={"s0": 1, "s1": 1})
    stages = [
        {"name": "warm", "steps": 2, "mix": {"s1": 1}},
        {"name": "blend", "epochs": {"s0": 2}},
        {"name": "main", "mix": {"s1": 1}},
    ]
    after = raw_config(stores, stages=stages)
    uninterrupted = Plan.from_config(parse_config(after, origin="after.yaml"))
    plan = switched(before, after, 10)
    for step in range(10, 60):
        assert source_names(plan, step) == source_names(uninterrupted, step)
    assert audit(plan, 0, 60, process_counts=[1]).ok


def test_starts_at_switch_appends_the_new_curriculum_from_the_switch(tmp_path):
    stores = write_stores(tmp_path)
    stages = [
        {"name": "a", "steps": 5, "mix": {"s0": 1}},
        {"name": "b", "mix": {"s1": 1}},
    ]
    before = raw_config(stores, mix={"s0": 1, "s1": 1})
    fresh = Plan.from_config(parse_config(raw_config(stores, stages=stages), origin="x.yaml"))
    for starts_at, offset in (("switch", 20), ("run", 0)):
        after = raw_config(stores, stages=stages, starts_at=starts_at)
        plan = switched(before, after, 20)
        assert plan.ledger.last.stages_from == offset
        for step in range(20, 32):
            assert source_names(plan, step) == source_names(fresh, step - offset)


def test_a_run_anchored_switch_past_the_new_configs_end_is_refused(tmp_path):
    stores = write_stores(tmp_path)
    before = raw_config(stores, mix={"s0": 1})
    after = raw_config(stores, stages=[{"name": "only", "steps": 8, "mix": {"s1": 1}}])
    plan = Plan.from_config(parse_config(before, origin="before.yaml"))
    with pytest.raises(
        ConfigError,
        match=r"after.yaml: the stages, laid out from step 0 "
        r"\(starts_at: run\), end at step 7, before this segment starts at step 9",
    ):
        reconcile(plan, parse_config(after, origin="after.yaml"), 9, switch=True)  # fmt: skip


@pytest.mark.parametrize(
    ("stages_from", "message"),
    [(0, "fingerprint does not match"), (3, "only 0 \\(starts_at: run\\) or its start step 20")],
)
def test_an_edited_anchoring_is_refused(tmp_path, stages_from, message):
    stores = write_stores(tmp_path)
    before = raw_config(stores, mix={"s0": 1, "s1": 1})
    after = raw_config(stores, mix={"s0": 2, "s1": 1}, starts_at="switch")
    raw = switched(before, after, 20).ledger.to_json()
    raw["segments"][1]["stages_from"] = stages_from
    with pytest.raises(LedgerError, match=message):
        Ledger.from_json(raw, origin="ledger.json")


# -- batch-size schedules -----------------------------------------------------------------------


@st.composite
def batch_ramps(draw):
    lanes = draw(st.sampled_from([1, 2, 4]))
    steps = sorted(draw(st.sets(st.integers(1, 30), min_size=1, max_size=3)))
    per_lane = draw(st.lists(st.integers(1, 4), min_size=len(steps) + 1, max_size=len(steps) + 1))
    schedule = {0: per_lane[0] * lanes, **{s: r * lanes for s, r in zip(steps, per_lane[1:])}}
    weights = draw(st.sampled_from([
        {"s0": 1, "s1": 2},
        {"s0": {"step": {0: 1, 7: 0}}, "s1": 1},
        {"s0": {"linear": {0: 3, 20: 0.5}}, "s1": 1, "s2": {"step": {0: 0, 12: 2}}},
    ]))  # fmt: skip
    return {"lanes": lanes, "global_batch_size": {"step": schedule}, "mix": weights}


@SETTINGS
@given(batch_ramps(), st.integers(0, 45))
def test_a_batch_ramp_draws_each_window_once_per_epoch_on_any_hosts(ramp, resume_at):
    with tempfile.TemporaryDirectory() as tmp:
        stores = write_stores(Path(tmp))
        names = tuple(sorted(ramp["mix"]))
        raw = raw_config(stores, names, **ramp)
        plan = Plan.from_config(parse_config(raw, origin="ramp.yaml"))
        sizes = dict(ramp["global_batch_size"]["step"])
        for step in range(45):
            size = sizes[max(s for s in sizes if s <= step)]
            assert plan.batch_size(step) == size
            assert len(plan.draws(step).rows) == size
        counts = [c for c in (1, 2, 4) if all(s % c == 0 for s in sizes.values())]
        report = audit(plan, 0, 45, process_counts=counts)  # simulated hosts: host_rows
        assert report.ok, report.violations[:3]
        resumed = Plan.from_config(parse_config(raw, origin="ramp.yaml"))  # a fresh process
        expected = plan.batch(resume_at)
        for count in counts:
            rows = host_rows(plan.batch_size(resume_at), count - 1, count)
            for field, value in resumed.batch(resume_at, rows).items():
                np.testing.assert_array_equal(value, expected[field][rows])


def assert_scheduled_sources_follow_the_shares(plan: Plan, steps: list[int]) -> None:
    scheduled = ScheduledSources(plan)
    for step in steps:
        expected = {name for name, share in target_shares(plan, [step]).items() if share[0]}
        assert scheduled(step) == expected, step


@SETTINGS
@given(fading_switches(), batch_ramps(), st.randoms(use_true_random=False))
def test_the_feeds_scheduled_sources_are_the_positive_shares(case, ramp, random):
    """`ScheduledSources` (the feed's event log asks it every step and keeps each answer for
    a span of steps) gives what `target_shares` gives, across stage ends, weight and batch
    schedule points and a ledger switch, step after step and in any order (a seek)."""
    with tempfile.TemporaryDirectory() as tmp:
        stores = write_stores(Path(tmp))
        after_names = ("s0", "s1", "s2") if case["added"] else ("s0", "s1")
        switch = switched(
            raw_config(stores, **case["before"]),
            raw_config(stores, after_names, **case["after"]),
            case["switch"],
        )
        ramped = Plan.from_config(
            parse_config(raw_config(stores, tuple(sorted(ramp["mix"])), **ramp), origin="r.yaml")
        )
        for plan in (switch, ramped):
            steps = list(range(70))
            assert_scheduled_sources_follow_the_shares(plan, steps)
            random.shuffle(steps)
            assert_scheduled_sources_follow_the_shares(plan, steps)


def test_weight_schedules_stay_in_optimizer_steps_under_a_batch_ramp(tmp_path):
    stores = write_stores(tmp_path)
    raw = raw_config(
        stores,
        ("s0", "s1", "s2"),
        global_batch_size={"step": {0: 2, 3: 8, 9: 4}},
        stages=[
            {"name": "a", "steps": 5,
             "mix": {"s0": {"step": {0: 1, 4: 0}}, "s1": {"step": {0: 0, 4: 1}}}},
            {"name": "b", "mix": {"s2": 1}},
        ],
    )  # fmt: skip
    plan = Plan.from_config(parse_config(raw, origin="ramp.yaml"))
    assert [set(source_names(plan, step)) for step in range(7)] == [
        {"s0"}, {"s0"}, {"s0"}, {"s0"}, {"s1"}, {"s2"}, {"s2"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "extra", "message"),
    [
        ({"step": {0: 4, 5: 6}}, {"lanes": 4}, "global_batch_size 6 \\(the batch from step 5\\) "
         "is not divisible by lanes 4"),
        ({"step": {2: 4}}, {}, "global_batch_size.step: steps start at 0"),
        ({"linear": {0: 4, 5: 8}}, {}, "global_batch_size: expected rows per step or"),
        ({"step": {0: 4, 5: 0}}, {}, "global_batch_size.step.5: expected an integer >= 1"),
        (4, {"starts_at": "now"}, "starts_at: expected 'run' or 'switch', got 'now'"),
    ],
)  # fmt: skip
def test_bad_batch_schedules_are_refused_naming_the_key(tmp_path, value, extra, message):
    raw = raw_config(tmp_path, global_batch_size=value, mix={"s0": 1}, **extra)
    with pytest.raises(ConfigError, match=f"^ramp.yaml: {message}"):
        parse_config(raw, origin="ramp.yaml")


def test_a_host_count_must_divide_every_scheduled_size_before_any_step_is_checked(tmp_path):
    stores = write_stores(tmp_path)
    raw = raw_config(stores, global_batch_size={"step": {0: 8, 30: 10}}, mix={"s0": 1})
    plan = Plan.from_config(parse_config(raw, origin="ramp.yaml"))
    assert audit(plan, 0, 30, process_counts=[4]).ok
    with pytest.raises(
        ConfigError,
        match="--process-count 4: the plan at step 30 has global_batch_size 10 and 2 lanes",
    ):
        audit(plan, 0, 31, process_counts=[4])  # fmt: skip


def test_a_step_point_past_its_stages_end_is_refused_and_a_linear_one_is_not(tmp_path):
    """`step: {150: 0}` in a 100-step stage never takes effect (a step counted from the run's
    start, most likely): refused naming it. A linear point past the end still sets the slope."""
    stages = [
        {"name": "a", "steps": 100, "mix": {"s0": 1, "s1": {"step": {0: 1, 150: 0}}}},
        {"name": "b", "mix": {"s0": 1}},
    ]
    raw = raw_config(tmp_path, stages=stages)
    message = (
        r"^x.yaml: stages\[0\].mix.s1.step: point 150 is not inside the stage's 100 steps "
        r"\(0..99\), so it would never take effect; schedule steps count from the stage's first"
    )
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, origin="x.yaml")
    stages[0]["mix"]["s1"] = {"linear": {0: 1, 150: 0}}
    parse_config(raw_config(tmp_path, stages=stages), origin="x.yaml")
    stages[0]["mix"]["s1"] = {"step": {0: 1, 99: 0}}
    parse_config(raw_config(tmp_path, stages=stages), origin="x.yaml")


@pytest.mark.parametrize(
    ("points", "first", "second", "step"),
    [
        ("{0: 1, '0': 5}", "0", "'0'", 0),
        ("{'0': 1, 0: 5}", "'0'", "0", 0),
        ("{1e3: 1, 1000: 5}", "'1e3'", "1000", 1000),  # YAML 1.1 reads 1e3 as a string
        ("{1000: 1, '1000.0': 5}", "1000", "'1000.0'", 1000),
        ("{7: 1, '007': 5}", "7", "'007'", 7),
    ],
)
def test_two_spellings_of_one_schedule_step_are_refused_by_name(
    tmp_path, points, first, second, step
):
    """The loader refuses a key written twice, but `0` and `'0'` are different YAML keys: the
    schedule refuses them rather than let the last weight silently win."""
    config = tmp_path / "data.yaml"
    config.write_text(
        f"seed: 0\nseq_len: 8\nglobal_batch_size: 4\nsources: {{docs: {{path: {tmp_path}}}}}\n"
        f"mix: {{docs: {{step: {points}}}}}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(config)
    expected = f"{config}: mix.docs.step: keys {first} and {second} both name step {step}; "
    assert str(info.value).startswith(expected), info.value
