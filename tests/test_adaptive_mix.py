"""Adaptive mixtures: weights the run sets for itself (`DataFeed.set_mix`), replayed exactly."""

from __future__ import annotations

import json
import re
import signal

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.commands.cli import main
from pipeline.config import parse_config
from pipeline.errors import ConfigError, FeedError, LedgerError
from pipeline.feed.checkpoint import DataRestore, DataSave
from pipeline.feed.data_feed import DataFeed
from pipeline.plan import data_state
from pipeline.plan.ledger import MIX_UNIT, Ledger, MixEntry, quantize
from pipeline.plan.mix_table import MixTable
from pipeline.plan.mixing import Mixture, Steered, fixed_counts
from pipeline.plan.report import ScheduledSources, target_shares
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.feedstores import two_stage_raw
from tests.test_checkpoint import manager, mesh

weights = st.lists(st.integers(0, MIX_UNIT), min_size=1, max_size=6).filter(any)


@settings(max_examples=200, deadline=None)
@given(weights, st.integers(0, 10**15))
def test_fixed_counts_split_every_row_once_within_the_mixing_bound(units, rows):
    w = np.array(units)
    counts = fixed_counts(w, np.array([rows, rows + 1]))
    assert counts[0].sum() == rows and (counts[1] - counts[0]).sum() == 1
    assert np.all(counts[1] >= counts[0])
    total = int(w.sum())
    bounds = Mixture(np.zeros((0, len(w))), w.astype(float), 1).error_bounds()
    for count, units, bound in zip(counts[0].tolist(), w.tolist(), bounds.tolist()):
        assert abs(count * total - rows * units) <= (bound + 1e-9) * total  # exact integers


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), weights.filter(lambda u: len(u) == 3)), max_size=5),
    st.integers(1, 4),
)
def test_a_steered_mixture_keeps_the_bound_on_each_piece_and_assigns_each_row(sets, rows_per_step):
    base = Mixture(np.zeros((0, 3)), np.array([3.0, 1.0, 2.0]), rows_per_step)
    if not sets:
        return
    steps = np.cumsum([gap for gap, _ in sets])
    mixture = Steered(base, steps, steps * rows_per_step, np.array([u for _, u in sets]))
    end = int(steps[-1] + 30) * rows_per_step
    counts = mixture.counts(np.arange(end + 1))
    assert np.all(counts.sum(axis=1) == np.arange(end + 1))
    assert np.all(np.diff(counts, axis=0) >= 0)
    np.testing.assert_array_equal(
        counts[: steps[0] * rows_per_step], base.counts(np.arange(steps[0] * rows_per_step))
    )
    starts = [*(steps * rows_per_step).tolist(), end]
    for (_, units), first, stop in zip(sets, starts, starts[1:]):
        w = np.array(units)
        since = counts[first : stop + 1] - counts[first]
        exact = np.arange(stop - first + 1)[:, None] * w / w.sum()
        bounds = Mixture(np.zeros((0, 3)), w.astype(float), 1).error_bounds()
        assert np.all(np.abs(since - exact) <= bounds + 1e-9)
    source, before = mixture.sources(np.arange(end))
    np.testing.assert_array_equal(before, counts[np.arange(end), source])


