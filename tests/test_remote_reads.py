"""gs:// stores read through `remote_reads` and the host cache, against the GCS emulator behind
a proxy that counts (and delays) every request (tests/gcs_proxy.py). Nothing here is a mock."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import numpy as np
import pytest
import yaml
from array_record.python.array_record_module import ArrayRecordWriter
from jax.sharding import Mesh

from pipeline.config import parse_config
from pipeline.errors import ConfigError, FeedError, PipelineError, StoreError
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.fetch_ahead import FetchAhead
from pipeline.plan.sources import plan_stores
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store import token_store
from pipeline.store.block_cache import BlockCache
from pipeline.store.formats import open_store
from pipeline.store.meta import load_manifest
from pipeline.store.remote_reads import forget, together
from pipeline.store.remote_shards import OPEN_TRIES
from pipeline.store.shard_readers import Vanished, open_reader
from pipeline.urls import copy_file, location, object_version
from tests.gcs_proxy import fresh_clients, proxied
from tests.storegen import write_synthetic_store

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "remote_feed_worker.py"
_first = itertools.count(1)  # each store's tokens differ: no process holds its blocks yet


@pytest.fixture(scope="module")
def proxy(gcs_bucket):
    """The proxy in front of the session's emulator, for this module."""
    with proxied(os.environ["STORAGE_EMULATOR_HOST"]) as log:
        yield gcs_bucket, log


def store(
    tmp_path: Path,
    bucket: str,
    name: str,
    shards: int = 4,
    flat: bool = True,
    documents: int = 300,
    records: bool = True,
) -> tuple[Path, str]:
    """A store of `shards` shards of `documents` documents (~1.1 MB of tokens at 4 x 300),
    written locally and uploaded to `bucket`; without flat token sidecars unless `flat` (as
    `prepare --no-flat-tokens` writes it), without its ArrayRecord files unless `records`."""
    rng = np.random.default_rng(0)
    local = tmp_path / name
    lengths = [rng.integers(50, 400, documents).tolist() for _ in range(shards)]
    write_synthetic_store(local, lengths, first=next(_first) * 10**6, flat=flat)
    url = f"{bucket}/{name}-{os.getpid()}-{time.monotonic_ns()}"
    for file in local.iterdir():
        if records or not file.name.endswith(".array_record"):
            copy_file(file, location(url) / file.name)
    return local, url


def raw_config(path: str, **feed) -> dict:
    raw = {"seed": 1, "seq_len": 64, "global_batch_size": 8, "mix": {"web": 1}}
    return {**raw, "sources": {"web": {"path": str(path)}}, **({"feed": feed} if feed else {})}


def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("data",))


def sidecar_bytes(local: Path) -> int:
    return sum(f.stat().st_size for f in local.glob("*.flat.bin"))


def test_a_cold_feed_downloads_each_block_it_serves_once(tmp_path, proxy):
    bucket, log = proxy
    local, url = store(tmp_path, bucket, "cold")
    expected = Plan.from_config(parse_config(raw_config(local), origin="local.yaml"))
    log.clear()
    with DataFeed(parse_config(raw_config(url), origin="remote.yaml"), mesh()) as feed:
        for step in range(60):
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), expected.batch(step)[field])
        stats = feed.stats()
    blocks = [r.path for r in log.requests if ".flat.bin" in r.path]
    assert blocks and len(blocks) == len(set(blocks))  # each (object, range) once
    assert not [r for r in log.requests if ".array_record" in r.path]  # ArrayRecord: ~50x
    metadata = sum(f.stat().st_size for f in local.iterdir() if not f.name.endswith(".bin"))
    downloaded = log.downloaded()
    assert downloaded <= 2 * sidecar_bytes(local) + 2 * metadata  # was ~50x the whole store
    assert stats.downloaded_per_token > 0 and stats.downloaded_bytes >= downloaded // 2


def mixture(urls: list[str], **feed) -> dict:
    """A config mixing the stores at `urls` equally."""
    raw = raw_config(urls[0], **feed)
    raw["sources"] = {f"s{k}": {"path": url} for k, url in enumerate(urls)}
    raw["mix"] = {f"s{k}": 1 for k in range(len(urls))}
    return raw


