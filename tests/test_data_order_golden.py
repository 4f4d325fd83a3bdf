"""The data order, pinned: exact shard and window orders and batch checksums of a fixed setup.

Any change of which tokens a step gets (the permutations, the layout, the mixing, the reading)
fails here. If the change is intended, it is a new data order: bump
`pipeline.plan.ledger.ORDER_VERSION`, say so in docs/data-plan.md ("Order versions"), and
re-pin these values. The inputs are fixed content only: synthetic stores whose token i is
position i of the store, written by the project's writer into a temporary directory (the path
is not part of the order).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.plan import layout as layout_module
from pipeline.read.plan import Plan
from tests.storegen import write_synthetic_store

SHARDS = {  # document lengths per shard
    "a": [[30, 7, 12], [25], [9, 9, 9, 20], [40, 3]],  # 164 tokens: 10 windows per lane
    "b": [[50, 11], [33, 17, 6]],  # 117 tokens: 7 windows per lane
}
CONFIG = {
    "seed": 1234,
    "seq_len": 8,
    "global_batch_size": 4,
    "lanes": 2,
    "mix": {"a": 3, "b": 1},
}

SHARD_ORDERS = {("a", 0): [2, 0, 3, 1], ("a", 1): [0, 3, 1, 2], ("b", 0): [0, 1]}
WINDOW_ORDERS = {  # (source, epoch, lane): the windows of that lane's epoch, in draw order
    ("a", 0, 0): [9, 4, 8, 3, 5, 1, 2, 7, 0, 6],
    ("a", 1, 1): [7, 5, 3, 1, 6, 2, 0, 8, 4, 9],
    ("b", 2, 1): [1, 0, 4, 3, 5, 6, 2],
}
BATCHES = {  # step: sha256 of the six fields of all 4 rows (2 lanes), see `digest`
    0: "d9e10ce2164dbda508a777c0f45455f101beee75816f11c34898db568b11b830",
    6: "9485dc5cb4898da0ae7b50fe63844e930085abba76fdef5a9ab0c5b7c398a988",  # a: epochs 0 and 1
    15: "814e7adb37b399f73849d0ab96339bdb93f17c4e7b980c46187a50a2553a7c9c",  # b: epoch 1
    10**6: "f509379307e8b52683e16c861eecda81771a77ccd319c15d58a0428897980516",
}


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> Plan:
    directory = tmp_path_factory.mktemp("golden")
    for name, shards in SHARDS.items():
        write_synthetic_store(directory / name, shards)
    raw = {**CONFIG, "sources": {name: {"path": str(directory / name)} for name in SHARDS}}
    return Plan.from_config(parse_config(raw, origin="golden.yaml"))


@pytest.fixture(params=["cached orders", "every draw on its own"])
def small_domain(request, monkeypatch):
    """Both ways `SourceLayout` computes a window order (whole and cached, or per draw)."""
    if request.param == "every draw on its own":
        monkeypatch.setattr(layout_module, "SMALL_DOMAIN", 0)


def digest(batch: dict[str, np.ndarray]) -> str:
    """sha256 over the fields in name order: name, then the values as little-endian int32."""
    sha = hashlib.sha256()
    for name in sorted(batch):
        sha.update(name.encode())
        sha.update(np.ascontiguousarray(batch[name], dtype="<i4").tobytes())
    return sha.hexdigest()


def test_shard_orders_are_pinned(plan):
    layouts = plan.segment_plan(0).layouts
    got = {(s, e): layouts[s].shard_order(e).tolist() for s, e in SHARD_ORDERS}
    assert got == SHARD_ORDERS


def test_window_orders_are_pinned(plan, small_domain):
    layouts = plan.segment_plan(0).layouts
    got = {}
    for source, epoch, lane in WINDOW_ORDERS:
        w = layouts[source].windows_per_lane
        counters = np.arange(epoch * w, (epoch + 1) * w)
        got[source, epoch, lane] = layouts[source].epoch_and_window(counters, lane)[1].tolist()
    assert got == WINDOW_ORDERS


def test_batches_are_pinned(plan, small_domain):
    got = {}
    for step in BATCHES:
        batch = plan.batch(step)
        assert all(value.shape == (4, 8) for value in batch.values())
        got[step] = digest(batch)
    assert got == BATCHES


def test_the_pinned_steps_cover_rollovers_and_both_lanes(plan):
    step6, step15 = plan.draws(6), plan.draws(15)
    assert step6.lane.tolist() == [0, 0, 1, 1]
    assert step6.source.tolist() == [0, 0, 0, 0] and step6.epoch.tolist() == [0, 1, 0, 1]
    assert (1, 1) in set(zip(step15.source.tolist(), step15.epoch.tolist()))
