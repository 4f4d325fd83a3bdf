"""`feed: {expand: device}`: the six fields built on the devices equal the host path's, bit for bit.

The host path (`Plan.read` -> `Geometry.to_global`) is the reference: for random windows, for
stores with random documents and loss masks under both row layouts, and through the public
feeds (DataFeed, EvalFeed), every field must have the same dtype, shape, sharding and values.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from pipeline import Plan, parse_config
from pipeline.errors import ConfigError
from pipeline.feed import expand
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.eval_feed import eval_feeds
from pipeline.feed.geometry import geometry
from pipeline.read import compact
from pipeline.read.batch import FIELDS, boundaries, fields
from tests.feedstores import two_stage_raw
from tests.storegen import write_synthetic_store
from tests.test_packing import write_masked_store


def data_mesh(shape: tuple[int, ...] = (8,), names: tuple[str, ...] = ("data",)) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def assert_same(host: dict[str, jax.Array], device: dict[str, jax.Array]) -> None:
    """Same names in the same order, and per array the same dtype, shape, sharding, values."""
    assert list(device) == list(host)
    for name, expected in host.items():
        got = device[name]
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), name
        assert got.sharding == expected.sharding, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=name)


@st.composite
def windows(draw):
    """Random int32 windows [rows, seq_len + 1], document starts and untrained target ranges."""
    rows = draw(st.sampled_from([8, 16]))
    seq_len = draw(st.integers(1, 40))
    width = seq_len + 1
    values = st.integers(-(2**31), 2**31 - 1)
    tokens = np.array(draw(st.lists(values, min_size=rows * width, max_size=rows * width)))
    starts = draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, seq_len))))
    spans = draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, seq_len - 1),
                                    st.integers(0, seq_len))))  # fmt: skip
    return tokens.astype(np.int32).reshape(rows, width), starts, spans


@settings(max_examples=60, deadline=None)
@given(windows())
def test_expanded_windows_equal_the_host_fields(example) -> None:
    """Target t of row r, untrained on the host path (segment 0), is token column t + 1's bit."""
    tokens, starts, spans = example
    rows, width = tokens.shape
    seq_len = width - 1
    doc_rows = np.array([r for r, _ in starts], np.int64)
    doc_cols = np.array([c for _, c in starts], np.int64)
    host = fields(tokens, doc_rows, doc_cols)
    host["targets_segmentation"] = host["targets_segmentation"].copy()
    ranges = []
    for row, first, end in spans:
        host["targets_segmentation"][row, first:end] = 0
        ranges.append((row * width + first + 1, row * width + max(first, end) + 1))
    bounds = compact.pack(*boundaries(tokens.shape, doc_rows, doc_cols))
    compact.mark_untrained(bounds, ranges)
    where = geometry(data_mesh(), ("data",), 1, rows, seq_len)
    device = expand.to_global(where, {"tokens": tokens, "bounds": bounds})
    assert_same(where.to_global(host), device)


def read_both(plan: Plan, step: int, where, provenance=()) -> tuple[dict, dict]:
    """Step `step`'s rows of this process through the host path and the device path."""
    draws = plan.draws(step, where.rows)
    extra = {name: v.astype(np.int32) for name, v in draws.provenance(provenance).items()}
    packed = plan.read_compact(draws)
    assert packed is not None
    host = where.to_global({**plan.read(draws), **extra})
    return host, expand.to_global(where, {**packed, **extra})


documents = st.lists(
    st.tuples(st.integers(2, 30), st.integers(0, 12), st.integers(0, 3)), min_size=1, max_size=25
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    shards=st.lists(documents, min_size=1, max_size=3),
    seq_len=st.integers(3, 24),
    packing=st.sampled_from(["concat", "best_fit"]),
    accum=st.sampled_from([1, 2]),
)
def test_random_stores_expand_to_the_host_fields(tmp_path_factory, shards, seq_len, packing, accum):
    """Windows and whole-document rows (padding, truncated documents) of masked stores, on a
    2-D mesh with and without a micro-batch axis, with the provenance fields."""
    store = write_masked_store(tmp_path_factory.mktemp("s") / "store", shards)
    source = {"path": str(store.path), "packing": packing}
    if packing == "best_fit":
        source["too_long"] = "truncate"
    raw = {"seed": 3, "seq_len": seq_len, "global_batch_size": 8, "grad_accum": accum,
           "sources": {"sft": source}, "mix": {"sft": 1}}  # fmt: skip
    try:
        plan = Plan.from_config(parse_config(raw, origin="expand.yaml"))
    except ConfigError:  # too few rows for a batch: nothing to compare
        return
    where = geometry(data_mesh((4, 2), ("data", "model")), ("data",), accum, 8, seq_len)
    for step in (0, 1, 5):
        assert_same(*read_both(plan, step, where, ("source", "epoch", "window")))


