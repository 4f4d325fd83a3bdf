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
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.plan import layout as layout_module
from pipeline.plan.ledger import Ledger, MixEntry, quantize
from pipeline.plan.resume import reconcile
from pipeline.read.plan import Plan
from pipeline.version import VERSION_KEY
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


# Golden vectors (docs/compatibility.md): the first steps' batches of one config + ledger per
# kind of data order, and each ledger as pipeline 0.2.0 wrote it. Both are in
# tests/fixtures/golden_orders.json; `python -m tests.test_data_order_golden` re-pins them, which
# is a decision (a new order version, a line in CHANGELOG.md), never a fix for a failing test.
VECTORS = Path(__file__).parent / "fixtures" / "golden_orders.json"
VECTOR_STEPS = 8
CHAT = [[3, 9, 5, 2, 7], [8, 4, 6], [2, 2, 9, 5, 3, 6]]  # best_fit: whole documents, <= 9 tokens
ROOT = "<stores>"  # the stores' directory in the fixture's ledgers
KINDS = ("concat", "best_fit", "mixture", "switch", "skip", "set_mix", "seq_len")


def _raw(directory: Path, **overrides: Any) -> dict[str, Any]:
    sources = {name: {"path": str(directory / name)} for name in SHARDS}
    return {**CONFIG, "sources": sources, **overrides}


def _chat_raw(directory: Path) -> dict[str, Any]:
    chat = {"path": str(directory / "c"), "packing": "best_fit"}
    return _raw(directory, sources={"a": {"path": str(directory / "a")}, "c": chat},
                mix={"a": 1, "c": 1})  # fmt: skip


def _switched(directory: Path, plan: Plan, step: int, skip: int = 0, **overrides: Any) -> Plan:
    config = parse_config(_raw(directory, **overrides), origin="switched.yaml")
    return Plan(reconcile(plan, config, step, switch=bool(overrides), skip=skip), plan.stores())


def _golden_plans(directory: Path) -> dict[str, Plan]:
    """Each kind of data order the suite pins: a config, and a ledger steered at step 3."""
    concat = Plan.from_config(parse_config(_raw(directory), origin="golden.yaml"))
    staged = {key: value for key, value in _raw(directory).items() if key != "mix"}
    ramp = {"linear": {"0": 0, "4": 2}}
    mixture = [{"name": "warm", "steps": 4, "mix": {"a": 1, "b": ramp}},
               {"name": "main", "mix": {"a": 1, "b": {"step": {"0": 1, "6": 3}}}}]  # fmt: skip
    return {
        "concat": concat,
        "best_fit": Plan.from_config(parse_config(_chat_raw(directory), origin="chat.yaml")),
        "mixture": Plan.from_config(parse_config({**staged, "stages": mixture}, origin="mix.yaml")),
        "switch": _switched(directory, concat, 3, mix={"a": 1, "b": 3}),
        "skip": _switched(directory, concat, 3, skip=2),
        "set_mix": Plan(concat.ledger.with_mix(MixEntry(3, quantize({"a": 1, "b": 2})))),
        "seq_len": _switched(directory, concat, 3, seq_len=12),
    }


def _vectors(plans: dict[str, Plan], directory: Path) -> dict[str, Any]:
    def ledger(plan: Plan) -> dict[str, Any]:
        raw = plan.ledger.to_json()
        raw.pop(VERSION_KEY)  # as 0.2.0 wrote it: the version key is the one thing 0.3.0 added
        return json.loads(json.dumps(raw).replace(str(directory), ROOT))

    return {
        name: {
            "batches": [digest(plan.batch(step)) for step in range(VECTOR_STEPS)],
            "ledger": ledger(plan),
        }
        for name, plan in plans.items()
    }


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> tuple[Path, dict[str, Plan]]:
    directory = tmp_path_factory.mktemp("vectors")
    for name, shards in {**SHARDS, "c": CHAT}.items():
        write_synthetic_store(directory / name, shards)
    return directory, _golden_plans(directory)


def test_the_golden_vectors_cover_every_kind_of_order(golden):
    _, plans = golden
    assert set(json.loads(VECTORS.read_text())) == set(plans) == set(KINDS)
    assert plans["best_fit"].segment_plan(0).config.sources[1].packing == "best_fit"
    assert [len(plan.ledger.segments) for plan in plans.values()] == [1, 1, 1, 2, 2, 1, 2]
    assert len(plans["set_mix"].ledger.mixes) == 1
    seq_lens = {plans["seq_len"].batch(step)["inputs"].shape[1] for step in range(3, 8)}
    assert seq_lens == {12}  # the context extension took effect


@pytest.mark.parametrize("kind", KINDS)
def test_batches_match_the_golden_vectors(golden, kind):
    directory, plans = golden
    got = _vectors({kind: plans[kind]}, directory)[kind]
    assert got == json.loads(VECTORS.read_text())[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_a_ledger_written_by_0_2_reads_back_to_the_same_batches(golden, kind):
    """The fixture's ledger, as pipeline 0.2.0 wrote it (no `pipeline_version`), read by this
    release over the same stores: the same segments, and the golden batches."""
    directory, plans = golden
    vector = json.loads(VECTORS.read_text())[kind]
    raw = json.loads(json.dumps(vector["ledger"]).replace(ROOT, str(directory)))
    assert VERSION_KEY not in raw
    ledger = Ledger.from_json(raw, origin=f"{kind}.json")
    assert ledger.segments == plans[kind].ledger.segments
    plan = Plan(ledger, plans[kind].stores())
    assert [digest(plan.batch(step)) for step in range(VECTOR_STEPS)] == vector["batches"]


if __name__ == "__main__":  # re-pin: a change of data order is a decision (see above)
    with tempfile.TemporaryDirectory() as temporary:
        stores = Path(temporary)
        for source, shards in {**SHARDS, "c": CHAT}.items():
            write_synthetic_store(stores / source, shards)
        vectors = _vectors(_golden_plans(stores), stores)
        VECTORS.write_text(json.dumps(vectors, indent=1, sort_keys=True) + "\n")
        print(f"wrote {VECTORS}")
