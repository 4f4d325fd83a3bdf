"""`objective:` weights and the batch's `loss_weights` (docs/mixtures.md, "Objective weights").

The reference is `objective.step_weights` on the host over every row of a step; the feed's
on-device derivation (both `expand` modes, with and without micro-batches, windows, whole
documents and a mixture of both), `pipeline dump`, the Grain view and a switch that changes the
objective must give the same float32 bits. The property: per step, each present source's
trained targets carry its objective share of the step's total weight, which is the count of
trained targets.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Plan, parse_config
from pipeline.commands.cli import main as cli
from pipeline.errors import ConfigError, FeedError, LedgerError
from pipeline.feed import expand
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.grain_source import host_source
from pipeline.plan.ledger import Ledger, MixEntry, config_mapping, quantize
from pipeline.plan.resume import reconcile
from pipeline.read import objective
from tests.feedstores import two_stage_raw
from tests.test_expand import data_mesh, feed_batches
from tests.test_packing import write_masked_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> Path:
    """`code` and `docs` (concat) and `sft` (a masked store) in one directory."""
    root = tmp_path_factory.mktemp("objective")
    two_stage_raw(root)
    write_masked_store(root / "sft", [[(3 + i % 9, i % 3) for i in range(60)]])
    return root


def raw_of(stores: Path, mix: dict, objective_weights: dict | None, **extra) -> dict:
    sources = {name: {"path": str(stores / name)} for name in mix}
    if "sft" in sources:
        sources["sft"]["packing"] = "best_fit"
    raw = {"seed": 3, "seq_len": 8, "global_batch_size": 8, "lanes": 2, "sources": sources,
           "mix": mix, **extra}  # fmt: skip
    if objective_weights is not None:
        raw["objective"] = objective_weights
    return raw


def plan_of(raw: dict) -> Plan:
    return Plan.from_config(parse_config(raw, origin="objective.yaml"))


def shares(plan: Plan, step: int, weights: np.ndarray) -> dict[str, float]:
    """Each drawn source's part of the step's total loss weight."""
    draws = plan.draws(step)
    total = weights.sum(dtype=np.float64)
    return {
        name: weights[draws.source == k].sum(dtype=np.float64) / total
        for k, name in enumerate(draws.source_names)
        if (draws.source == k).any()
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"web": 1}, "objective.web: unknown source (sources: code, docs)"),
        ({"code": -1}, "objective.code: expected a finite number >= 0, got -1"),
        ({"code": True}, "objective.code: expected a number >= 0, got True"),
        ({"code": ".5"}, "objective.code: expected a number >= 0, got '.5'"),
        ({"code": 0, "docs": 0}, "objective: at least one weight must be > 0"),
        ({}, "objective: expected a non-empty mapping"),
        ([1], "objective: expected a non-empty mapping"),
    ],
)
def test_an_objective_is_read_strictly(tmp_path: Path, value, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"objective.yaml: {message}")):
        parse_config(two_stage_raw(tmp_path, objective=value), origin="objective.yaml")


def test_a_stage_objective_replaces_the_top_one_and_round_trips_through_the_ledger(
    tmp_path: Path,
) -> None:
    raw = two_stage_raw(tmp_path, objective={"code": 1, "docs": 1})
    raw["stages"][1]["objective"] = {"docs": 2.5}
    config = parse_config(raw, origin="objective.yaml")
    assert [stage.objective for stage in config.stages] == [
        (("code", 1.0), ("docs", 1.0)),
        (("docs", 2.5),),
    ]
    mapping = config_mapping(config)
    assert [stage["objective"] for stage in mapping["stages"]] == [{"code": 1, "docs": 1},
                                                                   {"docs": 2.5}]  # fmt: skip
    assert parse_config(mapping).stages == config.stages
    bad = two_stage_raw(tmp_path)
    bad["stages"][0]["objective"] = {"code": -2}
    with pytest.raises(ConfigError, match=r"stages\[0\]\.objective\.code: expected a finite"):
        parse_config(bad, origin="objective.yaml")
    plain = config_mapping(parse_config(two_stage_raw(tmp_path)))  # no objective, no key
    assert all("objective" not in stage for stage in plain["stages"])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    mix=st.fixed_dictionaries(
        {"code": st.integers(0, 4), "docs": st.integers(1, 4), "sft": st.integers(0, 4)}
    ),
    weights=st.fixed_dictionaries(
        {"code": st.integers(0, 3), "docs": st.integers(1, 3)}, optional={"sft": st.integers(0, 3)}
    ),
    steps=st.lists(st.integers(0, 300), min_size=1, max_size=3),
)
def test_each_source_carries_its_objective_share_of_every_step(stores, mix, weights, steps):
    """Windows and masked whole documents alike: a drawn source's share of the step's weight
    is its objective weight over those of the drawn sources; untrained targets weigh 0; the
    weights sum to the step's trained targets."""
    mix = {name: weight for name, weight in mix.items() if weight}
    weights = {name: weight for name, weight in weights.items() if name in mix}
    if not any(weights.values()):
        weights["docs"] = 1
    plan = plan_of(raw_of(stores, mix, weights))
    for step in steps:
        got = objective.step_weights(plan, step)
        trained = plan.batch(step)["targets_segmentation"] != 0
        assert got.dtype == np.float32 and not got[~trained].any()
        drawn = shares(plan, step, got)
        total = sum(weights.get(name, 0) for name in drawn)
        if total == 0:
            assert not got.any()
            continue
        assert got.sum(dtype=np.float64) == pytest.approx(trained.sum(), rel=1e-5)
        for name, share in drawn.items():
            assert share == pytest.approx(weights.get(name, 0) / total, abs=1e-6), name