def feed_batches(raw: dict, mode: str, mesh: Mesh, steps: list[int], **kwargs) -> list[dict]:
    raw = {**raw, "feed": {**raw.get("feed", {}), "expand": mode}}
    with DataFeed(parse_config(raw, origin="expand.yaml"), mesh, **kwargs) as feed:
        batches = []
        for step in steps:
            if step != feed.step:
                feed.seek(step)
            batches.append(next(feed))
        return batches


def masked_raw(tmp_path: Path, packing: str) -> dict:
    store = write_masked_store(
        tmp_path / packing, [[(3 + i % 13, i % 4, i % 2) for i in range(60)]]
    )
    source = {"path": str(store.path), "packing": packing}
    return {"seed": 5, "seq_len": 12, "global_batch_size": 8, "sources": {"sft": source},
            "mix": {"sft": 1}}  # fmt: skip


CASES = {
    "concat mixture, provenance": lambda tmp: (
        two_stage_raw(tmp),
        {"provenance": ["source", "window"]},
    ),
    "grad_accum": lambda tmp: (two_stage_raw(tmp, global_batch_size=16, grad_accum=2), {}),
    "concat SFT mask": lambda tmp: (masked_raw(tmp, "concat"), {}),
    "best_fit SFT mask": lambda tmp: (masked_raw(tmp, "best_fit"), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_data_feed_batches_are_the_same_on_both_paths(tmp_path: Path, case: str) -> None:
    raw, kwargs = CASES[case](tmp_path)
    mesh = data_mesh((4, 2), ("data", "fsdp"))
    steps = [0, 1, 2, 3, 9, 10, 11, 1000]
    host = feed_batches(raw, "host", mesh, steps, batch_axes=("data", "fsdp"), **kwargs)
    device = feed_batches(raw, "device", mesh, steps, batch_axes=("data", "fsdp"), **kwargs)
    for expected, got in zip(host, device):
        assert_same(expected, got)
    if "SFT" in case:  # the mask reached the batch
        assert any((np.asarray(b["targets_segmentation"]) == 0).any() for b in device)


def test_a_segment_mixing_windows_and_documents_is_read_as_six_fields(tmp_path: Path) -> None:
    raw = two_stage_raw(tmp_path)
    sft = write_masked_store(tmp_path / "sft", [[(3 + i % 9, i % 3) for i in range(40)]])
    raw["sources"]["sft"] = {"path": str(sft.path), "packing": "best_fit"}
    raw["stages"][1]["mix"]["sft"] = 2
    plan = Plan.from_config(parse_config(raw, origin="expand.yaml"))
    assert plan.read_compact(plan.draws(12)) is None  # the host path, the only one here
    mesh = data_mesh()
    for expected, got in zip(
        *(feed_batches(raw, m, mesh, [0, 11, 12]) for m in ("host", "device"))
    ):
        assert_same(expected, got)


def test_eval_batches_are_the_same_on_both_paths(tmp_path: Path) -> None:
    write_synthetic_store(tmp_path / "train", [[50, 30], [40, 40]])
    write_synthetic_store(tmp_path / "held", [[37, 21, 60], [44, 18, 29, 33]])
    raw = {"seed": 2, "seq_len": 7, "global_batch_size": 8, "mix": {"train": 1},
           "sources": {"train": {"path": str(tmp_path / "train")}},
           "eval": {"sources": {"held": {"path": str(tmp_path / "held")}}}}  # fmt: skip
    passes = []
    for mode in ("host", "device"):
        config = parse_config({**raw, "feed": {"expand": mode}}, origin="eval.yaml")
        (feed,) = eval_feeds(config, data_mesh())
        passes.append(list(feed))
        feed.close()
    assert len(passes[0]) == len(passes[1]) > 1
    for expected, got in zip(*passes):
        assert_same(expected, got)


def test_auto_expands_on_accelerators_only(tmp_path: Path) -> None:
    where = geometry(data_mesh(), ("data",), 1, 8, 4)
    assert [expand.on_device(m, where) for m in ("auto", "device", "host")] == [False, True, False]
    config = parse_config(two_stage_raw(tmp_path), origin="expand.yaml")
    assert config.feed.expand == "auto"


@pytest.mark.parametrize("value", ["gpu", "Device", True, 1])
def test_a_bad_expand_mode_is_refused_by_key(tmp_path: Path, value) -> None:
    with pytest.raises(ConfigError, match=r"feed\.expand: expected one of auto, device, host"):
        parse_config(two_stage_raw(tmp_path, feed={"expand": value}), origin="expand.yaml")


def test_a_seq_len_beyond_the_packed_positions_is_read_as_six_fields(tmp_path: Path) -> None:
    write_synthetic_store(tmp_path / "long", [[40_000, 30_000]])
    raw = {"seed": 1, "seq_len": compact.MAX_SEQ_LEN + 1, "global_batch_size": 1,
           "sources": {"long": {"path": str(tmp_path / "long")}}, "mix": {"long": 1}}  # fmt: skip
    plan = Plan.from_config(parse_config(raw, origin="expand.yaml"))
    assert plan.read_compact(plan.draws(0)) is None
    raw["seq_len"] = compact.MAX_SEQ_LEN
    plan = Plan.from_config(parse_config(raw, origin="expand.yaml"))
    where = geometry(data_mesh((1,)), ("data",), 1, 1, compact.MAX_SEQ_LEN)
    assert_same(*read_both(plan, 0, where))


EXPAND_STEPS = [0, 1, 7, 1000]


@pytest.fixture(scope="module")
def expanded_on_two_processes(tmp_path_factory) -> tuple[dict[str, dict], Path]:
    """One launch of 2 processes (2 devices each) that feeds each packing's masked config with
    `feed: {expand: device}`, a checksums task each: the configs by packing, and the directory
    holding each task's batches (<packing>.npz)."""
    from tests.test_multihost import launch, worker_output

    out = tmp_path_factory.mktemp("expand")
    raws = {
        packing: {**masked_raw(out / "stores", packing), "feed": {"expand": "device"}}
        for packing in ("concat", "best_fit")
    }
    tasks = [
        {"kind": "checksums", "name": packing, "config": raw, "mesh": [[4], ["data"]],
         "batch_axes": ["data"], "steps": EXPAND_STEPS}
        for packing, raw in raws.items()
    ]  # fmt: skip
    codes = launch(out, raws["concat"], tasks, 2, 2)
    assert codes == [0, 0], worker_output(out)
    return raws, out


@pytest.mark.multiprocess
@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_two_processes_expand_to_the_plans_fields(expanded_on_two_processes, packing: str) -> None:
    """Each process transfers its rows' compact form and expands them under a sharding that
    spans both processes (`make_array_from_process_local_data`, then one jit)."""
    raws, out = expanded_on_two_processes
    plan = Plan.from_config(parse_config(raws[packing], origin="multihost.yaml"))
    result = np.load(out / f"{packing}.npz")
    for step in EXPAND_STEPS:
        expected = plan.batch(step)
        for field in FIELDS:
            np.testing.assert_array_equal(result[f"{field}_{step}"], expected[field])
    assert any((plan.batch(step)["targets_segmentation"] == 0).any() for step in EXPAND_STEPS)


def test_a_transitional_epoch_expands_to_the_host_fields(tmp_path: Path) -> None:
    """After a declared switch of seq_len and lanes, windows join stretches apart in the
    store (`plan.transition`): each joint starts a document in the compact form too."""
    from pipeline.store.token_store import TokenStore
    from tests.test_transition import plan_of

    store = write_synthetic_store(tmp_path / "s", [[30, 11, 19, 25], [40, 13, 60]])
    drawn, switched = plan_of(store.path, [store.meta], [(9, 2), (6, 3)], [0.5], "concat")
    plan = Plan(drawn.ledger, [TokenStore(store.path)])
    for step in range(switched - 1, switched + 12):
        seq_len = plan.segment_plan(plan.draws(step).segment_index).config.seq_len
        rows = plan.draws(step).rows.size
        assert_same(*read_both(plan, step, geometry(data_mesh((1,)), ("data",), 1, rows, seq_len)))


def test_a_restored_feed_keeps_the_runtime_settings_of_the_config_in_force(
    tmp_path: Path, caplog
) -> None:
    """The ledger records no `feed:` settings: after a restore (the Orbax item's and the
    MaxText adapter's path alike, `restore_state`), `expand: device` still expands on the
    devices and `verify: off` still reads unchecked; the feed says once which form it uses."""
    import logging

    from pipeline.feed.restore import current_state, restore_state

    raw = two_stage_raw(tmp_path, feed={"expand": "device", "verify": "off"})
    config = parse_config(raw, origin="expand.yaml")
    with caplog.at_level(logging.INFO, logger="pipeline"), DataFeed(config, data_mesh()) as feed:
        for _ in range(3):
            next(feed)
        state = current_state(feed)
    said = "transfers the rows' compact form, the devices build the six fields (feed.expand: "
    assert [said + "device, cpu devices)" in r.getMessage() for r in caplog.records].count(
        True
    ) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipeline"), DataFeed(config, data_mesh()) as feed:
        restore_state(feed, state)
        assert feed.expands_on_device and not feed.plan.check_reads
        fresh = Plan.from_config(config)
        np.testing.assert_array_equal(np.asarray(next(feed)["inputs"]), fresh.batch(3)["inputs"])
    (start,) = [r.getMessage() for r in caplog.records if "feed starts at step 3" in r.getMessage()]
    assert start.endswith(said + "device, cpu devices)")
