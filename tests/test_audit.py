"""The audit passes real plans and catches broken ones (repeated windows, skipped windows,
padding, hosts that disagree)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.plan.ledger import Ledger, Segment
from pipeline.read.audit import audit, default_process_counts
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

SHARDS = {"s0": [[7, 9, 5], [11, 3], [8, 8, 6]], "s1": [[13, 4, 6, 9], [10]]}


def make_plan(directory: Path, **overrides) -> Plan:
    for name, shards in SHARDS.items():
        if not (directory / name).exists():
            write_synthetic_store(directory / name, shards)
    raw = {
        "seed": 3,
        "seq_len": 4,
        "lanes": 2,
        "global_batch_size": 4,
        "sources": {name: {"path": str(directory / name)} for name in SHARDS},
        "mix": {"s0": 2, "s1": 1},
    }
    raw.update(overrides)
    if "stages" in raw:
        del raw["mix"]
    return Plan.from_config(parse_config(raw, origin="audit.yaml"))


def test_a_real_plan_passes_with_complete_epochs_and_all_host_counts(tmp_path):
    plan = make_plan(tmp_path)
    report = audit(plan, 0, 20)
    assert report.ok, report.violations
    assert report.process_counts == (1, 2, 4)
    assert report.hosts_checked == 7
    assert report.rows_checked == 80
    windows = plan.segment_plan(0).layouts["s0"].windows_per_lane
    drawn = plan.segment_plan(0).counters_at(20)["s0"]  # s0 draws 0..drawn-1 in each lane
    assert drawn >= 3 * windows
    assert report.epochs_completed["s0"] == (drawn - 1) // windows
    assert report.epochs_completed["s1"] >= 1
    assert "ok:" in report.summary()[-1]


def test_a_range_starting_mid_epoch_is_not_a_violation(tmp_path):
    plan = make_plan(tmp_path)
    report = audit(plan, 7, 30, process_counts=[2])
    assert report.ok, report.violations
    assert report.process_counts == (2,)


def test_epochized_stage_between_timed_stages_passes(tmp_path):
    stages = [
        {"name": "a", "steps": 5, "mix": {"s0": 1, "s1": {"linear": {0: 0, 5: 3}}}},
        {"name": "b", "epochs": {"s0": 2, "s1": 1}},
        {"name": "c", "mix": {"s0": 1, "s1": 1}},
    ]
    raw_plan = make_plan(tmp_path, stages=stages)
    report = audit(raw_plan, 0, 40, process_counts=[])
    assert report.ok, report.violations
    assert report.epochs_completed["s0"] >= 2


def tampered(plan: Plan, switch_step: int, counters: dict[str, int]) -> Plan:
    """The plan's ledger with a second segment at `switch_step` carrying `counters`."""
    first = plan.ledger.segments[0]
    segment = Segment(switch_step, first.config, first.fingerprints, counters)
    return Plan(Ledger((first, segment)))


def test_counters_going_backwards_repeat_windows_and_fail(tmp_path):
    plan = make_plan(tmp_path)
    seg = plan.segment_plan(0)
    windows = seg.layouts["s0"].windows_per_lane
    # at step 30, rewind every source by a few draws: those windows come again in their epoch
    back = {k: max(0, v - 3) for k, v in seg.counters_at(30).items()}
    assert back["s0"] // windows == seg.counters_at(30)["s0"] // windows  # same epoch
    broken = tampered(plan, 30, back)
    report = audit(broken, 0, 36, process_counts=[])
    assert not report.ok
    repeats = [v for v in report.violations if "used again" in v]
    assert repeats and any("source s0" in v for v in repeats)
    assert "FAILED" in report.summary()[-1]
    # the same ledger without the rewind passes
    same = tampered(plan, 30, seg.counters_at(30))
    assert audit(same, 0, 36, process_counts=[1]).ok


def test_counters_jumping_forward_leave_an_epoch_incomplete_and_fail(tmp_path):
    plan = make_plan(tmp_path)
    seg = plan.segment_plan(0)
    ahead = dict(seg.counters_at(4))
    ahead["s0"] += 3  # skips 3 windows of the current epoch
    report = audit(tampered(plan, 4, ahead), 0, 20, process_counts=[])
    assert not report.ok
    assert any("rolled over after drawing" in v and "source s0" in v for v in report.violations)


class PaddedPlan(Plan):
    """A broken plan that pads: the last token of every row gets segment id 0."""

    def read(self, draws):
        batch = super().read(draws)
        batch["targets_segmentation"] = batch["targets_segmentation"].copy()
        batch["targets_segmentation"][:, -1] = 0
        return batch


def test_padding_and_host_disagreement_are_reported(tmp_path):
    good = make_plan(tmp_path)
    broken = PaddedPlan(good.ledger)
    report = audit(broken, 0, 3, process_counts=[2])
    assert not report.ok
    assert any("padding" in v for v in report.violations)
    # hosts compute their rows with their own (correct) plan, so they disagree with this one
    assert any("process 0 of 2" in v for v in report.violations)


class RepeatingPlan(Plan):
    """A broken plan whose rows of step 9 are the rows of step 8."""

    def draws(self, step, rows=None):
        return super().draws(8 if step == 9 else step, rows)


def test_a_plan_that_repeats_a_step_fails(tmp_path):
    report = audit(RepeatingPlan(make_plan(tmp_path).ledger), 0, 12, process_counts=[])
    assert not report.ok
    assert any("used again at step 9" in v for v in report.violations)


def test_process_counts(tmp_path):
    assert default_process_counts(16, 4) == (1, 2, 4, 8, 16)
    assert default_process_counts(12, 3) == (1,)
    assert default_process_counts(24, 8) == (1, 2, 4, 8)
    with pytest.raises(ConfigError, match="--process-count 3"):
        audit(make_plan(tmp_path), 0, 2, process_counts=[3])


def test_windows_checked_counts_distinct_draws(tmp_path):
    plan = make_plan(tmp_path)
    report = audit(plan, 0, 10, process_counts=[])
    draws = [plan.draws(s) for s in range(10)]
    distinct = {
        (d.source_names[s], int(ln), int(e), int(w))
        for d in draws
        for s, ln, e, w in zip(d.source, d.lane, d.epoch, d.window)
    }
    assert report.windows_checked == len(distinct)
    assert report.rows_checked == 40
    assert np.all([report.epochs_seen[n][0] == 0 for n in SHARDS])
