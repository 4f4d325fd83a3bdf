"""Transient read faults are retried and change nothing; persistent ones stop with the file named;
open shard readers stay bounded. The faults come from the real ArrayRecord reader, wrapped."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from jax.sharding import Mesh

import pipeline.store.shard_readers as shard_readers
from pipeline.errors import StoreError
from pipeline.feed.data_feed import DataFeed
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store.retry import RetryPolicy, is_transient
from pipeline.store.token_store import TokenStore
from tests.feedstores import two_stage_config
from tests.storegen import write_synthetic_store

FAST = RetryPolicy(attempts=4, first_delay=0.001, max_delay=0.01)


class FlakyReaders:
    """Opens real readers whose first `fail` reads of each shard raise `error`; counts reads
    that failed and readers alive."""

    def __init__(self, fail: int, error: str = "UNAVAILABLE: injected fault") -> None:
        self.fail, self.error = fail, error
        self.failed: Counter[str] = Counter()
        self.alive = self.most_alive = self.opened = 0

    def __call__(self, path: str, options: str) -> FlakyReader:
        self.alive += 1
        self.opened += 1
        self.most_alive = max(self.most_alive, self.alive)
        return FlakyReader(self, path, ArrayRecordReader(path, options))


class FlakyReader:
    def __init__(self, owner: FlakyReaders, path: str, real: ArrayRecordReader) -> None:
        self.owner, self.path, self.real = owner, path, real

    def read(self, *args):
        if self.owner.failed[self.path] < self.owner.fail:
            self.owner.failed[self.path] += 1
            raise RuntimeError(self.owner.error)
        return self.real.read(*args)

    def num_records(self) -> int:
        return self.real.num_records()

    def close(self) -> None:
        self.owner.alive -= 1
        self.real.close()


def test_transient_faults_are_retried_and_the_batches_are_identical(tmp_path, monkeypatch):
    config = two_stage_config(tmp_path, flat=False)  # every read goes through ArrayRecord
    plan = Plan.from_config(config)
    expected = [plan.batch(step) for step in range(12)]
    readers = FlakyReaders(fail=3)
    monkeypatch.setattr(shard_readers, "ArrayRecordReader", readers)
    with DataFeed(config, Mesh(np.array(jax.devices()[:4]), ("data",))) as feed:
        for want in expected:
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), want[field])
    assert readers.failed and set(readers.failed.values()) == {3}  # every shard read failed 3x


def test_a_persistent_fault_stops_with_one_line_naming_the_file(tmp_path, monkeypatch):
    store = write_synthetic_store(tmp_path / "s", [[5, 7], [9]])
    readers = FlakyReaders(fail=10**9)
    monkeypatch.setattr(shard_readers, "ArrayRecordReader", readers)
    flaky = TokenStore(store.path, retry=FAST)
    with pytest.raises(StoreError) as error:
        flaky.read_tokens(0, 21)
    message = str(error.value)
    assert message == (
        f"{store.shard_file(0)}: cannot read the shard (4 tries): UNAVAILABLE: injected fault"
    )
    assert readers.failed[str(store.shard_file(0))] == 4 and readers.alive == 0


def test_a_permanent_error_is_not_retried(tmp_path, monkeypatch):
    store = write_synthetic_store(tmp_path / "s", [[5, 7]])
    readers = FlakyReaders(fail=10**9, error="Permanent error, status code: 503")
    monkeypatch.setattr(shard_readers, "ArrayRecordReader", readers)
    with pytest.raises(StoreError, match=r"cannot read the shard: Permanent error"):
        TokenStore(store.path, retry=FAST).read_tokens(0, 3)
    assert sum(readers.failed.values()) == 1


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (RuntimeError("UNAVAILABLE: Received HTTP status code: 503"), True),
        (RuntimeError("Retry policy exhausted in ReadObject"), True),
        (ConnectionResetError(104, "reset"), True),
        (TimeoutError(), True),
        (RuntimeError("Permanent error, with a last message of status code: 404"), False),
        (RuntimeError("NOT_FOUND: no such object"), False),
        (ValueError("bad range"), False),
    ],
)
def test_what_counts_as_transient(error, transient):
    assert is_transient(error) is transient


def test_open_readers_are_bounded_and_reads_stay_right(tmp_path: Path, monkeypatch):
    shards = [[3, 4], [5], [6, 1], [2, 2, 2], [7]]
    write_synthetic_store(tmp_path / "s", shards)
    readers = FlakyReaders(fail=0)
    monkeypatch.setattr(shard_readers, "ArrayRecordReader", readers)
    store = TokenStore(tmp_path / "s", max_open_shards=2)
    total = store.num_tokens
    for _ in range(3):
        for shard in (4, 0, 3, 1, 2):
            start = int(store.shard_starts[shard])
            span = store.read_shard_tokens(shard, 0, int(store.shard_tokens[shard]))
            np.testing.assert_array_equal(span.tokens, np.arange(start, start + span.tokens.size))
        assert readers.alive <= 2
    np.testing.assert_array_equal(store.read_tokens(0, total).tokens, np.arange(total))
    assert readers.most_alive == 2
    store.close()
    assert readers.alive == 0
    with pytest.raises(StoreError, match="max_open_shards must be at least 1"):
        TokenStore(tmp_path / "s", max_open_shards=0)
    monkeypatch.setenv("PIPELINE_MAX_OPEN_SHARDS", "3")
    assert TokenStore(tmp_path / "s")._readers.max_open == 3
    monkeypatch.setenv("PIPELINE_MAX_OPEN_SHARDS", "many")
    with pytest.raises(StoreError, match=r"^\$PIPELINE_MAX_OPEN_SHARDS: expected a number"):
        TokenStore(tmp_path / "s")


@pytest.mark.parametrize("flat", [False, True], ids=["array_record", "sidecar"])
def test_the_feed_with_one_open_shard_per_store_gives_the_plans_batches(
    tmp_path, monkeypatch, flat
):
    """Four reader threads keep closing and reopening each other's shards (their readers, or
    their sidecars' maps: a shard served from its sidecar opens no ArrayRecord reader)."""
    config = two_stage_config(tmp_path, flat=flat)
    plan = Plan.from_config(config)
    expected = [plan.batch(step) for step in range(12)]
    readers = FlakyReaders(fail=0)
    monkeypatch.setattr(shard_readers, "ArrayRecordReader", readers)
    monkeypatch.setattr(shard_readers, "MAX_OPEN_SHARDS", 1)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    with DataFeed(config, mesh, threads=4) as feed:
        for want in expected:
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), want[field])
    assert readers.alive == 0
    assert readers.most_alive <= 2 + 4  # one per store, plus one per thread mid-read
    if flat:
        assert readers.opened == 0
    else:
        assert readers.opened > 7  # 7 shards in all: shards were closed and opened again
