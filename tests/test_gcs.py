"""gs:// stores end to end against a real local Cloud Storage API server (tests/conftest.py).

Shards are read by ArrayRecord's own gs:// reader, manifests and indexes through etils.epath
and gcsfs; nothing here is a mock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

import pipeline.store.writer as writer
from pipeline.config import load_config, parse_config
from pipeline.errors import StoreError
from pipeline.feed import shared_stores
from pipeline.feed.data_feed import DataFeed
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.maxtext.adapter import create_data_iterator, read_iter_state
from pipeline.plan import data_state
from pipeline.plan.resume import reconcile
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store import remote_reads
from pipeline.store.token_store import READER_OPTIONS, TokenStore, is_store
from pipeline.urls import copy_file, location
from tests.feedstores import two_stage_config
from tests.gcs_emulator import serving
from tests.storegen import write_synthetic_store
from tests.test_cli_plan import SHARDS, run, write_config
from tests.test_faults import corpus as corpus_of
from tests.test_faults import feed_across_a_replacement
from tests.test_feed import reader_threads
from tests.test_maxtext import maxtext_config, write_data_yaml

TEXTS = [f"document {i}: " + "gs ✓ " * (i % 7) + "line\n" * (i % 3) for i in range(40)]


@pytest.fixture
def prefix(gcs_bucket: str) -> str:
    """A fresh prefix in the emulator's bucket for one test."""
    return f"{gcs_bucket}/{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(TEXTS):
        (root / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
    return str(root)


def files(store) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(location(store).iterdir())}


def test_round_trip_prepare_verify_feed_inspect(tmp_path: Path, prefix, corpus, capsys):
    store = f"{prefix}/web"
    common = ["--num-shards", 3, "--eval-fraction", 0.2, "--no-progress"]
    code, out, err = run(capsys, "prepare", corpus, "--out", store, *common)
    assert (code, err) == (0, ""), err
    assert out.startswith(f"train: {store}: ")
    run(capsys, "prepare", corpus, "--out", tmp_path / "web", *common)
    assert files(store) == files(tmp_path / "web")  # byte-identical to a local prepare
    assert files(f"{store}-eval") == files(tmp_path / "web-eval")
    assert [p.name for p in location(prefix).iterdir()] == ["web", "web-eval"]  # no staging left

    code, out, err = run(capsys, "verify-store", store)
    assert (code, err) == (0, "") and out.startswith(f"ok: {store}: ")

    raw = {"seed": 3, "seq_len": 16, "global_batch_size": 8, "mix": {"web": 1}}
    config_url = location(f"{prefix}/data.yaml")
    config_url.write_text(yaml.safe_dump({**raw, "sources": {"web": {"path": store}}}))
    local_config = tmp_path / "data.yaml"
    local_config.write_text(
        yaml.safe_dump({**raw, "sources": {"web": {"path": str(tmp_path / "web")}}})
    )
    config = load_config(str(config_url))
    assert str(config.sources[0].path) == store
    expected = Plan.from_config(load_config(local_config))
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    with DataFeed(config, mesh) as feed:  # `threads: auto`: a remote store gets more readers
        for step in range(3):
            batch = next(feed)
            assert (feed.reader_threads, reader_threads()) == (2, 2)  # min(4, prefetch 2)
            want = expected.batch(step)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), want[field])

    code, out, err = run(capsys, "inspect", str(config_url), "--step", 1)
    assert (code, err) == (0, "")
    assert out == run(capsys, "inspect", local_config, "--step", 1)[1].replace(
        str(local_config), str(config_url)
    )
    for command in (["verify", "--steps", "0:4"], ["dump", "--steps", "0:2", "--out"]):
        out_file = [tmp_path / f"{command[0]}.npz"] if command[0] == "dump" else []
        code, _, err = run(capsys, command[0], str(config_url), *command[1:], *out_file)
        assert code == 0, err