@pytest.fixture(scope="module")
def many(tmp_path_factory, gcs_bucket) -> list[str]:
    """64 small stores (2 shards of 60 documents), each with its own tokens, in the bucket;
    without their ArrayRecord files, which a store served from its sidecars never reads."""
    root = tmp_path_factory.mktemp("many")

    def one(k: int) -> str:
        return store(root, gcs_bucket, f"m{k}", shards=2, documents=60, records=False)[1]

    with ThreadPoolExecutor(8) as pool:  # the uploads overlap
        return list(pool.map(one, range(64)))


def cold_start_chain(urls: list[str], **options: int) -> list:
    """The longest chain of requests (`Log.chain`) from a cold feed's start to its first batch,
    0.5 s per request, with the feed's defaults but `options`."""
    config = parse_config(mixture(urls), origin="remote.yaml")
    forget()  # cold: nothing of the stores in this process's memory
    with proxied(os.environ["STORAGE_EMULATOR_HOST"], latency=0.5) as log:
        # the new client's one-time set-up (credentials, session) first: not a round trip, but
        # it can hold the first stage's requests apart by more than one
        object_version(f"{urls[0]}/manifest.json")
        log.clear()
        with DataFeed(config, mesh(), **options) as feed:
            next(feed)
            served = time.time()
            time.sleep(0.6)  # the requests started before it have ended: all in the log
        return log.chain(before=served)


def within_rounds(urls: list[str], rounds: int, **options: int) -> None:
    """A cold start over `urls` (`cold_start_chain`) takes at most `rounds` round trips.

    A loaded machine can issue or answer one stage's requests so unevenly that the chain
    crosses from one to another (a thread starved for longer than a round trip): that only
    ever adds round trips, so a start that counts more is run again, up to 3 times; a feed
    whose stages take more fails each time."""
    for _ in range(3):
        chain = cold_start_chain(urls, **options)
        if len(chain) <= rounds:
            return
    where = "; ".join(f"{r.start - chain[-1].end:+.2f} s {r.path}" for r in chain)
    raise AssertionError(f"{len(urls)} sources, {len(chain)} round trips: {where}")


def test_a_cold_start_takes_four_round_trips_whatever_the_number_of_sources(many):
    """From process start to the first batch with the feed's defaults (reader threads, steps
    read ahead), 0.5 s per request: the stores' identities, their manifests, the first batch's
    shards' indexes and checksums, its blocks; each stage for every source at once, the steps
    read ahead in the same stages (64 sources took 6 when a stage ran 32 requests at once)."""
    for count in (1, 8, 64):
        within_rounds(many[:count], 4)


@pytest.mark.parametrize("first", ["pipeline", "etils.epath"])
def test_a_stage_of_more_requests_than_aiohttps_pool_is_one_round_trip(gcs_bucket, first):
    """130 stores' identities in one stage (`together`, as the feed asks them), 1 s per
    request: one round trip, whether this package's request or another library's (Orbax's
    through etils.epath) connected the client first; aiohttp's default pool of 100 connections
    made it two (every time: 30 requests wait for a connection). A loaded machine can start a
    stage's requests so unevenly that one starts after another ended (at 0.5 s per request,
    a machine at load 15 did 3 times in a row), or the client asks one again on a fresh
    connection when the pooled one it took was closed: it runs again, up to 3 times, as
    `test_a_cold_start_takes_four_round_trips_whatever_the_number_of_sources`."""
    urls = [f"{gcs_bucket}/identity-{k}/manifest.json" for k in range(130)]
    for _ in range(3):
        with proxied(os.environ["STORAGE_EMULATOR_HOST"], latency=1.0) as log:
            # the new client's one-time set-up, as in `cold_start_chain`
            object_version(urls[0]) if first == "pipeline" else location(urls[0]).exists()
            log.clear()
            assert together(*(partial(object_version, url) for url in urls)) == [None] * 130
        assert len({request.path for request in log.requests}) == 130
        if len(log.requests) == 130 and log.rounds() == 1:
            break
    assert log.rounds() == 1, log.rounds()


