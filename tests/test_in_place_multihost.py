"""Corpora read in place (Megatron `.bin/.idx`, Parquet token columns) mixed with a prepared
store, through real JAX processes on localhost (tests/test_multihost.py launches them).

Three launches, each reading some steps of the mix, then training: 2 processes train the mix
without the Parquet source and are killed after a checkpoint; 4 processes resume that
checkpoint declaring a switch that adds the Parquet source, and are killed in turn; 1 process
resumes theirs to the end. Expectations come from the single-process `Plan` computed here.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from pipeline.commands.cli import main
from pipeline.config import parse_config
from pipeline.plan.resume import reconcile
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store.columns_index import build_columns_index
from tests.storegen import write_synthetic_store
from tests.test_columns import positional_files, write_parquet
from tests.test_megatron import indexed, random_documents
from tests.test_multihost import (
    expected_weights,
    launch,
    read_log,
    reference_checksums,
    worker_output,
)

pytestmark = pytest.mark.multiprocess

STEPS = [0, 7, 19, 40]  # reached by seeks; every source rolls over an epoch before 40
PROVENANCE = ["source", "epoch", "window"]
TOTAL, EVERY = 24, 4  # the train task: checkpoints every 4 steps
# 2 processes are killed at step 11 (checkpoint 4, maybe 8, complete), 4 processes at 16 (an
# Orbax save waits for the one before: their checkpoint 12 is complete)
KILL_2, KILL_4 = 11, 16
ADDED = "cols"  # the in-place source the declared switch adds to the mix
ITEMSIZE = {"meg": 2, "cols": 4, "store": 4}  # uint16 .bin, int32 column, uint32 store


def mixed_raw(tmp: Path) -> dict:
    """A Megatron source, a Parquet token-column source and a prepared store in one mix."""
    tmp.mkdir()
    meg = indexed(tmp, random_documents(seed=1, count=15), name="meg")  # uint16, EOD 0 ends each
    files, _ = positional_files([[12, 30, 7, 19] * 3, [25, 3, 40] * 3])
    write_parquet(tmp / "cols", files)  # int32 ids
    build_columns_index(tmp / "cols")
    store = write_synthetic_store(tmp / "store", [[7, 30, 11], [25, 5]])
    return {
        "seed": 5, "seq_len": 8, "global_batch_size": 8, "lanes": 2,
        "sources": {
            "meg": {"path": str(meg), "format": "megatron"},
            "cols": {"path": str(tmp / "cols"), "format": "parquet", "column": "input_ids"},
            "store": {"path": str(store.path)},
        },
        "mix": {"meg": 1, "cols": 2, "store": 1},
        "shared_vocabulary": True,
        "feed": {"provenance": PROVENANCE},
    }  # fmt: skip


def test_in_place_sources_serve_the_plan_on_1_2_and_4_processes_and_resume_across_a_switch(
    tmp_path,
):
    raw = mixed_raw(tmp_path / "data")
    before = json.loads(json.dumps(raw))  # the run's first config: the mix without ADDED
    del before["sources"][ADDED], before["mix"][ADDED]
    plan = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
    names = plan.draws(0).source_names
    epochs = {names[s]: 0 for s in range(len(names))}
    for step in range(STEPS[-1]):
        draws = plan.draws(step)
        for s, e in zip(draws.source.tolist(), draws.epoch.tolist(), strict=True):
            epochs[names[s]] = max(epochs[names[s]], e)
    assert min(epochs.values()) >= 1, epochs  # every source crosses an epoch boundary

    # (name, processes, devices each, the train task's config and kill step)
    launches = [
        ("two", 2, 2, {"config": before, "kill_at": KILL_2}),
        ("four", 4, 1, {"switch_to": raw, "kill_at": KILL_4}),  # elastic 2 -> 4, the switch
        ("one", 1, 4, {}),  # elastic 4 -> 1, to the end
    ]
    for name, processes, devices, train in launches:
        read = {"kind": "checksums", "name": name, "mesh": [[4], ["data"]],
                "batch_axes": ["data"], "steps": STEPS, "stats": True}  # fmt: skip
        run = {"kind": "train", "ckpt": str(tmp_path / "ckpt"), "steps": TOTAL,
               "log": str(tmp_path / "train.jsonl"), "save_every": EVERY, "kill_mode": "step",
               **train}  # fmt: skip
        codes = launch(tmp_path, raw, [read, run], processes, devices, timeout=180)
        expected = [-signal.SIGKILL if "kill_at" in train else 0] * processes
        assert codes == expected, (name, worker_output(tmp_path))

    # identical global batches on 1, 2 and 4 processes, equal to the plan, with their provenance
    results = {name: np.load(tmp_path / f"{name}.npz") for name, *_ in launches}
    for step in STEPS:
        expected, draws = plan.batch(step), plan.draws(step)
        for result in results.values():
            for field in FIELDS:
                np.testing.assert_array_equal(result[f"{field}_{step}"], expected[field])
            np.testing.assert_array_equal(result[f"checksum_{step}"], reference_checksums(expected))
            for field in PROVENANCE:
                np.testing.assert_array_equal(result[f"{field}_{step}"], getattr(draws, field))

    # feed.stats(): each process's rows, tokens and bytes per source add up to the steps served
    served = {name: 0 for name in names}
    for step in STEPS:
        for s in plan.draws(step).source.tolist():
            served[names[s]] += 1
    ledger = {name: 0 for name in names}
    for step in range(STEPS[-1] + 1):
        for s in plan.draws(step).source.tolist():
            ledger[names[s]] += 1
    for name, processes, *_ in launches:
        stats = [
            json.loads((tmp_path / f"{name}-stats-{i}.json").read_text()) for i in range(processes)
        ]
        for source in names:
            rows = sum(s["rows"].get(source, 0) for s in stats)
            assert rows == served[source], (name, source)
            assert sum(s["tokens"].get(source, 0) for s in stats) == rows * 8
            assert sum(s["bytes_read"].get(source, 0) for s in stats) == rows * 9 * ITEMSIZE[source]
        for s in stats:
            assert s["step"] == STEPS[-1] + 1
            assert s["ledger_rows"] == ledger, name

    # elastic resumes across the declared switch: every step trained, the replayed ones too, is
    # bit-exactly the plan of the config it ran (the switched plan's from the restored step on)
    entries = read_log(tmp_path / "train.jsonl")
    assert {e["step"] for e in entries} == set(range(TOTAL))
    assert {e["procs"] for e in entries} == {2, 4, 1}
    assert any(e["step"] == KILL_2 and e["procs"] == 2 for e in entries)
    assert any(e["step"] == KILL_4 and e["procs"] == 4 for e in entries)
    switch_at = min(e["step"] for e in entries if e["procs"] == 4)  # the restored steps
    resumed_at = min(e["step"] for e in entries if e["procs"] == 1)
    assert 0 < switch_at < resumed_at  # 1 process resumed a checkpoint 4 processes saved
    first = Plan.from_config(parse_config(before, origin="multihost.yaml"))
    switched = parse_config(raw, origin="switched.yaml")
    trained = Plan(reconcile(first, switched, switch_at, switch=True), first.stores())
    drawn = [trained.draws(step) for step in range(TOTAL)]
    added = [ADDED in {d.source_names[s] for s in d.source.tolist()} for d in drawn]
    assert not any(added[:switch_at]) and any(added[switch_at:])  # the switch served ADDED
    weights = {2: expected_weights(first, TOTAL), 4: expected_weights(trained, TOTAL)}
    for entry in entries:  # 2 processes ran `before` to KILL_2, past the switch
        step, unswitched = entry["step"], entry["procs"] == 2
        sums = reference_checksums((first if unswitched else trained).batch(step))
        np.testing.assert_array_equal(entry["sums"], sums, err_msg=str(entry))
        assert entry["w"] == weights[2 if unswitched else 4][step], entry

    # `pipeline verify --ledger` of the last checkpoint audits both segments
    last = max(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert last >= 20
    config_file = tmp_path / "multihost.yaml"
    config_file.write_text(json.dumps(raw))
    argv = ["verify", config_file, "--ledger", tmp_path / "ckpt" / str(last), "--steps",
            f"0:{TOTAL}"]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
