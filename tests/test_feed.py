"""The JAX feed on 8 forced CPU devices: global batches equal the plan's, on any mesh."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pipeline.errors import FeedError, StoreError
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.readers import Readers
from pipeline.plan.rows import micro_batch_rows
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.feedstores import two_stage_config
from tests.storegen import arrayrecord_only


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    count = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)


def assert_batch(batch: dict, expected: dict) -> None:
    assert set(batch) == set(FIELDS)
    for field in FIELDS:
        np.testing.assert_array_equal(np.asarray(batch[field]), expected[field], err_msg=field)


def feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipeline-feed")]


def reader_threads() -> int:
    """The live feeds' reader threads (`pipeline-feed-0`..; not the host-stop watch)."""
    return sum(t.name.removeprefix("pipeline-feed-").isdigit() for t in threading.enumerate())


@pytest.fixture
def config(tmp_path: Path):
    return two_stage_config(tmp_path)


def test_there_are_eight_devices():
    assert jax.device_count() == 8, "tests/conftest.py forces 8 CPU devices"


@pytest.mark.parametrize(
    ("shape", "names", "axes"),
    [
        ((8,), ("data",), ("data",)),
        ((4, 2), ("data", "fsdp"), ("data", "fsdp")),
        ((2, 4), ("fsdp", "data"), ("data", "fsdp")),
        ((4, 2), ("data", "model"), ("data",)),  # replicated over 'model'
        ((1,), ("data",), ("data",)),
    ],
)
def test_batches_equal_the_plan_on_any_mesh(config, shape, names, axes):
    plan = Plan.from_config(config)
    mesh = mesh_of(shape, names)
    with DataFeed(config, mesh, axes) as feed:
        for step in range(14):  # crosses epoch rollovers and the stage change at step 10
            assert feed.step == step
            batch = next(feed)
            assert_batch(batch, plan.batch(step))
            for field in FIELDS:
                assert batch[field].shape == (8, 8)
                assert batch[field].sharding == NamedSharding(mesh, PartitionSpec(axes, None))


@pytest.mark.parametrize("flat", [True, False])
def test_batches_equal_the_arrayrecord_plan_with_and_without_sidecars(tmp_path, flat):
    """The feed's stores with flat sidecars (or without) give the batches ArrayRecord gives."""
    expected = arrayrecord_only(Plan.from_config(two_stage_config(tmp_path / "reference")))
    config = two_stage_config(tmp_path / "feed", flat=flat)
    with DataFeed(config, mesh_of((4, 2), ("data", "fsdp")), ("data", "fsdp")) as feed:
        assert all(
            ("flat" in s) == flat for st in feed.plan.stores() for s in st.manifest["shards"]
        )
        for step in range(14):
            assert_batch(next(feed), expected.batch(step))


def test_grad_accum_adds_a_micro_batch_axis(tmp_path):
    config = two_stage_config(tmp_path, grad_accum=2)
    plan = Plan.from_config(config)
    mesh = mesh_of((2, 2), ("data", "fsdp"))
    with DataFeed(config, mesh, ("data", "fsdp")) as feed:
        for step in range(3):
            batch = next(feed)
            for field in FIELDS:
                assert batch[field].shape == (2, 4, 8)
                assert batch[field].sharding.spec == PartitionSpec(None, ("data", "fsdp"), None)
            for g in range(2):
                expected = plan.batch(step, micro_batch_rows(8, 2, g))
                for field in FIELDS:
                    np.testing.assert_array_equal(np.asarray(batch[field][g]), expected[field])


RAMP = {"step": {0: 4, 3: 8, 6: 16, 9: 8}}


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_batch_ramp_yields_each_steps_shape_and_resumes_at_any_step(tmp_path, grad_accum):
    config = two_stage_config(tmp_path, global_batch_size=RAMP, grad_accum=grad_accum)
    plan = Plan.from_config(config)
    mesh = mesh_of((2,), ("data",))
    sizes = [4, 4, 4, 8, 8, 8, 16, 16, 16, 8, 8]
    with DataFeed(config, mesh, prefetch=3) as feed:
        for step, size in enumerate(sizes):
            shape = (size, 8) if grad_accum == 1 else (2, size // 2, 8)
            assert feed.shape() == shape
            batch = next(feed)
            assert batch["inputs"].shape == shape
            expected = plan.batch(step)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]).reshape(size, 8),
                                              expected[field])  # fmt: skip
        for step in (8, 0, 6, 3, 10, 10**5):  # a resumed run: any step, in any order
            feed.seek(step)
            assert_batch(
                {k: np.asarray(v).reshape(-1, 8) for k, v in next(feed).items()},
                plan.batch(step),
            )


