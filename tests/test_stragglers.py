"""Stragglers with two real JAX processes (tests/multihost_worker.py, task "straggle"): one
host's reads are slowed, and the feed names it."""

from __future__ import annotations

import json

import pytest

from pipeline.feed import host_stop
from tests.feedstores import two_stage_raw
from tests.test_multihost import launch, worker_output

pytestmark = pytest.mark.multiprocess


def test_a_slow_host_is_named_the_slowest_within_one_stats_window(tmp_path):
    """Host 1's reads take 0.3 s per step, host 0's a few ms: after two windows of 4 steps,
    every host's stats name host 1 as the slowest with about that time, and host 0 logs it (the
    readiness barrier, on, passes: both hosts have their first batch well within its timeout)."""
    raw = two_stage_raw(tmp_path / "stores", feed={"stats_window": 4, "ready_timeout_s": 60})
    task = {"kind": "straggle", "slow": 1, "delay": 0.3, "first_delay": 0.3, "steps": 9}
    codes = launch(tmp_path, raw, [task], processes=2, devices=2)
    assert codes == [0, 0], worker_output(tmp_path)
    stats = [json.loads((tmp_path / f"straggle-{i}.json").read_text()) for i in (0, 1)]
    assert stats[0]["time_to_batch_s"] < 0.1 < 0.25 < stats[1]["time_to_batch_s"]
    for host in stats:  # host 1's latest window as published when each host's window ended
        assert host["slowest_process"] == 1 and host["slowest_time_to_batch_s"] > 0.25
    log = worker_output(tmp_path)
    for window in ("steps 1..4", "steps 5..8"):  # the first window already names host 1
        # host 0's stragglers line; a loaded machine may add an input-bound line of the window
        lines = [line for line in log.splitlines() if line.startswith(f"{window}: time to batch ")]
        assert len(lines) == 1 and "ms on host 0; slowest host 1: " in lines[0], log


def test_a_host_without_a_first_batch_is_named_by_the_readiness_barrier(tmp_path, monkeypatch):
    """Host 1's first read takes 10 minutes; with `feed.ready_timeout_s: 2` host 0 stops after
    2 s with one line naming host 1, and host 1 stops on host 0's published stop, not when its
    read ends (the launch kills both long before: the bound holds however slow the start of
    JAX's processes on a loaded machine)."""
    monkeypatch.setenv(host_stop.POLL_ENV, "0.25")
    monkeypatch.setenv(host_stop.GRACE_ENV, "1")
    raw = two_stage_raw(tmp_path / "stores", feed={"ready_timeout_s": 2})
    task = {"kind": "straggle", "slow": 1, "delay": 0, "first_delay": 600, "steps": 3}
    codes = launch(tmp_path, raw, [task], processes=2, devices=2, timeout=120)
    assert codes == [2, 2], worker_output(tmp_path)
    line = next(
        line for line in worker_output(tmp_path).splitlines() if line.startswith("error: feed.")
    )
    assert line.startswith(
        "error: feed.ready_timeout_s: host 1 of 2 produced no first batch within 2 s of host 0's ("
    ), line
