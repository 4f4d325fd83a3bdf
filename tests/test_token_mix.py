"""`mix_unit: tokens` (pipeline/plan/token_mix.py): a stage's sources share its target tokens by
their weights, within the stated bound, at every step of 1,000; the rows stay a pure function
of (config, step, row): any step computed alone, on any host's rows, is the sequential run's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Plan, parse_config
from pipeline.errors import ConfigError, LedgerError
from pipeline.plan.ledger import MixEntry, quantize
from pipeline.plan.rows import host_rows
from tests.feedstores import two_stage_raw
from tests.test_packing import write_masked_store

STEPS = 1000


def raw_of(root: Path, weights: dict, seq_len: int, lanes: int, first_epoch: bool) -> dict:
    """code (concat) and sft (best_fit, rows far from full) and maybe docs (concat), after an
    epochized stage of code when `first_epoch` (so the stage starts inside a step)."""
    sources = {name: {"path": str(root / name)} for name in weights}
    sources.setdefault("code", {"path": str(root / "code")})
    sources["sft"]["packing"] = "best_fit"
    main = {"name": "main", "mix": weights, "mix_unit": "tokens"}
    stages = [{"name": "code-epoch", "epochs": {"code": 1}}, main] if first_epoch else [main]
    return {"seed": 9, "seq_len": seq_len, "global_batch_size": 4 * lanes, "lanes": lanes,
            "sources": sources, "stages": stages}  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tokens")
    two_stage_raw(root)  # code, docs
    rng = np.random.default_rng(4)  # 300 documents of 10..15 tokens: one per row of 16 slots
    write_masked_store(root / "sft", [[(int(n), 0) for n in rng.integers(10, 16, 300)]])
    return root


def row_tokens(plan: Plan, step: int, draws) -> np.ndarray:
    """Each drawn row's target tokens (padding excluded)."""
    layouts = plan.segment_plan(0).layouts
    out = np.empty(len(draws.rows), dtype=np.int64)
    for k, name in enumerate(draws.source_names):
        mine = draws.source == k
        layout = layouts[name]
        if layout.row_kind == "windows":
            out[mine] = layout.seq_len
        else:
            tokens = layout.doc_tokens[layout.row_docs] - 1
            per_row = np.add.reduceat(tokens, layout.row_offsets[:-1])
            out[mine] = per_row[draws.window[mine]]
    return out


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    weights=st.fixed_dictionaries(
        {"sft": st.integers(1, 5), "code": st.integers(1, 5)}, optional={"docs": st.integers(1, 5)}
    ),
    seq_len=st.sampled_from([8, 16]),
    lanes=st.sampled_from([1, 2]),
    first_epoch=st.booleans(),
)
def test_trained_token_shares_stay_within_the_bound_for_1000_steps(
    root, weights, seq_len, lanes, first_epoch
):
    plan = Plan.from_config(parse_config(raw_of(root, weights, seq_len, lanes, first_epoch)))
    table = plan.segment_plan(0).table
    stage = table.stages[-1]
    names = plan.config.source_names
    share = np.array([weights.get(n, 0) for n in names], float) / sum(weights.values())
    bound = np.zeros(len(names))
    bound[list(stage.sources)] = stage.mixture.error_bounds()
    assert (bound <= max(1, len(weights)) * lanes * seq_len).all()  # at most K row groups
    tokens = np.zeros(len(names))
    checked = 0
    for step in range(STEPS):
        draws = plan.draws(step)
        mine = draws.stage == len(table.stages) - 1
        np.add.at(tokens, draws.source[mine], row_tokens(plan, step, draws)[mine])
        if mine.any():
            deviation = np.abs(tokens - share * tokens.sum())
            assert (deviation <= bound + 1e-9).all(), (step, tokens, deviation, bound)
            checked += 1
    assert checked > STEPS // 2
    # pure: steps computed alone, in any order, on any host's rows, are the sequential run's
    fresh = Plan.from_config(parse_config(raw_of(root, weights, seq_len, lanes, first_epoch)))
    batch = plan.batch_size(0)
    for step in (STEPS - 1, 3, 517, 0):
        whole = plan.draws(step)
        for index in range(2):
            rows = host_rows(batch, index, 2)
            alone = fresh.draws(step, rows)
            np.testing.assert_array_equal(alone.source, whole.source[rows])
            np.testing.assert_array_equal(alone.counter, whole.counter[rows])
            np.testing.assert_array_equal(alone.window, whole.window[rows])


