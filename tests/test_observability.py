"""Provenance fields, feed statistics, input-bound warnings and the Prometheus endpoint."""

from __future__ import annotations

import logging
import re
import socket
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import parse_config
from pipeline.errors import ConfigError, FeedError
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.metrics import PREFIX
from pipeline.feed.stats import Recorder, StepRead
from pipeline.plan.rows import micro_batch_rows
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from tests.feedstores import two_stage_config, two_stage_raw
from tests.test_feed import mesh_of

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE = ["source", "epoch", "window"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("shape", "names", "axes", "grad_accum"),
    [
        ((8,), ("data",), ("data",), 1),
        ((4, 2), ("data", "model"), ("data",), 1),  # replicated over 'model'
        ((2, 2), ("data", "fsdp"), ("data", "fsdp"), 2),
    ],
)
def test_provenance_fields_equal_the_plans_draws(tmp_path, shape, names, axes, grad_accum):
    config = two_stage_config(tmp_path, grad_accum=grad_accum, feed={"provenance": PROVENANCE})
    plan = Plan.from_config(config)
    mesh = mesh_of(shape, names)
    with DataFeed(config, mesh, axes) as feed:
        for step in range(14):  # epoch rollovers and the stage change at step 10
            batch = next(feed)
            assert set(batch) == {*FIELDS, *PROVENANCE}
            for g in range(grad_accum):
                rows = micro_batch_rows(8, grad_accum, g)
                draws = plan.draws(step, rows)
                for name in PROVENANCE:
                    value = np.asarray(batch[name] if grad_accum == 1 else batch[name][g])
                    assert value.dtype == np.int32
                    np.testing.assert_array_equal(value, getattr(draws, name), err_msg=name)
            spec = PartitionSpec(axes) if grad_accum == 1 else PartitionSpec(None, axes)
            assert batch["source"].sharding == NamedSharding(mesh, spec)
            assert batch["source"].shape == batch["inputs"].shape[:-1]
            assert feed.source_names(step) == ("code", "docs")


def test_without_provenance_the_batch_is_the_same_six_fields_bit_for_bit(tmp_path):
    mesh = mesh_of((4,), ("data",))
    plain, extra = two_stage_config(tmp_path), two_stage_config(tmp_path, feed={
        "provenance": PROVENANCE})  # fmt: skip
    with DataFeed(plain, mesh) as a, DataFeed(extra, mesh) as b:
        for _ in range(12):
            left, right = next(a), next(b)
            assert list(left) == list(FIELDS)
            for field in FIELDS:
                assert left[field].dtype == right[field].dtype
                np.testing.assert_array_equal(np.asarray(left[field]), np.asarray(right[field]))
    with DataFeed(extra, mesh, provenance=()) as feed:  # the argument overrides the config
        assert list(next(feed)) == list(FIELDS)