def test_a_cold_start_over_stores_without_sidecars_downloads_a_batchs_shards_at_once(
    tmp_path, gcs_bucket
):
    """Stores without sidecars: the stores' identities, their manifests, then every shard the
    first batch reads (whole, with its indexes) at once: 3 round trips for 4 sources, where
    downloading shard by shard would wait for each in turn."""
    urls = [store(tmp_path, gcs_bucket, f"whole{k}", shards=1, flat=False)[1] for k in range(4)]
    within_rounds(urls, 3, prefetch=1, threads=1)


def first_needed(plan: Plan, steps: int, block_bytes: int = 1 << 16) -> dict[tuple[str, int], int]:
    """(sidecar file name, first byte of a block) -> the first step of `plan` that reads it."""
    first: dict[tuple[str, int], int] = {}
    for step in range(steps):
        for store, shards, lo, hi in plan.pieces(plan.draws(step), local=True):
            size = store.dtype.itemsize
            for shard, start, stop in zip(shards.tolist(), lo.tolist(), hi.tolist()):
                name = store.manifest["shards"][shard]["flat"]
                for block in range(
                    start * size // block_bytes, (stop * size - 1) // block_bytes + 1
                ):
                    first.setdefault((name, block * block_bytes), step)
    return first


def block_requests(log) -> dict[tuple[str, int], float]:
    """(sidecar file name, first byte) -> when the first request for that block started."""
    found: dict[tuple[str, int], float] = {}
    for request in sorted(log.requests, key=lambda r: r.start):
        match = re.search(r"%2F([^/?]+\.flat\.bin)\?.* bytes=(\d+)-", request.path)
        if match:
            found.setdefault((match[1], int(match[2])), request.start)
    return found


STEPS = 12  # served one every 0.25 s (a training step) after the first, 50 ms per request


def paced_steps(url: str, expected: Plan) -> tuple[Any, list[float]]:
    """`STEPS` steps of a feed of the store at `url`, one every 0.25 s (a training step), 50 ms
    per request: the proxy's log and when each step was asked for; every batch is the plan's."""
    asked = []
    with (
        proxied(os.environ["STORAGE_EMULATOR_HOST"], latency=0.05) as log,
        DataFeed(parse_config(raw_config(url), origin="remote.yaml"), mesh()) as feed,
    ):
        for step in range(STEPS):
            asked.append(time.time())
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), expected.batch(step)[field])
            time.sleep(0.25)
    return log, asked


def on_time(run: Callable[[int], list]) -> list:
    """The late fetches of `run(attempt)`, run again (on a fresh store: nothing fetched yet) up
    to 3 times while some are late: a loaded machine can starve the fetch-ahead thread past a
    paced step's 0.25 s, which only ever makes a fetch later; a feed that does not fetch ahead
    is late every time."""
    for attempt in range(3):
        late = run(attempt)
        if not late:
            break
    return late


def test_the_next_steps_blocks_are_fetched_before_they_are_asked_for(tmp_path, gcs_bucket):
    """Every block a step s >= 3 reads first is requested before step s - 2 is asked for: the
    readers (2 steps ahead) cannot have asked for it yet, the fetch ahead (4 steps after
    them, `feed.fetch_ahead`) has. The batches are the plan's; the thread stops with the feed."""

    def late(attempt: int) -> list:
        local, url = store(tmp_path, gcs_bucket, f"ahead-{attempt}", documents=1500, records=False)
        expected = Plan.from_config(parse_config(raw_config(local), origin="local.yaml"))
        log, asked = paced_steps(url, expected)
        requested = block_requests(log)
        needed = first_needed(expected, STEPS).items()
        ahead = [(block, step) for block, step in needed if step >= 3]
        assert len(ahead) >= 10  # the store is large enough for later steps to read new blocks
        return [(block, step) for block, step in ahead if not requested[block] < asked[step - 2]]

    assert not on_time(late)
    assert "pipeline-fetch-ahead" not in {thread.name for thread in threading.enumerate()}