def test_a_scheduled_batch_the_mesh_cannot_split_stops_before_step_0(tmp_path):
    config = two_stage_config(tmp_path, global_batch_size={"step": {0: 8, 5: 12}})
    with pytest.raises(
        FeedError,
        match=r"split the batch 8 ways, which does not divide "
        r"global_batch_size \(12 rows",
    ):
        DataFeed(config, mesh_of((8,), ("data",)))  # fmt: skip


def test_seek_is_a_jump_to_any_step(config):
    plan = Plan.from_config(config)
    with DataFeed(config, mesh_of((4,), ("data",)), prefetch=3) as feed:
        next(feed)
        feed.seek(25)
        assert feed.step == 25
        assert_batch(next(feed), plan.batch(25))
        feed.seek(3)
        assert_batch(next(feed), plan.batch(3))
        assert_batch(next(feed), plan.batch(4))
        feed.seek(10**6)
        assert_batch(next(feed), plan.batch(10**6))
    with DataFeed(config, mesh_of((4,), ("data",)), step=12) as feed:
        assert_batch(next(feed), plan.batch(12))


def test_results_do_not_depend_on_prefetch_or_threads(config):
    mesh = mesh_of((2, 2), ("data", "fsdp"))
    runs = []
    for prefetch, threads in ((1, 1), (3, 2), (6, 8), (2, "auto"), (4, 4)):
        with DataFeed(config, mesh, ("data", "fsdp"), prefetch=prefetch, threads=threads) as feed:
            runs.append([{k: np.asarray(v) for k, v in next(feed).items()} for _ in range(12)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert_batch(b, a)


def test_local_stores_get_one_reader_thread_by_default_and_integers_are_kept(config, caplog):
    """`threads: auto` (the default) reads local stores with one thread whatever the
    prefetch; an explicit count keeps today's min(threads, prefetch). The start line says so."""
    mesh = mesh_of((2,), ("data",))
    assert config.feed.threads == "auto" and reader_threads() == 0
    for threads, prefetch, expected in (("auto", 4, 1), (None, 2, 1), (3, 4, 3), (4, 2, 2)):
        with (
            caplog.at_level(logging.INFO, logger="pipeline"),
            DataFeed(config, mesh, prefetch=prefetch, threads=threads) as feed,
        ):
            next(feed)
            assert (feed.reader_threads, reader_threads()) == (expected, expected)
        requested = "auto" if threads is None else threads
        assert f"; reader threads {expected} (threads: {requested})" in caplog.text
        caplog.clear()
    assert reader_threads() == 0


@pytest.mark.parametrize("threads", [0, -1, "Auto", "two", 2.0, True])
def test_a_bad_thread_count_is_refused(config, threads):
    message = r"^DataFeed threads: expected an integer from 1 to 1,024 or auto"
    with pytest.raises(FeedError, match=message):
        DataFeed(config, mesh_of((2,), ("data",)), threads=threads)


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ({"threads": 0}, "DataFeed threads: expected"),
        ({"prefetch": 0}, "DataFeed prefetch: expected"),
        ({"threads": 1025}, "DataFeed threads: expected an integer from 1 to 1,024 or auto"),
        ({"prefetch": 10**6}, "DataFeed prefetch: expected an integer from 1 to 1,024, got"),
        ({"provenance": ["nope"]}, "provenance: expected names"),
        ({"batch_axes": "model"}, "batch_axes ('model',): each must be"),
    ],
)
def test_a_bad_argument_is_refused_before_any_store_is_acquired(
    config, monkeypatch, argument, message
):
    """A refused feed holds nothing: its stores are only released when it is collected."""
    from pipeline.feed import shared_stores

    acquired = []
    monkeypatch.setattr(shared_stores, "acquire", lambda path: acquired.append(path))
    with pytest.raises(FeedError) as info:
        DataFeed(config, mesh_of((2,), ("data",)), **argument)
    assert str(info.value).startswith(message) and acquired == []