def test_pipeline_dump_shows_loss_weights_with_equal_sums(stores, tmp_path: Path) -> None:
    """The issue's example: mix {a: 3, b: 1}, objective {a: 1, b: 1}: per step, a's and b's
    trained tokens carry equal sums; another host's rows are its slice of the same weights."""
    raw = raw_of(stores, {"code": 3, "docs": 1}, {"code": 1, "docs": 1})
    config = tmp_path / "dump.yaml"
    config.write_text(json.dumps(raw))
    assert cli(["dump", str(config), "--steps", "0:20", "--out", str(tmp_path / "all")]) == 0
    second = ["--process-index", "1", "--process-count", "2", "--out", str(tmp_path / "half")]
    assert cli(["dump", str(config), "--steps", "0:20", *second]) == 0
    whole, half = np.load(tmp_path / "all.npz"), np.load(tmp_path / "half.npz")
    weights, source = whole["loss_weights"], whole["source"]
    assert weights.shape == whole["targets"].shape
    code, docs = ((weights.sum(-1) * (source == k)).sum(-1) for k in (0, 1))
    np.testing.assert_allclose(code, docs, rtol=1e-6)
    np.testing.assert_allclose(code + docs, 8 * 8, rtol=1e-6)  # mean weight 1
    assert (source == 0).sum() == 3 * (source == 1).sum()  # sampled 3:1, weighted 1:1
    np.testing.assert_array_equal(half["loss_weights"], weights[:, 4:])
    plain = tmp_path / "plain.yaml"
    plain.write_text(json.dumps(raw_of(stores, {"code": 3, "docs": 1}, None)))
    assert cli(["dump", str(plain), "--steps", "0:2", "--out", str(tmp_path / "plain")]) == 0
    assert "loss_weights" not in np.load(tmp_path / "plain.npz")


OBJECTIVE_FEEDS = {
    "windows": lambda s: raw_of(s, {"code": 3, "docs": 1}, {"code": 1, "docs": 2}),
    "documents": lambda s: raw_of(s, {"sft": 1}, {"sft": 1}, seq_len=12),
    "mixed, grad_accum": lambda s: raw_of(
        s, {"code": 2, "sft": 1}, {"code": 1, "sft": 3}, global_batch_size=16, grad_accum=2
    ),
}