def test_the_next_steps_whole_shards_are_fetched_ahead_too(tmp_path, gcs_bucket):
    """A store without sidecars: every shard a step s >= 3 reads first is downloaded before
    step s - 2 is asked for (the fetch ahead opens it, `TokenStore.flat_blocks`)."""

    def late(attempt: int) -> list:
        local, url = store(
            tmp_path, gcs_bucket, f"whole-ahead-{attempt}", shards=16, flat=False, documents=40
        )
        expected = Plan.from_config(parse_config(raw_config(local), origin="local.yaml"))
        first: dict[str, int] = {}
        for step in range(STEPS):
            for piece_store, shards, _, _ in expected.pieces(expected.draws(step), local=True):
                for shard in shards.tolist():
                    first.setdefault(piece_store.manifest["shards"][shard]["file"], step)
        log, asked = paced_steps(url, expected)
        requested: dict[str, float] = {}
        for request in sorted(log.requests, key=lambda r: r.start):
            match = re.search(r"%2F([^/?]+\.array_record)\?", request.path)
            if match:
                requested.setdefault(match[1], request.start)
        ahead = [(name, step) for name, step in first.items() if step >= 3]
        assert len(ahead) >= 2  # later steps read shards no step read before
        return [(name, step) for name, step in ahead if not requested[name] < asked[step - 2]]

    assert not on_time(late)


def test_a_mixed_plan_fetches_ahead_only_its_bucket_store_and_its_reader_reuses_the_draws(
    tmp_path, gcs_bucket
):
    """Of a mixture of a store on disk and one in a bucket, `Plan.pieces` (what the fetch-ahead
    thread fetches) holds the bucket store's pieces only, and opens no store on disk; a step's
    reader takes the draws the thread found, with the pieces it found of them, and reads the
    same rows, bit for bit."""
    disk, url = store(tmp_path, gcs_bucket, "mixed-remote")
    other, _ = store(tmp_path, gcs_bucket, "mixed-disk")
    config = parse_config(mixture([url, str(other)]), origin="m.yaml")
    plan = Plan.from_config(config, plan_stores(config))  # as a feed plans: from metadata
    expected = Plan.from_config(parse_config(mixture([str(disk), str(other)]), origin="l.yaml"))
    rows = np.arange(8)
    ahead = FetchAhead(4)
    try:
        ahead.follow(plan, 0, lambda step: rows)
        for _ in range(200):  # the thread's pass over steps 0..3 (bounded: 10 s)
            if len(ahead._found) == 4:
                break
            time.sleep(0.05)
        assert not [s for s in plan.stores() if not getattr(s, "remote", False)]
        for step in range(4):
            draws = plan.draws(step, rows)
            assert set(draws.source.tolist()) == {0, 1}  # both sources every step
            assert [str(store.path) for store, *_ in plan.pieces(draws)] == [url]
            taken = ahead.draws(plan, step, rows)
            assert taken.found  # the thread's draws, and the pieces it found of them
            assert ahead.draws(plan, step, rows) is not taken  # taken once, then drawn again
            batch, want = plan.read(taken), expected.read(expected.draws(step, rows))
            for field in FIELDS:
                np.testing.assert_array_equal(batch[field], want[field])
    finally:
        ahead.close()


def test_a_damaged_block_fetched_ahead_stops_the_step_that_reads_it(tmp_path, gcs_bucket):
    """A block that fails its checksum when fetched ahead is not lost: the step that reads it
    stops with the block's line, the steps before it are served, and the thread stops."""
    local, url = store(tmp_path, gcs_bucket, "damaged", documents=1500, records=False)
    expected = Plan.from_config(parse_config(raw_config(local), origin="local.yaml"))
    (name, start), step = next(
        (block, step) for block, step in first_needed(expected, STEPS).items() if step >= 6
    )
    damaged = bytearray((local / name).read_bytes())
    damaged[start + 10] ^= 0x01
    (tmp_path / name).write_bytes(bytes(damaged))
    copy_file(tmp_path / name, location(url) / name)
    with (
        proxied(os.environ["STORAGE_EMULATOR_HOST"], latency=0.05) as log,
        DataFeed(parse_config(raw_config(url), origin="remote.yaml"), mesh()) as feed,
    ):
        for served in range(step):
            next(feed)
            if served == step - 3:  # the fetch ahead has met the block; the readers have not
                fetched = block_requests(log).get((name, start))
            time.sleep(0.25)
        with pytest.raises(FeedError, match=f"step {step}: .*do not match their block checksums"):
            next(feed)
    assert fetched is not None
    assert "pipeline-fetch-ahead" not in {thread.name for thread in threading.enumerate()}