def test_state_is_small_json(config):
    import json

    with DataFeed(config, mesh_of((2,), ("data",))) as feed:
        next(feed)
        next(feed)
        state = feed.state()
    assert state["step"] == 2
    assert json.loads(json.dumps(state)) == state
    assert len(json.dumps(state)) < 4096


def test_close_joins_every_thread_and_is_idempotent(config):
    before = feed_threads()
    feed = DataFeed(config, mesh_of((2,), ("data",)), prefetch=4, threads=3)
    next(feed)
    assert len(feed_threads()) > len(before)
    feed.close()
    feed.close()
    assert feed_threads() == before
    with pytest.raises(FeedError, match="closed"):
        next(feed)


def test_reader_threads_hand_steps_over_by_step_and_drop_what_a_seek_left():
    """Steps are taken by number whatever order they finish in; a step handed out before a
    drop (a seek) is thrown away even when it finishes after; a task's error is re-raised."""
    slow, stale = threading.Event(), threading.Event()
    readers = Readers(2, "pipeline-feed-test")
    try:
        readers.submit(0, lambda: slow.wait(10) and "step 0")
        readers.submit(1, lambda: "step 1")
        while not readers.done(1):  # the second thread finishes first
            time.sleep(0.005)
        assert not readers.done(0)
        slow.set()
        assert (readers.take(0), readers.take(1)) == ("step 0", "step 1")
        readers.submit(2, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            readers.take(2)
    finally:
        readers.close()
    started, fresh = threading.Event(), threading.Event()

    def after_the_seek() -> str:
        started.set()
        fresh.wait(10)
        return "after the seek"

    one = Readers(1, "pipeline-feed-test")  # one thread: the stale task runs first
    try:
        one.submit(3, lambda: stale.wait(10) and "before the seek")
        one.drop()
        one.submit(3, after_the_seek)
        stale.set()
        started.wait(10)  # the stale task has ended: its result was thrown away
        assert not one.done(3)
        fresh.set()
        assert one.take(3) == "after the seek"
    finally:
        one.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-feed-test")]


def test_the_arrays_a_step_served_are_let_go_of_in_a_reader_thread(config):
    """The feed holds the last step's arrays until a reader thread has read the next step
    handed out and lets go of them there: once the trainer has dropped them, JAX frees their
    buffers in that thread, not the training thread. Closing the feed lets go of them too."""
    freed: list[str] = []

    def watch(batch: dict) -> None:
        for array in batch.values():
            weakref.finalize(array, lambda: freed.append(threading.current_thread().name))

    with DataFeed(config, mesh_of((2,), ("data",)), prefetch=2) as feed:
        watch(next(feed))  # the trainer has dropped step 0's arrays: the feed holds them
        assert not freed
        next(feed)
        deadline = time.monotonic() + 10
        while len(freed) < len(FIELDS) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(freed) == len(FIELDS)
        assert all(name.startswith("pipeline-feed-") for name in freed), freed
        watch(next(feed))
    assert len(freed) == 2 * len(FIELDS)


def test_a_feed_never_closed_exits_quietly(tmp_path):
    """A forgotten feed is shut down at interpreter exit without an 'Exception ignored'."""
    program = (
        "import jax, numpy as np, pathlib\n"
        "from jax.sharding import Mesh\n"
        "from pipeline.feed.data_feed import DataFeed\n"
        "from tests.feedstores import two_stage_config\n"
        f"config = two_stage_config(pathlib.Path({str(tmp_path)!r}))\n"
        "feed = DataFeed(config, Mesh(np.array(jax.devices()[:1]), ('data',)), prefetch=4)\n"
        "next(feed)\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, cwd=root, env=env
    )
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


@pytest.mark.parametrize("damage", ["garbage", "delete"])
def test_a_reader_failure_surfaces_in_next_with_its_cause(config, damage):
    """Only the docs source is damaged: the error names it by its config key, as at open."""
    feed = DataFeed(config, mesh_of((2,), ("data",)), prefetch=2, threads=2)
    try:
        store = feed.plan.store(feed.plan.segment_plan(0).layouts["docs"].meta)
        for shard in range(store.num_shards):
            for name in ("file", "flat"):  # what the shard is read from too: its sidecar
                path = store.path / store.manifest["shards"][shard][name]
                if damage == "delete":
                    path.unlink()
                else:
                    path.write_bytes(b"\x5a" * path.stat().st_size)
        with pytest.raises(FeedError, match="step 0: cannot read the batch") as info:
            next(feed)
        assert isinstance(info.value.__cause__, StoreError)
        key = f"feed-test.yaml: sources.docs.path: {store.path}/shard-0000"
        assert key in str(info.value)
    finally:
        feed.close()
    assert feed_threads() == []


@pytest.mark.parametrize(
    ("shape", "names", "axes", "message"),
    [
        ((3,), ("data",), ("data",), "data=3"),
        ((3, 2), ("data", "fsdp"), ("data", "fsdp"), "data=3 x fsdp=2"),
        ((2,), ("data",), ("fsdp",), "mesh axes: data=2"),
    ],
)
def test_a_mesh_that_does_not_divide_the_batch_is_refused(config, shape, names, axes, message):
    with pytest.raises(FeedError, match=message):
        DataFeed(config, mesh_of(shape, names), axes)


def test_grad_accum_micro_batch_must_divide_over_the_mesh(tmp_path):
    config = two_stage_config(tmp_path, grad_accum=4)
    with pytest.raises(FeedError, match="micro-batch of 2 rows"):
        DataFeed(config, mesh_of((4,), ("data",)))


def test_events_are_logged_once(config, caplog):
    with (
        caplog.at_level(logging.INFO, logger="pipeline"),
        DataFeed(config, mesh_of((2,), ("data",))) as feed,
    ):
        for _ in range(13):
            next(feed)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline"]
    assert lines[0].startswith("feed starts at step 0: stage warmup")
    assert lines.count("step 10: stage main starts") == 1
    assert any("starts epoch 1" in line for line in lines)


def test_a_feed_without_the_event_log_serves_the_same_batches_and_logs_none(config, caplog):
    """`log_events=False` (the eval feed's): the readers skip the log's work, not the rows."""
    mesh = mesh_of((2,), ("data",))
    with DataFeed(config, mesh) as feed:
        expected = [np.asarray(next(feed)["inputs"]) for _ in range(13)]
    caplog.clear()
    with (
        caplog.at_level(logging.INFO, logger="pipeline"),
        DataFeed(config, mesh, log_events=False) as feed,
    ):
        for step in range(13):  # across step 10's stage start and an epoch rollover
            np.testing.assert_array_equal(next(feed)["inputs"], expected[step])
    assert [r.getMessage() for r in caplog.records if r.name == "pipeline"] == []


def test_sources_join_and_leave_when_their_share_starts_and_stops(tmp_path, caplog):
    stages = [
        {"name": "ramp", "steps": 5, "mix": {"code": 1, "docs": {"linear": {0: 0, 5: 1}}}},
        {"name": "rare", "steps": 10, "mix": {"code": 15, "docs": 1}},
        {"name": "code", "mix": {"code": 1}},
    ]
    config = two_stage_config(tmp_path, stages=stages)
    plan = Plan.from_config(config)
    docs = config.source_names.index("docs")
    skipped = [s for s in range(5, 15) if not (plan.draws(s).source == docs).any()]
    assert skipped, "docs must be absent from some steps of 'rare' for this test to bite"
    with (
        caplog.at_level(logging.INFO, logger="pipeline"),
        DataFeed(config, mesh_of((2,), ("data",))) as feed,
    ):
        for _ in range(20):
            next(feed)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline"]
    changes = [line for line in lines if "joins" in line or "leaves" in line]
    assert changes == [
        "step 1: source docs joins the mixture",
        "step 15: source docs leaves the mixture",
    ]
    assert any("source code starts epoch" in line for line in lines)