def test_the_beam_runner_writes_the_same_store_to_a_bucket(tmp_path: Path, prefix, corpus):
    from pipeline.ingest.prepare_beam import prepare_beam

    beam = prepare_beam(PrepareOptions([corpus], location(f"{prefix}/beam"), num_shards=2))
    local = prepare(PrepareOptions([corpus], tmp_path / "local", num_shards=2, progress=False))
    assert files(beam["train"]) == files(local["train"])
    assert [p.name for p in location(prefix).iterdir()] == ["beam"]  # staging prefix removed


def fail_copy(monkeypatch, name: str) -> None:
    """Make the commit's copy of file `name` fail, as a dropped connection would."""
    real_copy = writer.copy_file

    def copy(source, destination):
        if destination.name == name:
            raise OSError("connection reset")
        real_copy(source, destination)

    monkeypatch.setattr(writer, "copy_file", copy)


@pytest.mark.parametrize("fails", ["shard-00001-of-00002.index.npy", "manifest.json"])
def test_an_interrupted_upload_never_opens_and_the_same_prepare_finishes_it(
    tmp_path: Path, prefix, corpus, monkeypatch, fails
):
    store = f"{prefix}/web"
    options = {"num_shards": 2, "progress": False}
    with monkeypatch.context() as patch:
        fail_copy(patch, fails)
        with pytest.raises(OSError, match="connection reset"):
            prepare(PrepareOptions([corpus], location(store), **options))
    names = [p.name for p in location(store).iterdir()]
    assert writer.INCOMPLETE in names and "manifest.json" not in names
    assert not is_store(store)
    with pytest.raises(StoreError, match=r"manifest\.json is missing"):
        TokenStore(store)
    prepare(PrepareOptions([corpus], location(store), **options))  # no --overwrite needed
    local = prepare(PrepareOptions([corpus], tmp_path / "web", **options))["train"]
    assert files(store) == files(local)  # complete, and neither marker nor leftovers remain
    assert TokenStore(store, verify=True).num_shards == 2


def test_an_interrupted_overwrite_leaves_no_store_until_it_is_run_again(
    tmp_path: Path, prefix, corpus, monkeypatch
):
    """--overwrite deletes the old manifest first: no moment mixes the old and new stores."""
    store = location(f"{prefix}/web")
    prepare(PrepareOptions([corpus], store, num_shards=3, progress=False))
    again = PrepareOptions([corpus], store, num_shards=2, progress=False, overwrite=True)
    with monkeypatch.context() as patch:
        fail_copy(patch, "shard-00001-of-00002.array_record")
        with pytest.raises(OSError, match="connection reset"):
            prepare(again)
    assert not is_store(store)  # the old store stopped opening, the new one is not there yet
    assert not [p for p in store.iterdir() if p.name.endswith("of-00003.array_record")]
    prepare(again)
    assert TokenStore(str(store), verify=True).num_shards == 2
    assert writer.INCOMPLETE not in [p.name for p in store.iterdir()]
    local = prepare(PrepareOptions([corpus], tmp_path / "web", num_shards=2, progress=False))
    assert files(store) == files(local["train"])  # no file of the first prepare is left


def test_a_prefix_of_other_objects_is_not_taken_for_an_interrupted_upload(prefix, corpus):
    (location(prefix) / "web" / "notes.txt").write_text("not a store")
    with pytest.raises(Exception, match="output directory exists"):
        prepare(PrepareOptions([corpus], location(f"{prefix}/web"), progress=False))


def big_corpus(root: Path) -> str:
    """One text of ~1.2 M bytes: with the bytes tokenizer (uint16) a 2.4 MB shard."""
    root.mkdir()
    words = " ".join(f"w{i % 9973}" for i in range(200_000))
    (root / "big.txt").write_text(words, encoding="utf-8")
    return str(root)