def silent_port() -> tuple[socket.socket, int]:
    """A loopback port that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server, server.getsockname()[1]


def test_an_endpoint_that_never_answers_fails_in_one_line_within_the_limit(monkeypatch):
    server, port = silent_port()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    fresh_clients()
    config = parse_config(raw_config("gs://pipeline-test/far", read_timeout_s=1.5), origin="c.yaml")
    started = time.monotonic()
    try:
        with pytest.raises((StoreError, ConfigError)) as raised:
            DataFeed(config, mesh())
    finally:
        server.close()
        monkeypatch.undo()
        fresh_clients()
    assert time.monotonic() - started < 12
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert "gs://pipeline-test/far/manifest.json" in message
    assert f"127.0.0.1:{port} within 1.5 s (feed.read_timeout_s)" in message


def run_worker(config: Path, out: Path, steps: int = 30) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(config), str(steps), str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def finish(process: subprocess.Popen, out: Path) -> dict[str, np.ndarray]:
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    with np.load(out) as data:
        return dict(data)


def same_batches(a: dict, b: dict) -> None:
    for key in a:
        if key != "downloaded":
            np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.multiprocess
def test_a_warm_restart_downloads_little_and_a_damaged_entry_is_fetched_again(tmp_path, proxy):
    bucket, log = proxy
    _, url = store(tmp_path, bucket, "warm")
    cache = tmp_path / "cache"
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump(raw_config(url, cache={"dir": str(cache), "max_gb": 1})))
    runs = []
    for name in ("cold", "warm"):
        log.clear()
        runs.append(
            (
                finish(run_worker(config, tmp_path / f"{name}.npz"), tmp_path / f"{name}.npz"),
                log.downloaded(),
            )
        )
    (cold, cold_bytes), (warm, warm_bytes) = runs
    same_batches(cold, warm)
    assert cold_bytes > 0 and warm_bytes <= 0.05 * cold_bytes
    # the store's identity, once: its shards' first uses check their files by content
    assert len(log.requests) == 1 and "alt=media" not in log.requests[0].path

    entry = next(p for p in sorted((cache / "blocks").rglob("*")) if p.is_file())
    damaged = bytearray(entry.read_bytes())
    damaged[100] ^= 0x01
    entry.write_bytes(bytes(damaged))
    log.clear()
    again = finish(run_worker(config, tmp_path / "again.npz"), tmp_path / "again.npz")
    same_batches(cold, again)
    assert len([r for r in log.requests if ".flat.bin" in r.path]) == 1  # that block, again
    assert entry.read_bytes() != bytes(damaged)


@pytest.mark.multiprocess
def test_two_processes_sharing_a_cache_download_each_block_once(tmp_path, proxy):
    bucket, log = proxy
    _, url = store(tmp_path, bucket, "shared")
    config = tmp_path / "data.yaml"
    cache = {"dir": str(tmp_path / "cache"), "max_gb": 1}
    config.write_text(yaml.safe_dump(raw_config(url, cache=cache)))
    log.clear()
    workers = [run_worker(config, tmp_path / f"{i}.npz") for i in range(2)]
    results = [finish(w, tmp_path / f"{i}.npz") for i, w in enumerate(workers)]
    same_batches(*results)
    media = [r.path for r in log.requests if "alt=media" in r.path]
    assert media and len(media) == len(set(media))  # every block and file: one download


def _fill_and_die(root: str) -> None:
    """A process killed (SIGKILL) in the middle of a fill, holding the fill's lock."""

    def fetch() -> bytes:
        Path(root, "started").touch()
        time.sleep(60)
        return b"never"

    BlockCache(Path(root), 1 << 20).get("blocks/k", fetch, lambda data: True)