def test_rows_drift_from_the_weights_where_tokens_do_not(root):
    """The reason for the unit: rows of 1:1 give sft ~3/4 of code's tokens here."""
    shares = {}
    for unit in ("rows", "tokens"):
        raw = raw_of(root, {"code": 1, "sft": 1}, 16, 2, False)
        raw["stages"][0]["mix_unit"] = unit
        plan = Plan.from_config(parse_config(raw))
        tokens = np.zeros(2)
        for step in range(200):
            draws = plan.draws(step)
            np.add.at(tokens, draws.source, row_tokens(plan, step, draws))
        shares[unit] = tokens[1] / tokens.sum()  # sft (by name: code, sft)
    assert shares["rows"] < 0.45 and shares["tokens"] == pytest.approx(0.5, abs=0.001)


def test_mix_unit_is_read_strictly_and_is_part_of_the_data_order(root, tmp_path):
    base = raw_of(root, {"code": 1, "sft": 1}, 16, 1, False)
    bad = [
        ({"mix_unit": "bytes"}, "stages[0].mix_unit: expected 'rows' or 'tokens', got 'bytes'"),
        ({"mix": {"code": {"linear": {0: 1, 9: 2}}, "sft": 1}},
         "stages[0].mix_unit: mix_unit: tokens needs constant weights; code has a schedule"),
    ]  # fmt: skip
    for change, message in bad:
        raw = {**base, "stages": [{**base["stages"][0], **change}]}
        with pytest.raises(ConfigError, match=re_escape(f"t.yaml: {message}")):
            parse_config(raw, origin="t.yaml")
    epochized = {**base, "stages": [{"epochs": {"code": 1}, "mix_unit": "tokens"}]}
    with pytest.raises(ConfigError, match=r"stages\[0\]\.mix_unit: an epochized stage"):
        parse_config(epochized, origin="t.yaml")
    top = {**base, "mix": {"code": 1, "sft": 1}, "mix_unit": "tokens"}
    del top["stages"]
    assert parse_config(top).stages[0].mix_unit == "tokens"
    plan = Plan.from_config(parse_config(base))
    rows = Plan.from_config(
        parse_config({**base, "stages": [{"name": "main", "mix": {"code": 1, "sft": 1}}]})
    )
    assert plan.ledger.last.fingerprint != rows.ledger.last.fingerprint
    with pytest.raises(LedgerError, match="shares its tokens by constant weights"):
        plan.with_mix(MixEntry(4, quantize({"code": 1.0, "sft": 2.0})))


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_a_switch_into_a_token_stage_carries_the_counters_and_a_late_join_is_refused(root):
    """`starts_at: switch` lays the stage out from the switch with the carried counters: every
    source's epoch goes on (the segment's first counters are the carried ones). Joining it
    after its first step (a skip) would need counters the stage cannot be laid out from."""
    from pipeline.plan.resume import reconcile

    rows = raw_of(root, {"code": 1, "sft": 1}, 16, 2, False)
    rows["stages"][0]["mix_unit"] = "rows"
    before = Plan.from_config(parse_config(rows))
    tokens = {**raw_of(root, {"code": 1, "sft": 1}, 16, 2, False), "starts_at": "switch"}
    switched = Plan(reconcile(before, parse_config(tokens), 40, switch=True), before.stores())
    carried = switched.ledger.last.counters
    assert carried == before.segment_plan(0).counters_at(40)
    draws = switched.draws(40)
    for k, name in enumerate(draws.source_names):
        if (draws.source == k).any():
            assert draws.counter[draws.source == k].min() == carried[name]
    plan = Plan.from_config(parse_config(tokens))
    with pytest.raises(ConfigError, match="mix_unit: tokens cannot be joined after its first"):
        Plan(reconcile(plan, parse_config(tokens), 40, skip=3), plan.stores()).draws(40)


def test_pipeline_stages_says_the_weights_share_tokens(root):
    from pipeline.plan.report import describe_mix

    plan = Plan.from_config(parse_config(raw_of(root, {"code": 1, "sft": 3}, 16, 1, True)))
    stages = plan.segment_plan(0).table.stages
    described = [describe_mix(stage) for stage in stages]
    assert described == ["code x1 epochs", "code 1, sft 3 (of tokens)"]