def test_shards_over_1_mib_read_back_through_the_feed(tmp_path: Path, prefix):
    """ArrayRecord opens a gs:// shard by reading its last 1 MiB (a suffix range): larger
    shards than that read back byte for byte, as batches identical to the local store's."""
    corpus = big_corpus(tmp_path / "big")
    store = f"{prefix}/big"
    prepare(PrepareOptions([corpus], location(store), num_shards=1, progress=False))
    local = prepare(PrepareOptions([corpus], tmp_path / "local", num_shards=1, progress=False))
    assert location(store).joinpath("shard-00000-of-00001.array_record").stat().length > 2 << 20
    raw = {"seed": 3, "seq_len": 64, "global_batch_size": 8, "mix": {"big": 1}}
    plan = Plan.from_config(
        parse_config({**raw, "sources": {"big": {"path": str(local["train"])}}})
    )
    config = parse_config({**raw, "sources": {"big": {"path": store}}})
    with DataFeed(config, Mesh(np.array(jax.devices()[:4]), ("data",))) as feed:
        for step in range(3):
            batch = next(feed)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), plan.batch(step)[field])


def test_the_bare_emulator_lacks_suffix_ranges_and_generations(tmp_path: Path):
    """Why tests/gcs_emulator.py exists: gcp-storage-emulator answers ArrayRecord's
    `Range: bytes=-1048576` with the whole object, so a shard over 1 MiB reads as empty, and it
    serves the live object for any `?generation=`. When this fails, the emulator does both as
    Cloud Storage does and the wrapper can go."""
    import gcsfs
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    local = prepare(
        PrepareOptions([big_corpus(tmp_path / "big")], tmp_path / "s", num_shards=1, progress=False)
    )["train"]
    small = tmp_path / "small.array_record"
    records = ArrayRecordWriter(str(small), "group_size:1")
    for record in (b"a", b"b", b"c"):
        records.write(record)
    records.close()
    with serving(bare=True) as bucket:
        endpoint = os.environ["STORAGE_EMULATOR_HOST"]
        fs = gcsfs.GCSFileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        fs.put_file(str(local / "shard-00000-of-00001.array_record"), f"{bucket}/big")
        with pytest.raises(IndexError, match=r"is of range of \[0, 0\)"):
            ArrayRecordReader(f"{bucket}/big", READER_OPTIONS).read(0, 1)
        fs.put_file(str(small), f"{bucket}/small")  # generation 123 was never written:
        assert ArrayRecordReader(f"{bucket}/small#123", READER_OPTIONS).num_records() == 3


def conditional_requests(bucket: str) -> dict[str, tuple[int, str | None]]:
    """What a server answers to the conditional requests TensorStore sends for an OCDBT
    manifest (status, and the download's `x-goog-generation`), after a first write."""
    import urllib.error
    import urllib.request

    endpoint, name = os.environ["STORAGE_EMULATOR_HOST"], bucket.removeprefix("gs://")
    upload = f"{endpoint}/upload/storage/v1/b/{name}/o?uploadType=media&name=manifest"

    def answer(url: str, data: bytes | None = None) -> tuple[int, str | None]:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=data)) as response:
                return response.status, response.headers.get("x-goog-generation")
        except urllib.error.HTTPError as error:
            return error.code, None

    with urllib.request.urlopen(urllib.request.Request(upload, data=b"m")) as response:
        generation = json.load(response)["generation"]
    media = f"{endpoint}/storage/v1/b/{name}/o/manifest?alt=media"
    return {
        "read": answer(media),
        "read if changed": answer(f"{media}&ifGenerationNotMatch={generation}"),
        "create if absent": answer(f"{upload}&ifGenerationMatch=0", b"n"),
        "write if unchanged since 1": answer(f"{upload}&ifGenerationMatch=1", b"n"),
    }