def test_a_fill_killed_midway_leaves_nothing_served_unchecked(tmp_path):
    good = b"the block" * 100
    crc = google_crc32c.value(good)

    def check(data: bytes) -> bool:
        return google_crc32c.value(data) == crc

    root = tmp_path / "cache"
    root.mkdir()
    child = multiprocessing.get_context("spawn").Process(target=_fill_and_die, args=(str(root),))
    child.start()
    deadline = time.monotonic() + 60
    while not (root / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, 9)
    child.join()
    # what a fill killed between its write and its rename would leave: a partial file
    (root / "blocks").mkdir(exist_ok=True)
    (root / "blocks" / "k.123-abcd.partial").write_bytes(good[:10])
    cache = BlockCache(root, 1 << 20)
    fetched = []
    assert cache.get("blocks/k", lambda: fetched.append(1) or good, check) == good
    assert fetched == [1]  # the lock died with the killed process; the partial was not read
    (root / "blocks" / "k").write_bytes(good[:-1] + b"?")  # damaged on disk
    assert cache.get("blocks/k", lambda: fetched.append(2) or good, check) == good
    assert fetched == [1, 2] and cache.damaged == 1


def test_a_store_without_sidecars_is_served_from_whole_shards_downloaded_once(tmp_path, proxy):
    """A store without flat sidecars is read from its shards downloaded whole, once each, and
    checked (`remote_shards`), never through ArrayRecord's gs:// reader (~50x the store)."""
    bucket, log = proxy
    local, url = store(tmp_path, bucket, "whole", flat=False)
    expected = Plan.from_config(parse_config(raw_config(local), origin="local.yaml"))
    log.clear()
    with DataFeed(parse_config(raw_config(url), origin="remote.yaml"), mesh()) as feed:
        for step in range(60):
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), expected.batch(step)[field])
        stats = feed.stats()
    sizes = {f.name: f.stat().st_size for f in local.iterdir()}
    fetched = {}
    for request in log.requests:
        for name in sizes:
            if name.endswith(".array_record") and name in request.path:
                fetched[name] = fetched.get(name, 0) + request.bytes
    assert fetched and all(fetched[name] == sizes[name] for name in fetched)  # each one, once
    metadata = sum(size for name, size in sizes.items() if not name.endswith(".array_record"))
    assert log.downloaded() <= sum(fetched.values()) + 2 * metadata
    assert stats.downloaded_bytes >= sum(fetched.values())


def test_verify_downloads_each_shard_of_a_store_without_sidecars_once(tmp_path, proxy):
    """`verify()` hashes a gs:// shard as its local copy is made, then reads its records from
    that copy: one download per shard (it hashed the object, then downloaded it again); and it
    checks the object, not a copy cached before: a shard damaged in the bucket since is named."""
    bucket, log = proxy
    local, url = store(tmp_path, bucket, "verified", shards=2, flat=False)
    sizes = {f.name: f.stat().st_size for f in local.glob("*.array_record")}
    log.clear()
    with open_store(url) as remote:
        remote.verify()
    fetched = {name: 0 for name in sizes}
    for request in log.requests:
        for name in sizes:
            if name in request.path and "alt=media" in request.path:
                fetched[name] += request.bytes
    assert fetched == sizes
    shard = location(url) / min(sizes)
    good = shard.read_bytes()
    shard.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])  # the same size
    with open_store(url) as remote, pytest.raises(StoreError, match=f"{shard}: does not match"):
        remote.verify()


@pytest.mark.multiprocess
def test_shards_without_sidecars_are_cached_once_per_host_and_a_damaged_one_fetched_again(
    tmp_path, proxy
):
    """Two processes sharing a cache download each shard once; a fresh process with the cache
    warm downloads nothing but the store's identity and the one shard found damaged."""
    bucket, log = proxy
    local, url = store(tmp_path, bucket, "cached", flat=False)
    cache = tmp_path / "cache"
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump(raw_config(url, cache={"dir": str(cache), "max_gb": 1})))
    log.clear()
    workers = [run_worker(config, tmp_path / f"cold{i}.npz") for i in range(2)]
    cold = [finish(w, tmp_path / f"cold{i}.npz") for i, w in enumerate(workers)]
    same_batches(*cold)
    media = [r.path for r in log.requests if "alt=media" in r.path]
    assert media and len(media) == len(set(media))  # every shard and file: one download
    assert any(".array_record" in path for path in media)

    entry = next(p for p in sorted((cache / "shards").iterdir()) if p.suffix != ".lock")
    good = entry.read_bytes()
    entry.write_bytes(good[:1000] + bytes([good[1000] ^ 0x01]) + good[1001:])
    shard = next(f for f in local.glob("*.array_record") if f.read_bytes() == good).name
    log.clear()
    warm = finish(run_worker(config, tmp_path / "warm.npz"), tmp_path / "warm.npz")
    same_batches(cold[0], warm)
    media = [r.path for r in log.requests if "alt=media" in r.path]
    assert len(media) == 1 and shard in media[0]  # that shard again; the rest from the cache
    assert entry.read_bytes() == good