@pytest.mark.parametrize("case", list(OBJECTIVE_FEEDS))
def test_the_feed_derives_the_hosts_weights_on_the_devices(stores, case: str) -> None:
    """Both expand modes, on a 2-D mesh, at steps reached in order and by seek (a resume)."""
    raw = OBJECTIVE_FEEDS[case](stores)
    plan = plan_of(raw)
    mesh = data_mesh((4, 2), ("data", "fsdp"))
    steps = [0, 1, 2, 9, 10, 300, 3]
    for mode in ("device", "host"):
        batches = feed_batches(raw, mode, mesh, steps, batch_axes=("data", "fsdp"))
        for step, batch in zip(steps, batches):
            weights = batch["loss_weights"]
            assert weights.sharding == batch["targets"].sharding
            assert "loss_source" not in batch and "loss_objective" not in batch
            expected = objective.step_weights(plan, step)
            np.testing.assert_array_equal(np.asarray(weights).reshape(expected.shape), expected)


def test_a_switch_that_changes_the_objective_changes_the_weights_from_its_step(stores) -> None:
    """The objective is part of the data order: a change without a declared switch is refused
    naming it; with one, the steps before keep their weights, the steps after follow the new
    objective, and no token changes."""
    before = plan_of(raw_of(stores, {"code": 3, "docs": 1}, {"code": 1, "docs": 1}))
    after_raw = raw_of(stores, {"code": 3, "docs": 1}, {"code": 1, "docs": 3})
    after = parse_config(after_raw, origin="after.yaml")
    with pytest.raises(LedgerError, match=r"stages\[0\]\.objective\.docs: 1 -> 3"):
        reconcile(before, after, 6)
    switched = Plan(reconcile(before, after, 6, switch=True), before.stores())
    for step in range(12):
        got = objective.step_weights(switched, step)
        if step < 6:
            np.testing.assert_array_equal(got, objective.step_weights(before, step))
        else:
            assert shares(switched, step, got)["docs"] == pytest.approx(0.75, abs=1e-6)
        for name, values in before.batch(step).items():
            np.testing.assert_array_equal(switched.batch(step)[name], values, err_msg=name)


def test_a_stage_without_an_objective_weighs_every_trained_token_1(stores) -> None:
    raw = two_stage_raw(stores)
    raw["stages"][1]["objective"] = {"code": 1, "docs": 1}
    plan = plan_of(raw)
    warmup, main = objective.step_weights(plan, 3), objective.step_weights(plan, 10)
    np.testing.assert_array_equal(warmup, plan.batch(3)["targets_segmentation"] != 0)
    assert shares(plan, 10, main) == pytest.approx({"code": 0.5, "docs": 0.5})
    assert objective.step_weights(plan_of(two_stage_raw(stores)), 3) is None


def test_the_grain_view_carries_what_the_devices_weigh(stores) -> None:
    """Two hosts' rows made one global batch, then `expand.weigh`: the step's weights."""
    plan = plan_of(raw_of(stores, {"code": 2, "sft": 1}, {"code": 1, "sft": 3}))
    halves = [host_source(plan, index, 2, by_step=True)[4] for index in range(2)]
    joined = {name: np.concatenate([h[name] for h in halves]) for name in halves[0]}
    assert joined["loss_source"].dtype == joined["loss_objective"].dtype == np.int32
    where = jax.sharding.NamedSharding(data_mesh(), jax.sharding.PartitionSpec("data", None))
    arrays = {name: jax.device_put(values) for name, values in joined.items()}
    weighed = expand.weigh(arrays, where, len(plan.config.source_names))
    assert "loss_source" not in weighed
    np.testing.assert_array_equal(
        np.asarray(weighed["loss_weights"]), objective.step_weights(plan, 4)
    )