def test_the_bare_emulator_ignores_generation_preconditions():
    """Why the wrapper answers preconditions (tests/gcs_emulator.py): gcp-storage-emulator names
    no generation in a download's headers and ignores `ifGenerationMatch`/`ifGenerationNotMatch`,
    so TensorStore takes a read object's generation for 0 and refuses to condition a write on it
    ("Malformed StorageGeneration": how an OCDBT manifest update of an Orbax save fails). When
    this fails, the emulator answers as Cloud Storage does and the wrapper can go."""
    import tensorstore as ts

    for bare in (True, False):
        with serving(bare=bare) as bucket:
            answers = conditional_requests(bucket)
            kvstore = ts.KvStore.open({"driver": "gcs", "bucket": "pipeline-test"}).result()
            read = kvstore.read("manifest").result()
            if bare:
                assert answers == {
                    "read": (200, None),
                    "read if changed": (200, None),
                    "create if absent": (200, None),
                    "write if unchanged since 1": (200, None),
                }
                with pytest.raises(ValueError, match="Malformed StorageGeneration"):
                    kvstore.write("manifest", b"o", if_equal=read.stamp.generation).result()
            else:  # what Cloud Storage answers
                assert answers["read"][0] == 200 and answers["read"][1].isdigit()
                assert answers["read if changed"] == (304, None)
                assert answers["create if absent"] == (412, None)
                assert answers["write if unchanged since 1"] == (412, None)
                kvstore.write("manifest", b"o", if_equal=read.stamp.generation).result()
                assert kvstore.read("manifest").result().value == b"o"


def test_an_open_reader_of_a_replaced_bucket_shard_fails_rather_than_read_the_new_one(
    tmp_path: Path, prefix
):
    """Cloud Storage has no open file: an open shard's blocks are checked against the CRCs it
    opened with, so the same-layout shard of another store is refused by name, never served."""
    store = location(f"{prefix}/web")
    old = corpus_of(tmp_path / "old", "alpha", 60)
    prepare(PrepareOptions([str(old)], store, num_shards=2, progress=False))
    opened = TokenStore(str(store))
    opened.doc_offsets(0)  # opens shard 0: its indexes and block checksums, none of its blocks
    first = TokenStore(str(store)).read_shard_tokens(1, 0, 40).tokens
    new = corpus_of(tmp_path / "new", "omega", 60)  # the same lengths: the same record layout
    prepare(PrepareOptions([str(new)], store, num_shards=2, overwrite=True, progress=False))
    assert TokenStore(str(store)).read_shard_tokens(1, 0, 40).tokens.tolist() != first.tolist()
    sidecar = store / "shard-00000-of-00002.flat.bin"  # served from its checked blocks
    with pytest.raises(StoreError, match=rf"{sidecar}: bytes .* do not match their block"):
        opened.read_shard_tokens(0, 0, 40)


def test_a_bucket_store_replaced_under_a_running_feed_stops_it_and_serves_nothing_new(
    tmp_path: Path, prefix, monkeypatch
):
    """A bucket store is served from blocks checked against the CRCs read when its shards were
    opened: once `--overwrite` replaces the store, a block not yet held fails its check, naming
    its object, the periodic identity check stops the feed, and no batch holds a token of the
    new store (the blocks held are the old store's, checked)."""
    monkeypatch.setenv("PIPELINE_STOP_STORE_CHECK_S", "0.2")  # the small store is soon all held
    store = location(f"{prefix}/web")
    # 8 lanes: the first step opens a shard per lane, whose readers the next steps read on
    message = feed_across_a_replacement(tmp_path, store, lanes=8, global_batch_size=8)
    # Which stops the feed depends on timing: a block of a shard opened before the replacement
    # fails its check; a shard opened after it (or the feed's periodic identity check, without
    # the step) finds the new manifest.
    # Either way the source's config key names the store.
    read = r"shard-0000[0-7]-of-00008\.flat\.bin: bytes \d+\.\.\d+ do not match their block"
    replaced = r"manifest\.json: the store was replaced or changed after it was opened "
    step, key = r"step \d+: cannot read the batch: ", r"r\.yaml: sources\.s\.path: "
    where = rf"({step})?{key}{re.escape(str(store))}/"
    assert re.match(rf"{where}({read}|{replaced})", message), message


