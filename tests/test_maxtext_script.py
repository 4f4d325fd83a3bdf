"""Helpers of scripts/test_maxtext.py (`make test-maxtext`) that run without MaxText."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import yaml

from pipeline.config import load_config
from pipeline.plan.resume import reconcile
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

ROOT = Path(__file__).resolve().parent.parent


def script():
    spec = importlib.util.spec_from_file_location(
        "test_maxtext_script", ROOT / "scripts" / "test_maxtext.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_planned_targets_are_the_plan_batches_counts_and_follow_a_ledgers_skip(tmp_path):
    """The counts that the MaxText checks compare total_weights with: each step's trained and
    document targets and slots, from the config's plan, or from a ledger's (here with a skip:
    its steps 2.. are the plan's steps 5..)."""
    lengths = [5, 17, 30, 9, 41, 23, 12, 60, 7, 33, 18, 26, 51, 3, 44, 15]
    write_synthetic_store(tmp_path / "docs", [lengths, lengths[::-1]])
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump({
        "seed": 3, "seq_len": 64, "global_batch_size": 2,
        "sources": {"docs": {"path": str(tmp_path / "docs"), "packing": "best_fit"}},
        "mix": {"docs": 1},
    }))  # fmt: skip
    plan = Plan.from_config(load_config(config))
    reconcile(plan, load_config(config), 2, skip=3).save(tmp_path / "ledger.json")
    helper = script()
    python = Path(sys.executable)
    planned = helper.planned_targets(python, config, range(8))
    batches = [plan.batch(step) for step in range(8)]
    assert planned == [
        [int((b["targets_segmentation"] != 0).sum()), int((b["inputs_segmentation"] != 0).sum()),
         b["inputs"].size]
        for b in batches
    ]  # fmt: skip
    assert planned[2:5] != planned[5:8]  # the skip can be told apart
    skipped = helper.planned_targets(python, config, range(2, 5), tmp_path / "ledger.json")
    assert skipped == planned[5:8]