def test_a_shard_download_that_gets_no_answer_fails_in_one_line_within_the_limit(
    tmp_path, gcs_bucket
):
    """Bucket metadata answers, shard downloads never do (a network that drops them)."""
    _, url = store(tmp_path, gcs_bucket, "silent", flat=False)
    config = parse_config(raw_config(url, read_timeout_s=1.5), origin="c.yaml")
    started = time.monotonic()
    with (
        proxied(os.environ["STORAGE_EMULATOR_HOST"], silent=r"\.array_record\?.*alt=media") as log,
        pytest.raises(PipelineError) as raised,
        DataFeed(config, mesh()) as feed,
    ):
        endpoint = os.environ["STORAGE_EMULATOR_HOST"]  # the proxy's
        next(feed)
    assert time.monotonic() - started < 12
    # the proxy's threads that held the requests ended with it, not 60 s later
    assert log.silenced and not any(thread.is_alive() for thread in log.silenced)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert re.search(rf"{url}/shard-\d+-of-00004\.array_record: no answer", message), message
    assert f"{endpoint} within 1.5 s (feed.read_timeout_s)" in message
    # the store's identity at its open only: a download that got no answer checked nothing, so
    # it does not ask whether the store was replaced (another request to wait out)
    identities = [r for r in log.requests if r.path.endswith("manifest.json")]
    assert len(identities) == 1, identities