def test_weights_are_quantized_so_float_noise_records_the_same_integers():
    assert quantize({"a": 0.1 + 0.2, "b": 0.7}) == quantize({"a": 0.3, "b": 0.7})
    assert quantize({"a": 3, "b": 1, "c": 0}) == (("a", 3 * MIX_UNIT // 4), ("b", MIX_UNIT // 4))
    half = MIX_UNIT // 2  # weights whose sum overflows a float still record their shares
    assert quantize({"a": 1e308, "b": 1e308}) == (("a", half), ("b", half))
    for bad, message in (
        ({}, "non-empty mapping"),
        ({"a": -1}, "finite and >= 0"),
        ({"a": float("nan")}, "finite and >= 0"),
        ({"a": 0}, "at least one weight must be > 0"),
        ({"a": "1"}, "not a number"),
    ):
        with pytest.raises(ConfigError, match=message):
            quantize(bad)


def weights_at(step: int) -> dict[str, float]:
    """The loop's weights: a fixed function of the step, in floats."""
    return {"code": 1.0 + (step // 10) % 3, "docs": 0.5 + 0.25 * ((step // 10) % 2)}


def run(feed: DataFeed, mngr, stop: int, served: dict[int, dict[str, np.ndarray]]) -> None:
    """The training loop: weights set every 10 steps, a checkpoint every 5."""
    while feed.step < stop:
        if feed.step % 10 == 0:
            feed.set_mix(weights_at(feed.step), step=feed.step)
        step = feed.step
        served[step] = {k: np.asarray(v) for k, v in next(feed).items()}
        if mngr is not None and feed.step % 5 == 0:
            mngr.save(feed.step, args=ocp.args.Composite(data=DataSave(feed)))


def test_a_loop_setting_mixes_resumed_after_a_kill_serves_the_uninterrupted_batches(
    tmp_path, capsys
):
    raw = two_stage_raw(tmp_path / "stores")
    config = parse_config(raw, origin="data.yaml")
    uninterrupted: dict[int, dict] = {}
    with DataFeed(config, mesh()) as feed:
        run(feed, None, 60, uninterrupted)
        ledger = feed.ledger
    assert [m.step for m in ledger.mixes] == [0, 10, 20, 30, 40, 50]
    plain = Plan.from_config(config)
    assert any(  # the calls change the batches
        plain.draws(s).source.tolist() != Plan(ledger, plain.stores()).draws(s).source.tolist()
        for s in range(60)
    )
    served: dict[int, dict] = {}
    directory = tmp_path / "ckpt"
    with DataFeed(config, mesh(), prefetch=4) as feed, manager(directory, async_save=False) as m:
        run(feed, m, 37, served)  # "killed" at step 37: checkpoint 35 is the latest
    with DataFeed(config, mesh(), prefetch=4) as feed, manager(directory, async_save=False) as m:
        m.restore(35, args=ocp.args.Composite(data=DataRestore(feed)))
        assert feed.step == 35 and [e.step for e in feed.ledger.mixes] == [0, 10, 20, 30]
        run(feed, m, 60, served)
        m.wait_until_finished()
    for step in range(60):
        for field in FIELDS:
            np.testing.assert_array_equal(served[step][field], uninterrupted[step][field])
    assert data_state.load_ledger(directory / "60") == ledger
    config_file = tmp_path / "data.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    out = tmp_path / "dump.npz"
    argv = ["dump", config_file, "--ledger", directory / "60", "--steps", "0:60", "--out", out]
    assert main([str(a) for a in argv]) == 0
    dumped = np.load(out)
    for field in FIELDS:
        np.testing.assert_array_equal(dumped[field], [uninterrupted[s][field] for s in range(60)])
    assert (
        main(["verify", str(config_file), "--ledger", str(directory / "60"), "--steps", "0:60"])
        == 0
    )
    capsys.readouterr()
    assert main(["stages", str(config_file), "--ledger", str(directory / "60")]) == 0
    last = quantize(weights_at(50))
    shares = ", ".join(f"{n} {w / sum(u for _, u in last):.3f}" for n, w in last)
    assert f"set_mix: 6 calls, steps 0..50; the last from step 50: {shares}" in (
        capsys.readouterr().out
    )


def test_a_mix_holds_until_the_next_call_or_the_end_of_its_stage(tmp_path):
    config = parse_config(two_stage_raw(tmp_path / "stores"), origin="data.yaml")
    plain = Plan.from_config(config)
    plan = plain.with_mix(MixEntry(4, (("docs", MIX_UNIT),)))  # warmup stage, steps 0..9
    for step in range(4):
        assert plan.draws(step).source.tolist() == plain.draws(step).source.tolist()
    for step in range(4, 10):
        draws = plan.draws(step)
        assert {draws.source_names[s] for s in draws.source} == {"docs"}
    # the stage "main" from step 10 has its own weights again; its counters carry on
    after = plan.draws(10)
    assert {after.source_names[s] for s in after.source} == {"code", "docs"}
    table = plan.segment_plan(0)
    assert table.counters_at(10)["docs"] > plain.segment_plan(0).counters_at(10)["docs"]
    shares = target_shares(plan, np.arange(12))  # what `pipeline plot` draws as the targets
    np.testing.assert_allclose(shares["docs"], [0.5] * 4 + [1.0] * 6 + [0.25] * 2)
    scheduled = ScheduledSources(plan)  # the feed's event log asks step after step
    both, docs = {"code", "docs"}, {"docs"}
    assert [scheduled(step) for step in range(12)] == [both] * 4 + [docs] * 6 + [both] * 2


def test_bad_calls_are_refused_and_change_nothing(tmp_path):
    config = parse_config(
        two_stage_raw(
            tmp_path / "stores",
            stages=[
                {"name": "warm", "steps": 4, "mix": {"code": 1, "docs": 1}},
                {"name": "blend", "epochs": {"docs": 1}},
                {"name": "main", "mix": {"code": 1}},
            ],
        ),
        origin="data.yaml",
    )
    with DataFeed(config, mesh()) as feed:
        next(feed)
        with pytest.raises(FeedError, match="set_mix at step 0: the feed has already served it"):
            feed.set_mix({"code": 1}, step=0)
        with pytest.raises(LedgerError, match="no source nope in the data config"):
            feed.set_mix({"nope": 1}, step=2)
        with pytest.raises(LedgerError, match="stage 'blend' is an epochized blend"):
            feed.set_mix({"docs": 1}, step=5)
        with pytest.raises(LedgerError, match="stage 'main' does not draw from docs"):
            feed.set_mix({"docs": 1}, step=40)
        feed.set_mix({"code": 1}, step=3)
        feed.set_mix({"docs": 1}, step=3)  # the same step again: replaces the call
        assert tuple(feed.ledger.mixes) == (MixEntry(3, (("docs", MIX_UNIT),)),)
        with pytest.raises(LedgerError, match="set mixes in step order"):
            feed.set_mix({"code": 1}, step=2)
        # beyond int64 lane positions, or a weight no float holds: one line, nothing recorded
        for step in (2**63, 2**64 + 3, np.uint64(2**63)):
            with pytest.raises(FeedError, match=r"^step: expected an integer in 0\.\.\d+"):
                feed.set_mix({"code": 1}, step=step)
        with pytest.raises(
            ConfigError,
            match=r"weight of 'code' must be finite and >= 0, got an integer of 1329 bits$",
        ):
            feed.set_mix({"code": 10**400, "docs": 1}, step=4)
        assert tuple(feed.ledger.mixes) == (MixEntry(3, (("docs", MIX_UNIT),)),)


def test_prefetched_batches_from_the_step_on_are_read_again(tmp_path):
    config = parse_config(two_stage_raw(tmp_path / "stores"), origin="data.yaml")
    with DataFeed(config, mesh(), prefetch=6) as feed:
        next(feed)
        feed.start_prefetch()
        assert [s for s, _ in feed.prefetched] == [1, 2, 3, 4, 5, 6]
        feed.set_mix({"docs": 1}, step=3)
        expected = Plan(feed.ledger, feed.plan.stores())
        for step in range(1, 8):
            batch = next(feed)
            np.testing.assert_array_equal(
                np.asarray(batch["inputs"]), expected.batch(step)["inputs"]
            )


def test_mix_entries_are_compact_checked_and_old_ledgers_have_none(tmp_path):
    config = parse_config(two_stage_raw(tmp_path / "stores"), origin="data.yaml")
    plan = Plan.from_config(config)
    assert "mixes" not in plan.ledger.to_json() and plan.ledger.to_json()["version"] == 3
    entries = [MixEntry(step, quantize(weights_at(step))) for step in range(10_000)]
    ledger = Ledger(plan.ledger.segments, entries)
    assert ledger.with_mix(entries[-1]) == ledger  # the same call again replaces it
    assert list(ledger.mixes) == entries and ledger.mixes[5] == entries[5]
    raw = ledger.to_json()
    assert raw["version"] == 5
    state = data_state.DataState(10_000, ledger).dumps()  # the checkpoint's file, as written
    assert len(state.encode()) <= 1_000_000
    growth = len(state) - len(data_state.DataState(10_000, plan.ledger).dumps())
    assert growth / 10_000 <= 100
    assert data_state.parse(state, "state").ledger == ledger
    assert Ledger.from_json(json.loads(json.dumps(raw))) == ledger


def encoded(ledger: Ledger, steps: list[int], weights: list[list[int]], names: list[str]) -> dict:
    """`ledger`'s JSON with a mix table of these entries, its digest right."""
    return {**ledger.to_json(), "mixes": MixTable(names, steps, weights).to_json(), "version": 5}


def test_a_damaged_or_impossible_mix_table_is_refused_by_name(tmp_path):
    plan = Plan.from_config(parse_config(two_stage_raw(tmp_path / "stores"), origin="data.yaml"))
    ledger = plan.ledger
    good = encoded(ledger, [0, 5], [[1, 2], [3, 0]], ["code", "docs"])
    assert list(Ledger.from_json(good).mixes) == [
        MixEntry(0, (("code", 1), ("docs", 2))),
        MixEntry(5, (("code", 3),)),
    ]
    damaged = {**good, "mixes": {**good["mixes"], "steps": good["mixes"]["weights"]}}
    for raw, message in (
        (damaged, r"mixes: the digest does not match the entries"),
        ({**good, "mixes": [[0, {"code": 1}]]}, r"mixes is malformed"),
        (encoded(ledger, [5, 5], [[1, 0], [1, 0]], ["code", "docs"]), r"mixes\[1\]: step 5 is"),
        (encoded(ledger, [-1], [[1]], ["code"]), r"mixes\[0\]: step -1 is negative"),
        (encoded(ledger, [0, 1], [[1], [2 * MIX_UNIT + 1]], ["code"]), r"mixes\[1\]: weights"),
        (encoded(ledger, [3], [[1]], ["nope"]), "set_mix at step 3: no source nope"),
        (encoded(ledger, [3], [[1, 1]], ["code", "code"]), "a source is named twice"),
    ):
        with pytest.raises(LedgerError, match=message):
            Ledger.from_json(raw)


def test_a_version_4_ledger_with_a_list_of_mix_entries_still_reads(tmp_path):
    plan = Plan.from_config(parse_config(two_stage_raw(tmp_path / "stores"), origin="data.yaml"))
    raw = {**plan.ledger.to_json(), "version": 4, "mixes": [[0, {"code": 3}], [4, {"docs": 1}]]}
    ledger = Ledger.from_json(raw)
    assert list(ledger.mixes) == [MixEntry(0, (("code", 3),)), MixEntry(4, (("docs", 1),))]
    assert ledger.to_json()["version"] == 5  # written again in the compact form
    for edit, message in (
        (lambda r: r["mixes"].append([3, {"code": 1}]), r"mixes\[2\]: step 3 is not after"),
        (lambda r: r["mixes"][0][1].update(nope=3), "set_mix at step 0: no source nope"),
        (lambda r: r["mixes"][1][1].update(docs=2 * MIX_UNIT + 1), r"mixes\[1\]: weights must be"),
        (lambda r: r["mixes"][0].__setitem__(0, -1), r"mixes\[0\]: step -1 is negative"),
        (lambda r: r["mixes"][0][1].update(code=0.5), "weights must be integers > 0"),
        (lambda r: r["mixes"].append("x"), "malformed"),
    ):
        edited = json.loads(json.dumps(raw))
        edit(edited)
        with pytest.raises(LedgerError, match=message):
            Ledger.from_json(edited)


@pytest.mark.multiprocess
def test_set_mix_every_10_steps_killed_at_37_and_resumed_on_2_processes_is_exact(tmp_path):
    """SIGKILL at step 37 of a 1-process run that sets weights every 10 steps; 2 processes
    resume it: every trained batch is the uninterrupted run's, and `pipeline dump --ledger` of
    the last checkpoint reproduces them all."""
    from tests.multihost_worker import mix_weights
    from tests.test_multihost import launch, read_log, reference_checksums, worker_output

    total = 60
    raw = two_stage_raw(tmp_path / "stores")
    uninterrupted = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
    for step in range(0, total, 10):
        uninterrupted = uninterrupted.with_mix(MixEntry(step, quantize(mix_weights(step))))
    log = tmp_path / "run.jsonl"
    for processes, kill_at in ((1, 37), (2, None)):
        task = {"kind": "train", "ckpt": str(tmp_path / "ckpt"), "steps": total,
                "log": str(log), "save_every": 5, "kill_at": kill_at, "kill_mode": "step",
                "mix_every": 10}  # fmt: skip
        codes = launch(tmp_path, raw, [task], processes, 4 // processes, timeout=240)
        expected = [0] * processes if kill_at is None else [-signal.SIGKILL] * processes
        assert codes == expected, worker_output(tmp_path)
    entries = read_log(log)
    assert {e["step"] for e in entries} == set(range(total))
    assert {e["procs"] for e in entries} == {1, 2}
    for entry in entries:
        expected = reference_checksums(uninterrupted.batch(entry["step"]))
        np.testing.assert_array_equal(entry["sums"], expected, err_msg=str(entry["step"]))
    last = max(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    config_file = tmp_path / "multihost.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    out = tmp_path / "dump.npz"
    ledger = tmp_path / "ckpt" / str(last)
    argv = ["dump", config_file, "--ledger", ledger, "--steps", f"0:{last + 1}", "--out", out]
    assert main([str(a) for a in argv]) == 0
    inputs = np.load(out)["inputs"]
    for step in range(last + 1):
        np.testing.assert_array_equal(inputs[step], uninterrupted.batch(step)["inputs"])


@pytest.mark.multiprocess
def test_a_process_whose_set_mix_differs_stops_every_process_naming_both(tmp_path):
    from tests.test_multihost import launch, worker_output

    raw = two_stage_raw(tmp_path / "stores")
    task = {"kind": "train", "ckpt": str(tmp_path / "ckpt"), "steps": 4, "log": str(tmp_path / "l"),
            "save_every": 2, "kill_at": None, "kill_mode": "step", "mix_every": 2,
            "mix_odd_one": 1}  # fmt: skip
    codes = launch(tmp_path, raw, [task], 2, 2, timeout=120)
    assert all(code != 0 for code in codes)
    output = worker_output(tmp_path)
    for me, peer in ((0, 1), (1, 0)):
        assert re.search(
            rf"LedgerError: set_mix call 0: process {me} set \[0, .*\], process {peer} set "
            r"\[0, .*\]; every process must make the same set_mix calls",
            output,
        ), output


def test_the_reference_controller_favours_the_source_whose_loss_falls_least(tmp_path):
    from pipeline.feed.adaptive import ExcessLoss

    config = parse_config(
        two_stage_raw(tmp_path / "stores", stages=[{"name": "m", "mix": {"code": 1, "docs": 1}}]),
        origin="data.yaml",
    )
    controller = ExcessLoss(("code", "docs"), every=5, warmup=2, floor=0.1, rate=4.0)
    with DataFeed(config, mesh()) as feed:
        for step in range(20):
            next(feed)
            # code's loss falls, docs' stays: docs should gain weight (it has more to learn)
            controller.observe({"code": 4.0 / (1 + step), "docs": 4.0, "absent": float("nan")})
            controller.steer(feed)
        set_steps = [m.step for m in feed.ledger.mixes]
        last = dict(feed.ledger.mixes[-1].weights)
    assert set_steps == [5, 10, 15, 20]
    assert last["docs"] > 0.8 * MIX_UNIT and last["code"] >= 0.1 * MIX_UNIT - 1  # the floor
    with pytest.raises(ConfigError, match="ExcessLoss: expected"):
        ExcessLoss(("a", "b"), floor=0.5)
    with pytest.raises(ConfigError, match=r"give none of the sources a, b a weight > 0$"):
        ExcessLoss(("a", "b"), initial={"c": 1.0})


def test_a_held_out_signal_is_each_training_sources_eval_set(tmp_path):
    """`held_out` pairs eval sets with training sources by name (or refuses with one line);
    with `HELD_OUT` the first observation is the reference, so one falling held-out loss
    moves the weights at the next steering step."""
    from pipeline.feed.adaptive import HELD_OUT, ExcessLoss, held_out
    from pipeline.feed.eval_feed import eval_feeds

    stores = tmp_path / "stores"
    raw = two_stage_raw(stores, stages=[{"name": "m", "mix": {"code": 1, "docs": 1}}])
    raw["eval"] = {"sources": {"docs": {"path": str(stores / "docs")},
                               "other": {"path": str(stores / "code")}}}  # fmt: skip
    config = parse_config(raw, origin="data.yaml")
    evals = eval_feeds(config, mesh())
    try:
        assert [feed.name for feed in held_out(("code", "docs"), evals)] == ["docs"]
        with pytest.raises(ConfigError, match=r"^a held-out signal needs an eval set named like "
                           r"a training source \(eval.sources: docs, other; training sources: "
                           r"a, b\)$"):  # fmt: skip
            held_out(("a", "b"), evals)
    finally:
        for feed in evals:
            feed.close()
    controller = ExcessLoss(("code", "docs"), every=4, rate=4.0, **HELD_OUT)
    with DataFeed(config, mesh()) as feed:
        for _ in range(8):
            next(feed)
            if controller.due(feed.step):
                controller.observe({"docs": 3.0 if feed.step == 4 else 2.0})
            controller.steer(feed)
        first, second = (dict(m.weights) for m in feed.ledger.mixes)
    assert first == {"code": MIX_UNIT // 2, "docs": MIX_UNIT // 2}  # the reference
    assert second["code"] > second["docs"]  # docs' held-out loss fell: code gains weight


def test_a_controller_started_from_the_restored_weights_continues_them(tmp_path):
    from pipeline.feed.adaptive import ExcessLoss

    stages = [{"name": "m", "mix": {"code": 1, "docs": 1}}]
    config = parse_config(two_stage_raw(tmp_path / "stores", stages=stages), origin="d.yaml")
    options = {"every": 5, "warmup": 2, "floor": 0.1, "rate": 4.0}
    controller = ExcessLoss(("code", "docs"), **options)
    with DataFeed(config, mesh()) as feed:
        for step in range(20):
            next(feed)
            controller.observe({"code": 4.0 / (1 + step), "docs": 4.0})
            controller.steer(feed)
        ledger, stores = feed.ledger, feed.plan.stores()
        # what a resumed run (scripts/train.py) starts from: the shares in force at its step
        shares = target_shares(Plan(ledger, stores), np.array([20]))
        resumed = ExcessLoss(("code", "docs"), initial={n: float(s[0]) for n, s in shares.items()},
                             **options)  # fmt: skip
        next(feed)
        resumed.steer(feed)  # not a steering step: nothing set
        for _ in range(4):  # no reference yet (warmup): the weights stay
            next(feed)
            resumed.observe({"code": 1.0, "docs": 1.0})
        resumed.steer(feed)
        before, after = (dict(m.weights) for m in feed.ledger.mixes[-2:])
    assert [m.step for m in feed.ledger.mixes[-2:]] == [20, 25]
    assert before["docs"] > 0.8 * MIX_UNIT
    assert all(abs(after[n] - before[n]) <= 1 for n in before)  # the same, to 2^-20
    fresh = ExcessLoss(("a", "b", "c"), initial={"a": 3, "b": 1, "c": 0}, floor=0.05).weights()
    # c at the floor; a and b share the rest as their shares' excess over the floor (0.7 : 0.2)
    assert fresh == pytest.approx({"a": 0.05 + 0.85 * 7 / 9, "b": 0.05 + 0.85 * 2 / 9, "c": 0.05})
    even = ExcessLoss(("a", "b"), initial={"a": 3, "b": 1}).weights()
    assert even == pytest.approx({"a": 0.75, "b": 0.25})  # shares above the floor: as given


def test_a_plan_with_a_mix_shares_the_open_stores_and_pickles_with_it(tmp_path):
    import pickle

    plan = Plan.from_config(parse_config(two_stage_raw(tmp_path / "stores"), origin="d.yaml"))
    steered = plan.with_mix(MixEntry(3, (("docs", MIX_UNIT),)))
    assert [id(s) for s in steered.stores()] == [id(s) for s in plan.stores()]
    assert steered.check_reads == plan.check_reads
    clone = pickle.loads(pickle.dumps(steered))  # a Grain worker's copy (host_dataset)
    for step in range(12):
        for field, values in steered.batch(step).items():
            np.testing.assert_array_equal(clone.batch(step)[field], values)