def test_a_missing_or_damaged_bucket_shard_is_named(prefix, corpus):
    store = f"{prefix}/web"
    prepare(PrepareOptions([corpus], location(store), num_shards=2, progress=False))
    shard = location(store) / "shard-00001-of-00002.array_record"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(StoreError, match=f"{shard}: "):  # its first use finds it, or the pass
        TokenStore(store, verify=True)
    sidecar = location(store) / "shard-00001-of-00002.flat.bin"  # what a feed reads of it
    sidecar.unlink()
    opened = TokenStore(store)  # opening reads the manifest only; the first read finds it
    with pytest.raises(StoreError, match=f"{sidecar}: listed in the store's manifest but miss"):
        opened.read_shard_tokens(1, 0, 1)


def test_a_bucket_store_replaced_after_open_is_named(prefix, corpus):
    """Objects have no inode: the manifest's generation number, taken at open, is compared by
    the feed's watcher (`check_unchanged`) and whenever a shard's files fail their checks at
    its first use (they are checked by content against the manifest read at open, so nothing
    of a new store is served), so the replacement is named as such."""
    store = location(f"{prefix}/web")
    prepare(PrepareOptions([corpus], store, num_shards=2, progress=False))
    opened = TokenStore(str(store))
    opened.read_shard_tokens(0, 0, 1)
    opened.check_unchanged()  # the feed's watcher asks this every few seconds
    prepare(PrepareOptions([corpus], store, num_shards=2, seed=1, progress=False, overwrite=True))
    remote_reads.forget()  # not the bytes of an equal store another test had this process fetch
    with pytest.raises(StoreError, match=f"{store}/manifest.json: the store was replaced"):
        opened.read_shard_tokens(1, 0, 1)
    with pytest.raises(StoreError, match=f"{store}/manifest.json: the store was replaced"):
        opened.check_unchanged()


def test_a_bucket_shard_without_sidecars_is_checked_by_content(tmp_path: Path, prefix, corpus):
    """A shard of a store without flat sidecars is downloaded whole and checked against its
    SHA-256 in the manifest before ArrayRecord reads it (`remote_shards`): an altered shard is
    refused by name, never read; the same bytes written again (a new generation) are served."""
    store = f"{prefix}/web"
    own = tmp_path / "corpus"  # shards no other test's: copies are kept by their content
    own.mkdir()
    for text in sorted(Path(corpus).iterdir()):
        (own / text.name).write_text(f"{text.read_text(encoding='utf-8')} {prefix}", "utf-8")
    options = PrepareOptions([str(own)], location(store), num_shards=2, progress=False)
    prepare(dataclasses.replace(options, flat_tokens=False))
    local = tmp_path / "local"
    prepare(dataclasses.replace(options, out=local, flat_tokens=False))
    shard = location(store) / "shard-00001-of-00002.array_record"
    good = shard.read_bytes()
    damaged = bytearray(good)
    damaged[len(good) // 2] ^= 0x01
    shard.write_bytes(bytes(damaged))
    opened = TokenStore(store)
    with pytest.raises(StoreError, match=rf"{shard}: does not match its checksum \(sha256\)"):
        opened.read_shard_tokens(1, 0, 5)
    shard.write_bytes(good)
    np.testing.assert_array_equal(opened.document(1, 0), TokenStore(local).document(1, 0))


def test_a_bucket_store_that_has_read_a_shard_is_still_shared(prefix, corpus):
    """A cloud shard's identity is taken at its first read, not at open: the store that took it
    is still the same store as a fresh open of it, so a second feed shares it."""
    store = f"{prefix}/web"
    prepare(PrepareOptions([corpus], location(store), num_shards=2, progress=False))
    held = shared_stores.acquire(store)
    try:
        held.read_shard_tokens(0, 0, 5)
        assert held.same_as(TokenStore(store))
        again = shared_stores.acquire(store)
        assert again is held
        shared_stores.release(again)
    finally:
        shared_stores.release(held)
    assert not shared_stores.holds(held)


def upload(local: Path, url: str) -> str:
    for file in sorted(local.iterdir()):
        copy_file(file, location(url) / file.name)
    return url


def test_the_maxtext_adapter_reads_a_bucket_config_and_stores(tmp_path: Path, prefix):
    data_yaml = write_data_yaml(tmp_path)
    raw = yaml.safe_load(data_yaml.read_text())
    for section in (raw, raw["eval"]):
        for name, source in section["sources"].items():
            source["path"] = upload(Path(source["path"]), f"{prefix}/{name}")
    config_url = location(f"{prefix}/data.yaml")
    config_url.write_text(yaml.safe_dump(raw))
    plan = Plan.from_config(load_config(data_yaml))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "fsdp"))
    config = maxtext_config(str(config_url), eval_interval=-1)
    train, _ = create_data_iterator(config, mesh)
    try:
        for step in range(4):
            batch = next(train)
            for field in FIELDS:
                np.testing.assert_array_equal(np.asarray(batch[field]), plan.batch(step)[field])
        text = train.local_iterator.get_state().decode()
    finally:
        train.close()
    # MaxText's checkpoint item in the bucket: checkpoint 3, saved after training step 3
    item = location(f"{prefix}/checkpoints/3/iter")
    (item / "process_0-of-1.json").write_text(text)
    assert read_iter_state(str(item)).step == 4
    resumed, _ = create_data_iterator(config, mesh)
    try:
        resumed.restore_from(str(item))
        batch = next(resumed)
        for field in FIELDS:
            np.testing.assert_array_equal(np.asarray(batch[field]), plan.batch(4)[field])
    finally:
        resumed.close()


