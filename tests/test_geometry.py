"""seq_len and lanes changed at a declared switch (docs/steering.md, "Context extension").

Checked on random text (`feedstores.geometry_raw`: every token a distinct random id, so every
24-gram is unique and a token tells where it is in the store): inside each source's epoch no
token sequence is served twice across the switch, what is not served is within the documented
lane tails (concat) and every document is used exactly once (best_fit).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import DataConfig, parse_config
from pipeline.errors import LedgerError
from pipeline.plan import data_state, repack, transition
from pipeline.plan.ledger import Ledger
from pipeline.plan.resume import reconcile
from pipeline.plan.row_layout import WINDOWS
from pipeline.read.audit import audit
from pipeline.read.plan import Plan
from tests.feedstores import geometry_raw

SWITCH = 20  # mid-epoch for both sources (asserted below)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("geometry")
    geometry_raw(root)
    return root


def config(stores: Path, seq_len: int = 32, lanes: int = 1) -> DataConfig:
    return parse_config(geometry_raw(stores, seq_len, lanes), origin=f"data{seq_len}.yaml")


def switched(stores: Path, at: int = SWITCH) -> Plan:
    """The run at seq_len 32 on 1 lane, switched at step `at` to 64 on 2 lanes."""
    run = Plan.from_config(config(stores))
    ledger = reconcile(run, config(stores, 64, 2), at, switch=True)
    return Plan(Ledger.from_json(json.loads(json.dumps(ledger.to_json()))), run.stores())


def served(plan: Plan, steps: range) -> dict[tuple[str, int], list[np.ndarray]]:
    """The token sequences served per (source, epoch): a concat row's window of seq_len + 1
    tokens, each document of a best_fit row (its inputs and its last target)."""
    out = defaultdict(list)
    for step in steps:
        draws, batch = plan.draws(step), plan.batch(step)
        layouts = plan.segment_plan(draws.segment_index).layouts
        for i in range(len(draws.rows)):
            name = draws.source_names[draws.source[i]]
            key = (name, int(draws.epoch[i]))
            inputs, targets = batch["inputs"][i], batch["targets"][i]
            if layouts[name].row_kind == WINDOWS:
                out[key].append(np.append(inputs, targets[-1]))
                continue
            segments = batch["inputs_segmentation"][i]
            for number in np.unique(segments[segments > 0]).tolist():
                mine = np.flatnonzero(segments == number)
                out[key].append(np.append(inputs[mine], targets[mine[-1]]))
    return out


def grams(sequences: list[np.ndarray], n: int) -> list[bytes]:
    return [s[i : i + n].tobytes() for s in sequences for i in range(len(s) - n + 1)]


def store_tokens(plan: Plan, name: str) -> np.ndarray:
    layout = plan.segment_plan(0).layouts[name]
    store = plan.store(layout.meta)
    spans = [
        store.read_shard_tokens(s, 0, int(n)).tokens for s, n in enumerate(layout.meta.shard_tokens)
    ]
    return np.concatenate(spans)


def test_a_mid_epoch_switch_to_seq_len_64_on_2_lanes_serves_no_sequence_twice(stores):
    plan = switched(stores)
    old, new = (plan.segment_plan(i).layouts for i in (0, 1))
    counters = plan.segment_plan(0).counters_at(SWITCH)
    for name in ("web", "chat"):  # the switch is inside epoch 0 of each, which goes on after it
        assert 0 < counters[name] < old[name].windows_per_lane
        assert new[name].transition.epoch == 0 and new[name].first_epoch == 1
    # far enough for both sources to complete epoch 1 (the first of the new geometry)
    stop = SWITCH
    while min(plan.segment_plan(1).counters_at(stop)[n] - new[n].epoch_start(2) for n in new) < 0:
        stop += 1
    sequences = served(plan, range(stop))
    assert audit(plan, 0, stop).ok
    tokens = {name: store_tokens(plan, name) for name in ("web", "chat")}
    for (name, epoch), mine in sequences.items():
        for n in (2, 24):  # no pair of consecutive tokens, so no longer sequence, served twice
            found = grams(mine, n)
            assert len(found) == len(set(found)), (name, epoch, n)
        if epoch > 1:
            continue  # not complete in the range
        left = np.setdiff1d(tokens[name], np.concatenate(mine))
        if name == "web":  # the lane tails of the layout the epoch ends in: < lanes * seq_len
            assert len(left) < 2 * 64, (epoch, len(left))
    for epoch in (0, 1):  # best_fit: every document exactly once per epoch, across the switch
        documents = []
        for step in range(stop):
            draws = plan.draws(step)
            layout = plan.segment_plan(draws.segment_index).layouts["chat"]
            mine = (np.asarray(draws.source_names)[draws.source] == "chat") & (draws.epoch == epoch)
            documents.append(layout.documents_of(draws.window[mine]))
        counts = np.bincount(np.concatenate(documents), minlength=len(new["chat"].doc_tokens))
        assert (counts == 1).all(), (epoch, np.flatnonzero(counts != 1))
    data_state.verify_ledger(plan.ledger, plan, "<switched>")  # counters re-derive


@pytest.mark.parametrize(
    ("source", "module", "carried", "nothing", "unit"),
    [  # concat: the edges served before the switch; best_fit: the documents used
        ("web", transition, "served", transition.NONE, "tokens"),
        ("chat", repack, "used_documents", transition.NONE[0], "document"),
    ],
)
def test_verify_reports_a_switch_that_serves_part_of_the_epoch_again(
    stores, monkeypatch, source, module, carried, nothing, unit
):
    """A transition that forgot what epoch 0 had served before the switch lays all of it out
    again under the new geometry: the audit (`pipeline verify`) names the source, the epoch
    and both steps, though no window of either layout is drawn twice."""
    forgot = getattr(module, carried)
    monkeypatch.setattr(
        module, carried, lambda layout, counter: (forgot(layout, counter)[0], nothing)
    )
    report = audit(switched(stores), 0, 60)
    assert not report.ok
    mine = [v for v in report.violations if v.startswith(f"source {source} epoch 0: {unit} ")]
    assert mine and all("served twice in an epoch" in v for v in mine)
    assert not any("window" in v and "used again" in v for v in report.violations)
    steps = [int(n) for n in re.search(r"steps (\d+) and (\d+)", mine[0]).groups()]
    assert steps[0] < SWITCH <= steps[1]  # once before the switch, once in the transition


GEOMETRIES = st.tuples(st.sampled_from([16, 32, 48, 64]), st.sampled_from([1, 2, 4]))


@settings(max_examples=15, deadline=None)
@given(first=GEOMETRIES, second=GEOMETRIES, at=st.integers(1, 40), gap=st.integers(1, 30))
def test_verify_passes_any_chain_of_geometry_switches(stores, first, second, at, gap):
    """The audit's cross-layout check never reports a correct plan: two switches to random
    geometries at random steps (mid-epoch or not), audited on 1 and 2 hosts past both."""
    run = Plan.from_config(config(stores))
    plan = Plan(reconcile(run, config(stores, *first), at, switch=True), run.stores())
    plan = Plan(reconcile(plan, config(stores, *second), at + gap, switch=True), run.stores())
    report = audit(plan, 0, at + gap + 40, process_counts=[1, 2])
    assert report.ok, report.violations[:3]


def test_the_steps_before_the_switch_are_unchanged_and_the_ledger_records_version_6(stores):
    run = Plan.from_config(config(stores))
    plan = switched(stores)
    for step in (0, 7, SWITCH - 1):
        for field, values in run.batch(step).items():
            np.testing.assert_array_equal(plan.batch(step)[field], values)
    assert plan.batch(SWITCH)["inputs"].shape == (4, 64)
    assert run.ledger.to_json()["version"] == 3  # a run without one keeps its format
    raw = plan.ledger.to_json()
    assert raw["version"] == 6
    assert plan.ledger.entry(1).endswith(
        "geometry seq_len 32 -> 64, lanes 1 -> 2: the epochs go on, laid out anew"
    )
    raw["version"] = 5  # as a release before geometry changes would have to read it
    with pytest.raises(
        LedgerError,
        match=r"segments\[1\] changes seq_len and lanes, which a ledger of version 5 cannot",
    ):
        Ledger.from_json(raw)


def test_a_restore_that_switches_seq_len_and_lanes_serves_the_plan_and_the_cli_replays_it(
    tmp_path, capsys
):
    """Through a real Orbax checkpoint: saved at step 20 under seq_len 32 on 1 lane, restored
    with `DataRestore(feed, switch=True)` under seq_len 64 on 2 lanes; the feed serves the
    switched plan, and `pipeline dump/verify/stages --ledger` of a later checkpoint replay it."""
    import yaml

    from pipeline.commands.cli import main
    from tests.test_checkpoint import assert_dump_replays, switched_through_orbax

    stores = tmp_path / "stores"
    config_file = tmp_path / "data.yaml"
    config_file.write_text(yaml.safe_dump(geometry_raw(stores, 64, 2)))
    before, after = config(stores), config(stores, 64, 2)
    expected = switched(stores)
    directory = tmp_path / "ckpt"

    def check_stats(feed) -> None:  # the feed's counters, after the steps served
        carried = expected.ledger.segments[1].counters["web"]
        now = expected.segment_plan(1).counters_at(SWITCH + 6)["web"]
        rows = carried * 1 + (now - carried) * 2  # each part in its own lanes and seq_len
        assert feed.stats().ledger_rows["web"] == rows
        assert feed.stats().ledger_tokens["web"] == carried * 32 + (now - carried) * 2 * 64

    served_inputs = switched_through_orbax(
        directory, before, after, SWITCH, expected, 6, check_stats
    )
    step_dir = str(directory / str(SWITCH + 6))
    assert_dump_replays(config_file, step_dir, SWITCH, served_inputs)
    capsys.readouterr()
    assert main(["stages", str(config_file), "--ledger", step_dir]) == 0
    listing = capsys.readouterr().out
    assert (
        "ledger segment from step 20: switch: lanes, seq_len changed; "
        "geometry seq_len 32 -> 64, lanes 1 -> 2" in listing
    )
    assert main(["verify", str(config_file), "--ledger", step_dir, "--steps", "0:60"]) == 0
    assert "ok: no window repeats" in capsys.readouterr().out
    assert main(["epochs", str(config_file), "--ledger", step_dir]) == 0
    rest = expected.segment_plan(1).layouts["web"].transition.windows
    assert f"epoch 0 goes on from the switch: {rest} rows per lane laid out anew" in (
        capsys.readouterr().out
    )
    assert main(["inspect", str(config_file), "--ledger", step_dir, "--step", "21"]) == 0
    shown = capsys.readouterr().out
    web = expected.draws(21)
    row = int(np.flatnonzero(np.asarray(web.source_names)[web.source] == "web")[0])
    start = int(web.start[row])  # a window of the transitional epoch, at its stream position
    assert f"stream tokens {start:,}..{start + 65:,}" in shown


def test_a_skip_with_the_switch_counts_the_skipped_windows_as_served(stores):
    """`switch=True, skip_steps=5`: the old geometry's steps 20..24 are passed over, counted as
    drawn: the rest of the epoch is laid out from what was neither served nor skipped."""
    run = Plan.from_config(config(stores))
    ledger = reconcile(run, config(stores, 64, 2), SWITCH, switch=True, skip=5)
    plan = Plan(ledger, run.stores())
    assert ledger.segments[1].counters == run.segment_plan(0).counters_at(SWITCH + 5)
    skipped = {
        key: grams(found, 2) for key, found in served(run, range(SWITCH, SWITCH + 5)).items()
    }
    after = served(plan, range(SWITCH + 30))  # served before the switch too
    for key, found in after.items():
        pairs = grams(found, 2)
        assert len(pairs) == len(set(pairs)) and not set(pairs) & set(skipped.get(key, [])), key
    assert audit(plan, 0, SWITCH + 30).ok
