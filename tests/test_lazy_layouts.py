"""A plan lays out a `concat` source at its first use: the draws are those of every layout made
at the start, and a store too small for its config is still refused at the start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError
from pipeline.plan.layout import SourceLayout
from pipeline.plan.lazy_layouts import too_small
from pipeline.read.plan import Plan
from tests.storegen import synthetic_meta

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
FIELDS = ("lane", "stage", "source", "counter", "epoch", "window", "start")


def plan_of(shards: list[list[list[int]]], seq_len: int, lanes: int, rows: int, stages=None):
    """The plan of stores of `shards` (metadata alone) in one mix, or in `stages`."""
    names = [f"s{i:02d}" for i in range(len(shards))]
    raw = {"seed": 3, "seq_len": seq_len, "lanes": lanes, "global_batch_size": lanes * rows}
    raw["sources"] = {name: {"path": f"/nonexistent/{name}"} for name in names}
    if stages is None:
        raw["mix"] = {name: 1 + k % 3 for k, name in enumerate(names)}
    else:
        raw["stages"] = stages
    config = parse_config(raw, origin="test.yaml")
    metas = {s.name: synthetic_meta(s.path, shards[int(s.name[1:])]) for s in config.sources}
    return Plan.from_config(config, metas)


mixtures = st.lists(
    st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=4), min_size=1, max_size=3),
    min_size=2,
    max_size=24,
)


@SETTINGS
@given(mixtures, st.integers(1, 6), st.sampled_from([1, 2]), st.integers(1, 3), st.data())
def test_a_plan_lays_out_the_sources_its_steps_draw_and_draws_as_if_all_were(
    shards, seq_len, lanes, rows, data
):
    big = [s for s in shards if sum(map(sum, s)) >= (seq_len + 1) * lanes]
    if len(big) < 2:
        big = [[[40] * 4]] * 2
    lazy, eager = plan_of(big, seq_len, lanes, rows), plan_of(big, seq_len, lanes, rows)
    for name in eager.segment_plan(0).layouts:  # every layout made before any draw
        eager.segment_plan(0).layouts[name]
    assert None not in eager.segment_plan(0).ordered_layouts
    laid = lazy.segment_plan(0).ordered_layouts
    assert laid.count(None) == len(big)  # none before its first draw
    drawn: set[int] = set()
    for step in data.draw(st.lists(st.integers(0, 10**9), min_size=1, max_size=4)):
        got, want = lazy.draws(step), eager.draws(step)
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        drawn |= set(got.drawn)
        assert {k for k, layout in enumerate(laid) if layout is not None} == drawn


@SETTINGS
@given(st.lists(st.integers(1, 60), min_size=1, max_size=4), st.integers(1, 40), st.integers(1, 8))
def test_a_store_is_too_small_exactly_when_its_layout_refuses_it(shards, seq_len, lanes):
    meta = synthetic_meta(Path("/nonexistent/s"), [shards])
    try:
        SourceLayout("s", meta, 0, seq_len, lanes)
        refused = False
    except ConfigError:
        refused = True
    assert refused == too_small(meta.num_tokens, seq_len + 1, lanes)


def test_a_store_too_small_is_refused_at_the_start_naming_the_config():
    shards = [[[50] * 4]] * 5 + [[[3]]]  # s05: 3 tokens, less than a window
    with pytest.raises(ConfigError, match=r"^test\.yaml: sources\.s05: seq_len 8 needs at least"):
        plan_of(shards, seq_len=8, lanes=1, rows=2)


def test_an_epochized_blends_sources_are_laid_out_at_the_start():
    stages = [
        {"name": "blend", "epochs": {"s00": 1}},
        {"name": "rest", "mix": {"s00": 1, "s01": 1, "s02": 1}},
    ]
    plan = plan_of([[[50] * 4]] * 3, seq_len=4, lanes=1, rows=2, stages=stages)
    laid = plan.segment_plan(0).ordered_layouts
    assert [layout is not None for layout in laid] == [True, False, False]