def test_without_a_cache_shards_are_kept_in_a_temporary_directory_removed_at_exit(tmp_path, proxy):
    """A process's temporary directory is named by its host and pid and removed when it exits;
    one left by a process that died without exiting (kill -9) is removed by the next process
    that makes one, and never a live process's or another host's."""
    bucket, _ = proxy
    local, url = store(tmp_path, bucket, "private", shards=1, flat=False)
    entry = load_manifest(local)["shards"][0]
    temporary = tmp_path / "tmp"
    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = {
        "dead": temporary / f"pipeline-shards-{host}@{gone.pid}-x1y2z3w4",
        "live": temporary / f"pipeline-shards-{host}@{os.getpid()}-x1y2z3w4",
        "elsewhere": temporary / f"pipeline-shards-{host}.other@{gone.pid}-x1y2z3w4",
    }
    for directory in left.values():
        (directory / "shards").mkdir(parents=True)
        (directory / "shards" / "copy").write_bytes(b"x" * 100)
    code = (
        "import sys; from pipeline.store.remote_shards import local_shard; "
        "print(local_shard(*sys.argv[1:3], int(sys.argv[3])))"
    )
    shard = f"{url}/{entry['file']}"
    child = subprocess.Popen(
        [sys.executable, "-c", code, shard, entry["sha256"], str(entry["bytes"])],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(temporary)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    own = Path(out.strip()).relative_to(temporary).parts[0]
    assert own.startswith(f"pipeline-shards-{host}@{child.pid}-")
    assert sorted(p.name for p in temporary.iterdir()) == sorted(
        left[name].name for name in ("live", "elsewhere")
    )  # its own removed at exit, the dead process's at its start


def evicting_opener(cache: Path, max_bytes: int, always: bool = False):
    """`open_reader`, after an eviction pass of another process of the host that deletes the
    shard copy about to be opened (`always`: at every try, else at the first open only): that
    process fills an entry as large as the bound, and once its pass is done (`settle`: it runs
    in the background), every other entry is gone. A fetch-ahead thread may fill the copy
    again meanwhile: the process fills again until the copy is gone. Not at each copy's first
    open: a batch's shards are opened at once, a thread each, and each eviction deletes the
    other threads' copies too, up to 3 times before they are opened on a loaded machine.
    Returns the opener and the copies it had evicted and then opened."""
    evicted: list[Path] = []
    opened: list[Path] = []
    fillers = itertools.count()

    def opener(path: Path):
        if path.is_relative_to(cache) and (always or not evicted):
            evicted.append(path)
            for _ in range(100):
                filler = f"blocks/filler-{next(fillers)}"
                BlockCache(cache, max_bytes).get(filler, lambda: b"f" * max_bytes, lambda _: True)
                assert BlockCache.settle()
                if not path.exists():
                    break
            assert not path.exists()
        reader = open_reader(path)
        opened.append(path)
        return reader

    return opener, evicted, opened


def test_a_shard_copy_evicted_before_its_reader_opens_it_is_fetched_again(
    tmp_path, proxy, monkeypatch
):
    """An eviction pass may delete a whole shard's copy between the cache handing out its path
    and ArrayRecord opening it: the copy is taken again (downloaded, checked) and opened, the
    batches are the plan's, and the cache is within its bound once its passes are done."""
    bucket, log = proxy
    local, url = store(tmp_path, bucket, "evicted", flat=False)
    cache, max_gb = tmp_path / "cache", 0.001
    opener, evicted, opened = evicting_opener(cache, int(max_gb * (1 << 30)))
    monkeypatch.setattr(token_store, "open_reader", opener)
    expected = Plan.from_config(parse_config(raw_config(local), origin="local.yaml"))
    remote = raw_config(url, cache={"dir": str(cache), "max_gb": max_gb})
    log.clear()
    with DataFeed(parse_config(remote, origin="remote.yaml"), mesh()) as feed:
        for step in range(8):
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), expected.batch(step)[field])
    assert evicted and set(evicted) <= set(opened)  # each one opened once fetched again
    shards = [r for r in log.requests if ".array_record" in r.path and "alt=media" in r.path]
    assert len(shards) >= 2 * len(evicted)
    assert BlockCache.settle()
    assert sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) <= max_gb * (1 << 30)


def test_a_copy_evicted_at_every_try_before_it_is_opened_fails_in_one_line(
    tmp_path, proxy, monkeypatch
):
    """A cache too small for the shards a host reads at once would evict a copy before each
    open: after `OPEN_TRIES`, one line naming the shard and the setting to raise."""
    bucket, _ = proxy
    _, url = store(tmp_path, bucket, "thrashed", shards=1, flat=False)
    cache, max_gb = tmp_path / "cache", 0.001
    opener, evicted, _ = evicting_opener(cache, int(max_gb * (1 << 30)), always=True)
    monkeypatch.setattr(token_store, "open_reader", opener)
    config = raw_config(url, cache={"dir": str(cache), "max_gb": max_gb})
    with (
        pytest.raises(PipelineError) as raised,
        DataFeed(parse_config(config, origin="c.yaml"), mesh()) as feed,
    ):
        next(feed)
    message = str(raised.value)
    assert len(evicted) >= OPEN_TRIES and len(message.splitlines()) == 1, message
    assert (
        f"{url}/" in message and "evicted 3 times" in message and "feed.cache.max_gb" in message
    ), message


def test_a_copy_deleted_before_arrayrecord_opens_it_is_never_read_as_a_shard_of_no_records(
    tmp_path,
):
    """ArrayRecord opens a shard by its path, and reads a file that is not there as a shard of
    no records: `open_reader` holds the file open meanwhile and refuses it (`Vanished`: its
    copy is taken again) unless it is still there once ArrayRecord holds it. Here the path is
    a descriptor's link to a file deleted before `open_reader` is called."""
    shard = tmp_path / "shard.array_record"
    writer = ArrayRecordWriter(str(shard), "group_size:1")
    writer.write(b"record")
    writer.close()
    descriptor = os.open(shard, os.O_RDONLY)
    try:
        shard.unlink()
        with pytest.raises(Vanished, match="deleted while it was opened"):
            open_reader(Path(f"/proc/self/fd/{descriptor}"))
    finally:
        os.close(descriptor)
