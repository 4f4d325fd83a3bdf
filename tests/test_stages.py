"""Stages and schedules: transitions at exact steps, epochized blends, carried counters."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_plan import plan_of

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
SHARDS = [[[30, 7, 12, 40], [25, 9]], [[11, 60, 3], [8, 21, 33], [14]]]


def setup(lanes: int, rows_per_lane: int, seq_len: int = 5) -> dict:
    return {"seed": 3, "seq_len": seq_len, "lanes": lanes,
            "global_batch_size": lanes * rows_per_lane, "shards": SHARDS}  # fmt: skip


@SETTINGS
@given(st.integers(1, 30), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.sampled_from([1, 2]))
def test_a_step_stage_switches_at_its_first_row(steps, lanes, rows_per_lane, grad_accum):
    stages = [{"name": "a", "steps": steps, "mix": {"s0": 1}}, {"name": "b", "mix": {"s1": 1}}]
    plan = plan_of(setup(lanes, rows_per_lane), stages=stages)
    batch = lanes * rows_per_lane
    assert (plan.draws(steps - 1).source == 0).all()
    assert (plan.draws(steps).source == 1).all()
    if batch % grad_accum == 0:  # micro-batches are slices of the step: same rows, same split
        micro = batch // grad_accum
        for g in range(grad_accum):
            rows = np.arange(g * micro, (g + 1) * micro)
            assert (plan.draws(steps, rows).source == 1).all()
            assert (plan.draws(steps - 1, rows).source == 0).all()


@SETTINGS
@given(st.integers(0, 40), st.sampled_from([1, 2]), st.integers(1, 4))
def test_a_step_schedule_in_a_mix_switches_at_its_step(switch, lanes, rows_per_lane):
    mix = {"s0": {"step": {0: 1, switch: 0}}, "s1": {"step": {0: 0, switch: 1}}}
    if switch == 0:
        mix = {"s0": 0, "s1": 1}
    plan = plan_of(setup(lanes, rows_per_lane), mix=mix)
    if switch:
        assert (plan.draws(switch - 1).source == 0).all()
    assert (plan.draws(switch).source == 1).all()


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2]), st.integers(1, 5))
def test_an_epochized_stage_uses_exactly_its_epochs(rep0, rep1, lanes, rows_per_lane):
    stages = [
        {"name": "warm", "steps": 2, "mix": {"s0": 1}},
        {"name": "blend", "epochs": {"s0": rep0, "s1": rep1}},
        {"name": "rest", "mix": {"s1": 1}},
    ]
    plan = plan_of(setup(lanes, rows_per_lane), stages=stages)
    segment = plan.segment_plan(0)
    windows = {n: layout.windows_per_lane for n, layout in segment.layouts.items()}
    used = np.zeros((lanes, 2), dtype=int)
    step = 0
    while True:
        draws = plan.draws(step)
        in_blend = draws.stage == 1
        np.add.at(used, (draws.lane[in_blend], draws.source[in_blend]), 1)
        if (draws.stage == 2).any():
            # the next stage fills the rest of the step in which the blend ended
            assert (np.diff(draws.stage.reshape(lanes, rows_per_lane), axis=1) >= 0).all()
            break
        step += 1
    for lane in range(lanes):
        assert used[lane].tolist() == [rep0 * windows["s0"], rep1 * windows["s1"]]
    counters = segment.counters_at(step + 1)
    assert counters["s0"] == 2 * rows_per_lane + rep0 * windows["s0"]


def test_a_linear_schedule_tracks_its_target_within_one_row_per_lane():
    mix = {"s0": {"linear": {0: 1.0, 60: 0.0}}, "s1": {"linear": {0: 0.0, 60: 1.0}}}
    plan = plan_of(setup(2, 4), mix=mix)
    drawn, target = 0, 0.0
    for step in range(80):
        share = max(0.0, 1 - step / 60)
        lane0 = plan.draws(step, np.arange(4))
        count = int((lane0.source == 0).sum())
        assert abs(count - 4 * share) <= 1.0
        drawn, target = drawn + count, target + 4 * share
        assert abs(drawn - target) <= 0.5 + 1e-9


def test_counters_stop_at_the_end_of_a_last_stage_that_ends():
    stages = [{"name": "a", "steps": 4, "mix": {"s0": 1, "s1": 1}}]
    segment = plan_of(setup(2, 3), stages=stages).segment_plan(0)
    at_end = segment.counters_at(4)
    assert sum(at_end.values()) == 4 * 3  # four steps of three rows per lane
    assert segment.counters_at(5) == segment.counters_at(10**9) == at_end


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2]), st.integers(1, 5))
def test_a_stages_offsets_are_its_mixtures_counts_at_its_first_row(rep0, rep1, lanes, rows):
    """A stage's offsets (what its draws' counters are counted from) are its mixture's counts
    at its first row, taken as none without walking the mixture when it starts a step."""
    stages = [
        {"name": "warm", "steps": 2, "mix": {"s0": 1, "s1": 2}},
        {"name": "blend", "epochs": {"s0": rep0, "s1": rep1}},  # may end inside a step
        {"name": "rest", "mix": {"s0": 3, "s1": 1}},
    ]
    table = plan_of(setup(lanes, rows), stages=stages).segment_plan(0).table
    for layout in table.stages:
        counted = layout.mixture.counts(np.array([layout.start - layout.schedule_start]))[0]
        assert layout.offsets.dtype == np.int64
        np.testing.assert_array_equal(layout.offsets, counted)
