"""Interventions combined in one ledger (docs/steering.md): geometry switches, skips,
take-downs and set mixes, checked by content on synthetic stores whose every token is its
position in the store, so a row tells which tokens (and documents) it serves."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.plan.resume import reconcile
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

WEB = [[20] * 10, [30] * 8]  # concat: doc k of shard s holds its natural positions


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("combined")
    write_synthetic_store(root / "web", WEB, document_ids=True)
    return root


def web_raw(root: Path, seq_len: int = 8, lanes: int = 1, **source: object) -> dict:
    return {
        "seed": 1, "seq_len": seq_len, "lanes": lanes, "global_batch_size": lanes,
        "sources": {"web": {"path": str(root / "web"), **source}}, "mix": {"web": 1},
    }  # fmt: skip


def window_tokens(plan: Plan, step: int) -> list[tuple[int, np.ndarray]]:
    """(epoch, the seq_len + 1 tokens) of each concat window of `step`."""
    draws, batch = plan.draws(step), plan.batch(step)
    return [
        (int(epoch), np.append(batch["inputs"][i], batch["targets"][i][-1]))
        for i, epoch in enumerate(draws.epoch.tolist())
    ]


def test_dropping_a_concat_exclusion_inside_its_epoch_gives_the_rest_back(root, tmp_path):
    """Taken down at step 5, given back at step 10 in the same epoch: the documents' tokens
    not served before the take-down are served in that epoch (docs/steering.md, Limits: "what
    of them had not been served"), so it leaves out no more than its lane tails."""
    file = tmp_path / "t.txt"
    file.write_text("s0-d3\ns1-d2\n")  # tokens 60..79 and 260..289
    plan = Plan.from_config(parse_config(web_raw(root), origin="a.yaml"))
    taken = parse_config(web_raw(root, exclude=str(file)), origin="b.yaml")
    plan = Plan(reconcile(plan, taken, 5, switch=True))
    plan = Plan(reconcile(plan, parse_config(web_raw(root), origin="c.yaml"), 10, switch=True))
    tokens: Counter = Counter()
    step = 0
    while (rows := window_tokens(plan, step))[0][0] == 0:
        tokens.update(rows[0][1].tolist())
        step += 1
    missing = set(range(sum(map(sum, WEB)))) - set(tokens)
    # the lane tails of the epoch and of each of its two transitional streams: < 3 * (8 + 1)
    assert len(missing) < 27, sorted(missing)
    assert {260, 275, 289} <= set(tokens)  # the document not served before step 5