def test_a_masked_store_in_a_bucket_keeps_its_mask(tmp_path: Path, prefix):
    """Chat rows prepared into a bucket (local and Beam runners) read back with their loss
    mask, and a best_fit source of it gives the local store's batches."""
    import json

    from pipeline.config import parse_config
    from pipeline.ingest.chat import RowFields
    from pipeline.ingest.prepare_beam import prepare_beam

    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"question {i}?"},
                                 {"role": "assistant", "content": TEXTS[i]}]}) + "\n"
        for i in range(len(TEXTS))
    ))  # fmt: skip
    inputs, options = [str(rows)], {"num_shards": 2, "fields": RowFields("messages")}
    local = prepare(PrepareOptions(inputs, tmp_path / "local", progress=False, **options))
    bucket = prepare(PrepareOptions(inputs, location(f"{prefix}/sft"), progress=False, **options))
    beam = prepare_beam(PrepareOptions(inputs, location(f"{prefix}/beam"), **options))
    assert files(bucket["train"]) == files(beam["train"]) == files(local["train"])
    store = TokenStore(bucket["train"], verify=True)
    assert store.masked and not store.trained(0, 0, 40).all()
    batches = []
    for path in (local["train"], bucket["train"]):
        raw = {"seq_len": 64, "global_batch_size": 4, "mix": {"sft": 1},
               "sources": {"sft": {"path": str(path), "packing": "best_fit"}}}  # fmt: skip
        batches.append(Plan.from_config(parse_config(raw)).batch(3))
    for name in FIELDS:
        np.testing.assert_array_equal(batches[0][name], batches[1][name])


def test_a_ledger_is_saved_to_and_read_from_a_bucket(tmp_path: Path, prefix, capsys):
    """`Ledger.save` and `--ledger` take a gs:// URL: the CLI reproduces a switched run's step
    from a bucket ledger as from a local one, and a missing one is one line naming the URL."""
    for name, shards in SHARDS.items():
        write_synthetic_store(tmp_path / name, shards)
    config = write_config(tmp_path, tmp_path)
    (tmp_path / "new").mkdir()
    switched = write_config(tmp_path / "new", tmp_path, mix={"a": 1, "b": 1})
    ledger = reconcile(Plan.from_config(load_config(config)), load_config(switched), 6, switch=True)
    url = f"{prefix}/run/ledger.json"
    ledger.save(url)
    ledger.save(url)  # replaces the object whole
    ledger.save(tmp_path / "ledger.json")
    assert location(url).read_bytes() == (tmp_path / "ledger.json").read_bytes()
    assert data_state.load_ledger(url) == ledger
    inspect = ["inspect", switched, "--step", 7, "--ledger"]
    code, out, err = run(capsys, *inspect, url)
    assert (code, err) == (0, "") and "ledger segment 1 (from step 6)" in out
    assert out == run(capsys, *inspect, tmp_path / "ledger.json")[1]
    code, _, err = run(capsys, *inspect, f"{prefix}/run/missing.json")
    assert code == 2 and err.startswith(f"error: {prefix}/run/missing.json: cannot read the ledger")
    assert err.count("\n") == 1