def test_stats_count_what_the_plan_drew(tmp_path):
    config = two_stage_config(tmp_path)
    plan = Plan.from_config(config)
    with DataFeed(config, mesh_of((2,), ("data",)), step=3, prefetch=3) as feed:
        for _ in range(20):
            next(feed)
        stats = feed.stats()
    drawn = np.concatenate([plan.draws(step).source for step in range(3, 23)])
    names = plan.config.source_names
    assert stats.steps == 20 and stats.step == 23 and stats.prefetch == 3
    assert stats.rows == {n: int((drawn == i).sum()) for i, n in enumerate(names)}
    assert stats.tokens == {n: rows * 8 for n, rows in stats.rows.items()}
    layouts = plan.segment_plan(0).layouts
    width = {n: layouts[n].meta.dtype.itemsize for n in names}
    assert stats.bytes_read == {n: rows * 9 * width[n] for n, rows in stats.rows.items()}
    counters = plan.segment_plan(0).counters_at(23)
    assert stats.ledger_rows == {n: c * 2 for n, c in counters.items()}  # 2 lanes
    assert stats.epochs == {n: c // layouts[n].windows_per_lane for n, c in counters.items()}
    assert stats.epochs["docs"] >= 2  # the range crossed rollovers
    assert stats.wait_s.count == stats.read_s.count == stats.next_cpu_s.count == 20
    # the consumer thread's own CPU in next(): some, and never more than its wall time
    assert 0 < stats.next_cpu_s.sum <= stats.wait_s.sum + 0.01
    assert 0 < stats.wait_s.p50 <= stats.wait_s.p99 and stats.wait_s.sum >= stats.last_wait_s
    assert 0 < stats.read_s.p50 <= stats.read_s.p99
    assert 0 <= stats.prefetch_ready <= 3
    assert stats.to_json()["rows"] == stats.rows


def test_a_feed_without_stats_says_so(tmp_path):
    with DataFeed(two_stage_config(tmp_path), mesh_of((2,), ("data",)), stats=False) as feed:
        next(feed)
        with pytest.raises(FeedError, match="stats=False"):
            feed.stats()


def test_one_warning_per_window_of_input_bound_steps(tmp_path, caplog):
    segment = Plan.from_config(two_stage_config(tmp_path)).segment_plan(0)

    def task(started: float, finished: float) -> StepRead:  # 3 code rows, 1 docs row
        return StepRead.counted(segment, np.array([3, 1]), started, finished)

    recorder = Recorder(0, prefetch=2, share=0.25, window=4, warn=True)
    # (next() entered, left) per step; a step is the time between two returns
    timings = [(0.0, 0.1)]  # the first step has no step time: never judged
    timings += [(t, t + 0.05) for t in (0.95, 1.95, 2.95, 3.95)]  # 5% of a 1 s step: fine
    timings += [(t, t + 0.5) for t in (4.5, 5.5, 6.5)]  # 50%: input-bound
    timings += [(7.95, 8.0)]  # the window of steps 5..8 holds 3 bound steps
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        for step, (entered, left) in enumerate(timings):
            recorder.served(step, task(entered - 0.2, entered), entered, left, ready=0)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline"]
    assert lines == [
        "steps 5..8: input-bound on 3 of 4 steps: next() took 500.0 ms of a 1000.0 ms step "
        "(50%, limit 25%), reads 200.0 ms per step, 0 of 2 prefetched steps ready (median of "
        "the input-bound steps); see docs/observability.md"
    ]
    recorder.restart()  # after a seek the gap is no step
    recorder.served(9, task(99.0, 99.1), 100.0, 100.5, ready=0)
    assert recorder._recent == []  # the first step after a restart is not judged
    stats = recorder.snapshot(Plan.from_config(two_stage_config(tmp_path)), 10)
    assert stats.steps == 10 and stats.input_bound_steps == 3
    # one process: the host is its own slowest; its time to batch is the last window's reads
    assert stats.time_to_batch_s == stats.slowest_time_to_batch_s == pytest.approx(0.2)
    assert stats.slowest_process == 0
    assert stats.rows == {"code": 30, "docs": 10} and stats.tokens == {"code": 240, "docs": 80}
    assert stats.read_s.p50 == pytest.approx(0.2) and stats.wait_s.sum == pytest.approx(2.35)
    assert stats.last_wait_s == pytest.approx(0.5)


def test_the_input_bound_share_is_configurable_and_checked(tmp_path):
    config = two_stage_config(tmp_path, feed={"input_bound_share": 0.5, "stats_window": 7})
    assert (config.feed.input_bound_share, config.feed.stats_window) == (0.5, 7)
    bad = [("input_bound_share", 2), ("input_bound_share", -0.1), ("provenance", ["lane"]),
           ("provenance", "source"), ("metrics_port", 0), ("metrics_port", 70000),
           ("metrics_port", None), ("stats_window", 0), ("ready_timeout_s", 0),
           ("ready_timeout_s", True), ("ready_timeout_s", None)]  # fmt: skip
    for key, value in bad:
        with pytest.raises(ConfigError, match=f"feed-test.yaml: feed.{key}: "):
            two_stage_config(tmp_path, feed={key: value})


def documented_metrics() -> set[str]:
    """The metric names in docs/observability.md's table (first column, in backticks)."""
    text = (ROOT / "docs" / "observability.md").read_text()
    return set(re.findall(r"^`(pipeline_feed_\w+)` \|", text, flags=re.MULTILINE))


def scrape(port: int) -> dict[str, list]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_endpoint_serves_the_documented_metrics(tmp_path):
    port = free_port()
    config = two_stage_config(tmp_path, feed={"metrics_port": port, "stats_window": 5})
    with DataFeed(config, mesh_of((2,), ("data",))) as feed:
        for _ in range(12):
            next(feed)
        stats = feed.stats()
        families = scrape(port)
        # the exposition's family names drop `_total`; the documented names are the samples'
        served = {
            sample.name
            for family in families.values()
            if family.name.startswith(PREFIX)
            for sample in family.samples
            if not sample.name.endswith(("_sum", "_count"))
        }
        assert served == documented_metrics()

        def value(name: str, family: str | None = None, **labels: str) -> float:
            family = families[family or name.removesuffix("_total")]
            want = {"process": "0", **labels}
            (sample,) = [s for s in family.samples if s.name == name and s.labels == want]
            return sample.value

        assert value("pipeline_feed_steps_total") == 12
        assert value("pipeline_feed_next_step") == 12
        for source in ("code", "docs"):
            assert value("pipeline_feed_rows_total", source=source) == stats.rows[source]
            assert value("pipeline_feed_tokens_total", source=source) == stats.tokens[source]
            assert value("pipeline_feed_source_epoch", source=source) == stats.epochs[source]
            ledger = value("pipeline_feed_ledger_rows", source=source)
            assert ledger == stats.ledger_rows[source]
        wait = "pipeline_feed_wait_seconds"
        assert value(f"{wait}_count", wait) == 12
        assert value(f"{wait}_sum", wait) == pytest.approx(stats.wait_s.sum)
        assert value(wait, quantile="0.5") == pytest.approx(stats.wait_s.p50)
        cpu = "pipeline_feed_next_cpu_seconds"
        assert value(f"{cpu}_sum", cpu) == pytest.approx(stats.next_cpu_s.sum)
        assert stats.next_cpu_s.sum > 0
        assert value("pipeline_feed_read_seconds", quantile="0.99") > 0
        assert value("pipeline_feed_time_to_batch_seconds") == stats.time_to_batch_s > 0
        assert value("pipeline_feed_slowest_process") == 0  # one process: its own
        assert families["pipeline_feed_wait_seconds"].type == "summary"
        assert families["pipeline_feed_rows"].type == "counter"
    with pytest.raises(OSError):  # closing the feed frees the port
        scrape(port)


def test_a_port_in_use_is_one_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = two_stage_config(tmp_path, feed={"metrics_port": port})
        with pytest.raises(FeedError, match=f"feed.metrics_port {port}: cannot serve metrics"):
            DataFeed(config, mesh_of((2,), ("data",)))


def test_metrics_without_the_extra_name_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    config = parse_config(two_stage_raw(tmp_path, feed={"metrics_port": free_port()}))
    with pytest.raises(FeedError) as info:
        DataFeed(config, mesh_of((2,), ("data",)))
    assert str(info.value) == (
        "feed.metrics_port needs prometheus_client: install the extra pipeline[metrics]"
    )


def test_eval_feeds_serve_six_fields_and_leave_the_port_to_training(tmp_path):
    import dataclasses

    from pipeline.feed.eval_feed import eval_feeds
    from tests.test_eval_feed import config as eval_config

    port = free_port()
    base = eval_config(tmp_path)
    options = dataclasses.replace(base.feed, provenance=("source",), metrics_port=port)
    config = dataclasses.replace(base, feed=options)
    mesh = mesh_of((1,), ("data",))
    with DataFeed(config, mesh) as feed:
        assert set(next(feed)) == {*FIELDS, "source"}
        (held,) = eval_feeds(config, mesh)
        try:
            assert all(set(batch) == set(FIELDS) for batch in held)
        finally:
            held.close()
        assert "pipeline_feed_steps" in scrape(port)