def test_the_reference_trainers_loss_weighs_each_target_by_its_loss_weight(stores) -> None:
    """scripts/tiny_lm: the loss is sum(loss x loss_weights) / trained targets (without the
    field: the plain mean), so the objective moves the gradient, not the loss's scale."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import optax
    import tiny_lm

    plan = plan_of(raw_of(stores, {"code": 3, "docs": 1}, {"code": 1, "docs": 3}))
    batch = {name: jnp.asarray(values % 50) for name, values in plan.batch(2).items()}
    config = tiny_lm.ModelConfig(vocab_size=64, seq_len=8, width=16)
    params = tiny_lm.init_params(config, jax.random.key(0))
    targets = optax.softmax_cross_entropy_with_integer_labels(
        tiny_lm.logits(params, batch, config), batch["targets"]
    )
    weights = objective.step_weights(plan, 2)
    weights[: len(weights) // 2] *= 3  # skewed, so that a loss that ignores them differs
    trained = np.asarray(batch["targets_segmentation"]) != 0
    plain = tiny_lm.loss_and_weights(params, batch, config)[0]
    weighted = tiny_lm.loss_and_weights(params, {**batch, "loss_weights": weights}, config)[0]
    assert float(plain) == pytest.approx(float((targets * trained).sum() / trained.sum()), 1e-6)
    assert float(weighted) == pytest.approx(float((targets * weights).sum() / trained.sum()), 1e-6)
    assert float(weighted) != pytest.approx(float(plain), 1e-6)


def test_set_mix_moves_the_objective_from_its_step_and_the_ledger_replays_it(stores) -> None:
    """An objective entry holds from its step to the end of its stage (`warmup`, steps 0..9);
    the ledger (version 7, its entries round-tripped) gives every served step's weights."""
    raw = two_stage_raw(stores, objective={"code": 1, "docs": 1})
    mesh = data_mesh()
    served = {}
    with DataFeed(parse_config(raw, origin="objective.yaml"), mesh) as feed:
        for step in range(14):
            if step == 4:
                feed.set_mix(None, 4, objective={"docs": 3, "code": 1})
            if step == 6:  # both at once; the weights change the rows from 6 on
                feed.set_mix({"code": 1, "docs": 1}, 6, objective={"code": 1, "docs": 4})
            served[step] = np.asarray(next(feed)["loss_weights"])
        with pytest.raises(LedgerError, match="no source sft in the data config"):
            feed.set_mix(None, 20, objective={"sft": 1})
        with pytest.raises(FeedError, match="give weights, an objective, or both"):
            feed.set_mix(None, 20)
        saved = feed.ledger.to_json()
    assert saved["version"] == 7 and list(Ledger.from_json(saved).objectives.steps) == [4, 6]
    replay = Plan(Ledger.from_json(json.loads(json.dumps(saved))), feed.plan.stores())
    for step, weights in served.items():
        np.testing.assert_array_equal(weights, objective.step_weights(replay, step))
        docs = shares(replay, step, weights)["docs"]
        assert docs == pytest.approx(0.5 if step < 4 or step >= 10 else 0.75 if step < 6 else 0.8)
    assert len(replay.without_mixes_from(5).ledger.objectives) == 1  # a restore at 5 drops 6's


def test_an_objective_set_before_a_scheduled_skip_keeps_the_skip(stores) -> None:
    """A restore at step 2 that scheduled a skip of 3 at step 8 (`skip_at`), then an objective
    entry at step 4: the entry goes into the segment it falls in, the skip stays scheduled
    after it, and the steps before the skip weigh by the entry."""
    config = parse_config(two_stage_raw(stores, objective={"code": 1, "docs": 1}), origin="o")
    run = Plan.from_config(config)
    scheduled = Plan(reconcile(run, config, 2, skip=3, skip_at=8), run.stores())
    moved = scheduled.with_objective(MixEntry(4, quantize({"docs": 3, "code": 1}, "o")))
    assert [(s.start_step, s.skip) for s in moved.ledger.segments] == [(0, 0), (8, 3)]
    assert list(moved.ledger.objectives.steps) == [4]
    assert shares(moved, 5, objective.step_weights(moved, 5))["docs"] == pytest.approx(0.75)
    assert shares(moved, 3, objective.step_weights(moved, 3))["docs"] == pytest.approx(0.5)
