"""The process's watcher thread (pipeline.feed.watcher): one for all the feeds of a process, and
the coordinator RPCs each real process makes at steady state, counted in the processes."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections import Counter

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from benchmarks.rpc_bench import summarize
from pipeline.feed import host_stop, stragglers, watcher
from pipeline.feed.data_feed import DataFeed
from pipeline.store.token_store import TokenStore
from tests.feedstores import two_stage_config, two_stage_raw
from tests.test_multihost import launch, worker_output

THREAD = "pipeline-feed-watch"


def watchers() -> int:
    return sum(thread.name == THREAD for thread in threading.enumerate())


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), ("data",))


def test_the_feeds_of_a_process_share_one_watcher_thread_that_ends_with_the_last(tmp_path):
    config = two_stage_config(tmp_path)
    before = watchers()
    with DataFeed(config, mesh()) as train, DataFeed(config, mesh(), log_events=False) as other:
        next(train), next(other)
        assert watchers() == before + 1
    deadline = time.monotonic() + 5
    while watchers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watchers() == before


class CollectingLock:
    """A lock that runs the cyclic garbage collector each time it is taken, as Python may at
    any allocation made while a lock is held: the finalizers of forgotten feeds run there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __enter__(self) -> CollectingLock:
        self.lock.acquire()
        gc.collect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_a_feed_forgotten_in_a_cycle_is_let_go_while_the_watchers_locks_are_held(
    tmp_path, monkeypatch
):
    """The collector may finalize a forgotten feed on any thread, also on one inside the
    watcher's locks (the watcher thread's own loop, or another feed's close): nothing waits on
    a lock its own thread holds, and the thread still ends with the last feed."""
    config = two_stage_config(tmp_path)
    before = watchers()
    monkeypatch.setattr(watcher, "_lock", CollectingLock())
    kept = DataFeed(config, mesh())
    kept._host_stop._watcher._feeds_lock = CollectingLock()
    forgotten = DataFeed(config, mesh(), log_events=False)
    next(kept), next(forgotten)
    forgotten.cycle = forgotten  # only the cyclic collector frees it
    del forgotten
    closing = threading.Thread(target=kept.close, daemon=True)
    closing.start()
    closing.join(20)
    assert not closing.is_alive(), "a feed's close waits on the watcher's locks for ever"
    deadline = time.monotonic() + 20
    while watchers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watchers() == before


def test_a_store_two_feeds_share_is_checked_once_a_period(tmp_path, monkeypatch):
    """Both feeds read the same open stores (`shared_stores`): one `check_unchanged` per store
    and period, not one per feed."""
    period = 0.05
    monkeypatch.setenv(host_stop.STORE_CHECK_ENV, str(period))
    checks: Counter[int] = Counter()
    real = TokenStore.check_unchanged

    def counted(store: TokenStore) -> None:
        checks[id(store)] += 1
        real(store)

    monkeypatch.setattr(TokenStore, "check_unchanged", counted)
    config = two_stage_config(tmp_path)
    with DataFeed(config, mesh()) as train, DataFeed(config, mesh(), log_events=False) as other:
        next(train), next(other)  # each opens the stores it draws, at their first draw
        time.sleep(0.3)  # their prefetched steps read (a shard's first use checks it too)
        checks.clear()
        started = time.monotonic()
        time.sleep(1.0)
        elapsed = time.monotonic() - started
    stores = {(s.path, id(s)) for feed in (train, other) for s in feed.plan.stores()}
    assert len({path for path, _ in stores}) == len(stores)  # one store a path: shared
    assert set(checks) == {store for _, store in stores}
    assert 1 <= max(checks.values()) <= elapsed / period + 2, checks


class FakeClient:
    """JAX's coordination client as far as a host other than 0 uses it: what it was set."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        self.values[key] = value


class DirectoryClient(FakeClient):
    """... and as process 0's watcher uses it: directory reads too, each one recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, float]] = []  # (directory, time.monotonic())

    def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
        self.reads.append((directory, time.monotonic()))
        return [(k, v) for k, v in list(self.values.items()) if k.startswith(directory)]