def test_an_orbax_checkpoint_of_a_feed_round_trips_through_a_bucket(tmp_path: Path, prefix):
    """Save a running feed's checkpoint (model and data state) to gs://, restore it in a new
    process: both feed the batches the plan gives for the steps after the checkpoint."""
    plan = Plan.from_config(two_stage_config(tmp_path / "stores"))
    worker = Path(__file__).parent / "gcs_checkpoint_worker.py"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(worker.parent.parent))
    fed = {}
    for phase in ("save", "restore"):
        out = tmp_path / f"{phase}.npz"
        argv = [sys.executable, worker, phase, tmp_path / "stores", f"{prefix}/ckpt", out]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        fed[phase] = dict(np.load(out))
    assert (location(prefix) / "ckpt" / "3" / "data" / "data_state.json").exists()
    for step in (3, 4):
        for field in FIELDS:
            for phase in fed:
                np.testing.assert_array_equal(
                    fed[phase][f"{field}@{step}"], plan.batch(step)[field]
                )


def committed_steps(checkpoints: str) -> list[int]:
    """The steps whose Orbax checkpoint is complete in the bucket, as the server lists them now:
    Cloud Storage has no atomic rename, so Orbax writes a step in place and marks it done with
    commit_success.txt."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(skip_instance_cache=True)  # no listing cached from an earlier call
    marks = [path.split("/") for path in fs.find(checkpoints)]
    return sorted(int(m[-2]) for m in marks if m[-1] == "commit_success.txt" and m[-2].isdigit())


@pytest.mark.multiprocess  # three trainer processes, each importing JAX
def test_the_trainer_saves_asynchronously_to_a_bucket_and_resumes_after_a_kill(
    tmp_path: Path, prefix
):
    """scripts/train.py with `--checkpoint-dir gs://...` (asynchronous saves, TensorStore's
    OCDBT for the arrays): a run exits 0 with its saves in the bucket; a resumed run killed
    (SIGKILL: no notice, no last save) after saves of its own is resumed again at the last save
    that landed, and exits 0 with its own last save in the bucket. No run logs a traceback or
    gcsfs's layout-probe warning."""
    prepare(
        PrepareOptions(["builtin:python-docs"], tmp_path / "docs", num_shards=2, progress=False)
    )
    config = tmp_path / "data.yaml"
    config.write_text(
        "seed: 3\nseq_len: 32\nglobal_batch_size: 8\n"
        "sources:\n  docs: {path: docs}\nmix: {docs: 1}\n"
    )
    checkpoints, metrics = f"{prefix}/ckpt", tmp_path / "metrics.jsonl"
    trainer = [
        sys.executable, str(Path(__file__).parent.parent / "scripts" / "train.py"),
        "--data-config", str(config), "--checkpoint-dir", checkpoints, "--save-every", "2",
        "--width", "16", "--depth", "1", "--metrics", str(metrics),
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def clean(stderr: str) -> None:
        for noise in ("Traceback", "Event loop is closed", "Could not determine bucket type"):
            assert noise not in stderr, stderr[-3000:]

    first = subprocess.run([*trainer, "--steps", "4"], capture_output=True, text=True, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    clean(first.stderr)
    assert committed_steps(checkpoints) == [2, 4]

    log = tmp_path / "killed.log"
    with log.open("w") as stderr:
        killed = subprocess.Popen([*trainer, "--steps", "1000", "--resume"], stderr=stderr, env=env)
        try:
            deadline = time.monotonic() + 300
            while max(committed_steps(checkpoints)) < 8:  # two saves of its own landed
                assert killed.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        finally:
            killed.kill()
            killed.wait(timeout=60)
    assert "resumed at step 4 " in log.read_text()
    clean(log.read_text())
    last = max(committed_steps(checkpoints))

    metrics.unlink()
    resumed = subprocess.run(
        [*trainer, "--steps", str(last + 3), "--resume"], capture_output=True, text=True, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    clean(resumed.stderr)
    assert f"resumed at step {last} " in resumed.stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [last, last + 1, last + 2]
    assert max(committed_steps(checkpoints)) == last + 3  # the last save reached the bucket


def upload_tree(local: Path, url: str) -> None:
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        copy_file(file, location(f"{url}/{file.relative_to(local).as_posix()}"))


@pytest.fixture
def bucket_inputs(tmp_path: Path, prefix) -> tuple[list[str], list[str]]:
    """The same inputs as local files and as objects in the bucket: a directory of text files
    (read as a prefix), a `**` glob of JSONL files and one Parquet file; hidden names in both."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    texts = {"text/a.txt": TEXTS[1], "text/sub/b.txt": TEXTS[2], "text/.hidden.txt": "no"}
    for rel, text in [*texts.items(), ("text/.git/c.txt", "not read")]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text, encoding="utf-8")
    for i, rel in enumerate(["rows/x.jsonl", "rows/deep/y.jsonl", "rows/.h/z.jsonl"]):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        lines = [f'{{"text": "{rel} {j} ✓"}}' for j in range(3 + i)]
        (src / rel).write_text("\n".join(lines) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": TEXTS[:12]}), src / "rows" / "t.parquet")
    upload_tree(src, f"{prefix}/src")
    patterns = ["text", "rows/**/*.jsonl", "rows/t.parquet"]
    return [str(src / p) for p in patterns], [f"{prefix}/src/{p}" for p in patterns]


def same_but_inputs(bucket_store, local_store) -> None:
    """The stores are equal byte for byte but for the manifest's record of the inputs as typed
    (and so its checksum)."""
    import json

    got, expected = files(bucket_store), files(local_store)
    assert sorted(got) == sorted(expected)
    for name in expected:
        if name != "manifest.json":
            assert got[name] == expected[name], name
    manifests = [json.loads(got["manifest.json"]), json.loads(expected["manifest.json"])]
    for manifest in manifests:
        del manifest["manifest_sha256"], manifest["created"]["inputs"]
    assert manifests[0] == manifests[1]


def test_prepare_reads_bucket_inputs_as_it_reads_local_copies(tmp_path: Path, bucket_inputs):
    local_inputs, urls = bucket_inputs
    options = {"num_shards": 3, "eval_fraction": 0.25, "progress": False}
    local = prepare(PrepareOptions(local_inputs, tmp_path / "local", **options))
    bucket = prepare(PrepareOptions(urls, tmp_path / "bucket", **options))
    for split in ("train", "eval"):
        same_but_inputs(bucket[split], local[split])
    store = TokenStore(local["train"])
    assert store.num_documents + TokenStore(local["eval"]).num_documents == 2 + 3 + 4 + 12


def test_the_beam_runner_reads_bucket_inputs_on_its_workers(tmp_path: Path, bucket_inputs):
    from pipeline.ingest.prepare_beam import prepare_beam

    local_inputs, urls = bucket_inputs
    local = prepare(PrepareOptions(local_inputs, tmp_path / "local", num_shards=2, progress=False))
    # two worker processes of the direct runner: the objects are read in them, not listed again
    beam = prepare_beam(PrepareOptions(urls, tmp_path / "beam", num_shards=2, workers=2))
    same_but_inputs(beam["train"], local["train"])


def test_bucket_inputs_that_are_not_there_are_one_line(prefix):
    from pipeline.errors import PrepareError
    from pipeline.ingest.corpora import resolve_inputs

    with pytest.raises(PrepareError, match=r"^input '.*/missing.jsonl' does not exist; give an"):
        resolve_inputs([f"{prefix}/missing.jsonl"])
    with pytest.raises(PrepareError, match=r"^input '.*/\*.jsonl': the glob matches no files"):
        resolve_inputs([f"{prefix}/*.jsonl"])