def test_a_host_other_than_0_learns_the_slowest_from_the_verdict_its_stop_poll_reads(
    monkeypatch,
):
    """Host 2 publishes its own figure (one call) and takes process 0's verdict from the stop
    directory it polls anyway; the verdict is no stop."""
    client = FakeClient()
    monkeypatch.setattr(stragglers, "coordination_client", lambda: client)
    monkeypatch.setattr(stragglers.jax, "process_index", lambda: 2)
    peers = stragglers.Peers()
    peers.offer(1, 4, 0.01)
    peers.exchange()
    assert list(client.values.values()) == ["4 0.01"]
    assert peers.slowest == stragglers.Slowest(2, 0.01)
    polled = {f"{stragglers.VERDICT}{peers._lane}": "1 0.3", f"{host_stop.PREFIX}0": "a line"}
    peers.heard(polled)
    assert peers.slowest == stragglers.Slowest(1, 0.3)
    assert host_stop.stopped(polled) == [(0, "a line")]
    peers.offer(5, 8, 0.5)  # now this host is slower than the verdict's
    peers.exchange()
    assert peers.slowest == stragglers.Slowest(2, 0.5)


@pytest.mark.multiprocess
def test_each_process_makes_its_rpcs_off_the_training_thread_within_the_budget(
    tmp_path, monkeypatch
):
    """Three real processes, two feeds each (training and one stepped every other step), the
    key-value calls of each counted in the process (a proxy in place of JAX's client). At
    steady state: none from the training thread; one stop poll per poll period for both feeds;
    only process 0 reads every host's time to batch; the others make at most the stop poll and
    one call per feed (their figure: process 0's verdict comes with the poll) per period."""
    poll = 0.2
    monkeypatch.setenv(host_stop.POLL_ENV, str(poll))
    raw = two_stage_raw(tmp_path / "stores", global_batch_size=12, feed={"stats_window": 5})
    task = {"kind": "rpcs", "steps": 90, "warmup": 15, "pace": 0.04}
    codes = launch(tmp_path, raw, [task], processes=3, devices=1, timeout=300)
    assert codes == [0, 0, 0], worker_output(tmp_path)
    for index in range(3):
        r = summarize(json.loads((tmp_path / f"rpcs-{index}.json").read_text()))
        assert r["seconds"] > 2, r
        assert r["training_thread"] == 0, r
        assert 0.4 / poll <= r["stop_polls"] <= 1 / poll + 2 / r["seconds"], r
        if index:
            assert r["ttb_reads"] == 0, r
            assert r["rpcs"] <= (1 + 2) / poll + 4 / r["seconds"], r
        else:
            assert r["ttb_reads"] > 0, r


def test_process_0_polls_for_stops_while_a_host_never_publishes_its_time_to_batch(
    monkeypatch, caplog
):
    """Process 0 of 3, host 2 silent (stuck): the window's verdict waits `WINDOW_WAIT_S` for
    host 2's figure, then names host 2; meanwhile the watcher thread keeps its stop polls, so
    a stop host 1 publishes is seen within about a poll period, and the feed's close (another
    window open) waits for no figure."""
    client, poll = DirectoryClient(), 0.1
    for module in (watcher, stragglers):
        monkeypatch.setattr(module, "coordination_client", lambda: client)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    caplog.set_level("INFO", logger="pipeline")
    peers = stragglers.Peers()
    figures = f"{stragglers.TIME_TO_BATCH}{peers._lane}/"
    client.values[f"{figures}1"] = "4 0.02"
    feed = watcher.HostStop(lambda: None, host_stop.Periods(poll, 60, 60), peers)
    try:
        offered = time.monotonic()
        peers.offer(1, 4, 0.01)
        deadline = offered + stragglers.WINDOW_WAIT_S + 5
        while peers.slowest.process < 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        judged = time.monotonic()
        polls = [t for d, t in client.reads if d == host_stop.PREFIX and offered <= t <= judged]
        assert len(polls) >= (judged - offered) / poll / 2, (len(polls), judged - offered)
        assert judged - offered >= stragglers.WINDOW_WAIT_S
        assert peers.slowest == stragglers.Slowest(2, 0.0)
        assert client.values[f"{stragglers.VERDICT}{peers._lane}"] == "2 0.0"
        assert (
            "steps 1..4: time to batch 10.0 ms on host 0; slowest host 2: no figure of these "
            "steps within 2 s (missing: host 2; its latest 0.0 ms)"
        ) in caplog.messages

        peers.offer(5, 8, 0.01)  # host 1 stops in this window; host 2 still silent
        time.sleep(3 * poll)
        client.values[f"{host_stop.PREFIX}1"] = "a data error"
        published = time.monotonic()
        while feed.failure is None and time.monotonic() < published + 5:
            time.sleep(0.01)
        assert feed.failure == "host 1: a data error"
        assert time.monotonic() - published < 5 * poll
    finally:
        closing = time.monotonic()
        feed.close()
    assert time.monotonic() - closing < 0.5
    assert caplog.messages[-1].startswith("steps 5..8: time to batch 10.0 ms on host 0; ")
    assert caplog.messages[-1].endswith("; the feed closed before the figure of hosts 1, 2")
