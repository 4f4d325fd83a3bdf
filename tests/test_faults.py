"""Fault injection: damage a copy of a real store, config or checkpoint, as an operator might.

One test (or parametrized case) per defect an adversarial campaign found (issue 13, "Why" 1-9).
Each asserts the one-line typed error naming what is at fault, or that batches are unchanged;
none may end in a traceback. The randomized kill -9 test at the end is `multiprocess`.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from pipeline.commands.cli import main
from pipeline.config import load_config, parse_config
from pipeline.config.env import positive_number
from pipeline.errors import ConfigError, FeedError, LedgerError, StoreError
from pipeline.feed import host_stop, shared_stores
from pipeline.feed.checkpoint import FILENAME, DataRestore
from pipeline.feed.data_feed import DataFeed
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.plan import data_state
from pipeline.plan.plan import SegmentPlan
from pipeline.plan.resume import reconcile
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.store.identity import manifest_digest
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import MANIFEST, TokenStore, read_pieces
from tests.feedstores import two_stage_config, two_stage_raw
from tests.storegen import write_synthetic_store
from tests.test_checkpoint import manager as checkpoint_manager
from tests.test_checkpoint import mesh, save

SHARDS = [[30, 50, 20], [40, 60], [25, 35, 45, 55]]


def cli(capsys, *argv) -> tuple[int, str]:
    """Run the CLI in-process; returns (exit code, stderr) and checks a failure is one line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    if code:
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return code, err


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def write_yaml(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def edit_manifest(store: Path, edit, redo_checksum: bool) -> None:
    manifest = json.loads((store / MANIFEST).read_text())
    edit(manifest)
    if redo_checksum:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    (store / MANIFEST).write_text(json.dumps(manifest))


def synthetic(directory: Path, name: str = "store", **kwargs) -> Path:
    write_synthetic_store(directory / name, SHARDS, record_tokens=16, **kwargs)
    return directory / name


def config_over(directory: Path, sources: dict[str, Path], **overrides) -> dict:
    raw = {
        "seed": 3,
        "seq_len": 8,
        "global_batch_size": 4,
        "lanes": 2,
        "sources": {name: {"path": str(path)} for name, path in sources.items()},
        "mix": dict.fromkeys(sources, 1),
    }
    raw.update(overrides)
    return raw


# -- 1. an edited checkpoint data state ------------------------------------------------------


def manager(root: Path) -> ocp.CheckpointManager:
    """A synchronous manager of the checkpoints under `root`/ckpt."""
    return checkpoint_manager(root / "ckpt", async_save=False)


def switched_raw(root: Path) -> dict:
    return two_stage_raw(root / "stores", stages=[{"name": "main", "mix": {"code": 1, "docs": 2}}])


@pytest.fixture
def switched_checkpoint(tmp_path) -> Path:
    """A checkpoint directory whose step 6 holds a two-segment ledger (a switch at step 4)."""
    config = two_stage_config(tmp_path / "stores")
    with DataFeed(config, mesh()) as feed, manager(tmp_path) as mngr:
        for _ in range(4):
            next(feed)
        save(mngr, 4, feed)
    changed = parse_config(switched_raw(tmp_path), origin="changed.yaml")
    with DataFeed(changed, mesh()) as feed, manager(tmp_path) as mngr:
        mngr.restore(4, args=ocp.args.Composite(data=DataRestore(feed, switch=True)))
        next(feed)
        next(feed)
        save(mngr, 6, feed)
    return tmp_path


def edit_state(root: Path, edit, redo_digest: bool = True) -> None:
    path = root / "ckpt" / "6" / "data" / FILENAME
    state = json.loads(path.read_text())
    edit(state)
    state.pop("digest")
    if redo_digest:
        state["digest"] = data_state.digest_of(state)
    path.write_text(json.dumps(state))


def restore_edited(
    root: Path, edit, redo_digest: bool = True, saved_after_step: bool = False
) -> LedgerError:
    edit_state(root, edit, redo_digest)
    config = parse_config(switched_raw(root), origin="changed.yaml")
    data = DataRestore(DataFeed(config, mesh()), saved_after_step=saved_after_step)
    with data.feed, manager(root) as mngr:
        with pytest.raises(LedgerError) as info:
            mngr.restore(6, args=ocp.args.Composite(data=data))
        assert data.feed.step == 0  # nothing was adopted
    return info.value


def counters(state: dict, segment: int) -> dict:
    return state["ledger"]["segments"][segment]["counters"]


@pytest.mark.parametrize("delta", [5, 10**12])
def test_an_edited_counter_of_a_later_segment_is_refused_with_a_diff(switched_checkpoint, delta):
    def edit(state: dict) -> None:
        counters(state, 1)["code"] += delta

    error = restore_edited(switched_checkpoint, edit)
    lines = str(error).splitlines()
    assert "disagrees with what its ledger and checkpoint imply" in lines[0]
    assert "restore an earlier checkpoint" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("  segments[1].counters.code: ")
    assert "re-derived from segments[0] at step 4" in lines[1]


def test_an_edited_counter_of_the_first_segment_is_refused(switched_checkpoint):
    error = restore_edited(switched_checkpoint, lambda s: counters(s, 0).update(docs=5))
    assert str(error).splitlines()[1] == "  segments[0].counters.docs: 5 recorded, 0 re-derived"


@pytest.mark.parametrize("step", [7, 5, 11, 1])
def test_an_edited_step_is_refused_against_the_checkpoint_step(switched_checkpoint, step):
    """Exactly: the +1 edit too (checkpoint 6 was saved before training step 6)."""
    error = restore_edited(switched_checkpoint, lambda s: s.update(step=step))
    if step < 4:  # before the ledger's last segment: refused when the state is parsed
        assert "before the ledger's last segment" in one_line(error)
    else:
        assert str(error).splitlines()[1] == (
            f"  step: {step} recorded in checkpoint 6, which holds step 6 (saved before "
            "training step 6: saved_after_step=False)"
        )


def test_the_step_is_checked_by_the_trainers_checkpoint_numbering(switched_checkpoint):
    """A trainer that saves checkpoint N after training step N holds step N + 1 there: its
    genuine state restores, and the same state under the other numbering is refused."""
    root = switched_checkpoint
    error = restore_edited(root, lambda s: None, saved_after_step=True)
    assert str(error).splitlines()[1] == (
        "  step: 6 recorded in checkpoint 6, which holds step 7 (saved after training step 6: "
        "saved_after_step=True)"
    )
    edit_state(root, lambda s: s.update(step=7))  # what such a trainer saves at checkpoint 6
    config = parse_config(switched_raw(root), origin="changed.yaml")
    with DataFeed(config, mesh()) as feed, manager(root) as mngr:
        data = DataRestore(feed, saved_after_step=True)
        mngr.restore(6, args=ocp.args.Composite(data=data))
        assert feed.step == 7


def test_an_edit_without_the_digest_is_named_as_damage(switched_checkpoint):
    error = restore_edited(switched_checkpoint, lambda s: s.update(step=7), redo_digest=False)
    assert "digest does not match its content: the file was damaged or edited" in one_line(error)


def test_a_truncated_data_state_is_one_line_on_restore_and_in_the_cli(switched_checkpoint, capsys):
    root = switched_checkpoint
    path = root / "ckpt" / "6" / "data" / FILENAME
    path.write_bytes(path.read_bytes()[:100])
    raw = two_stage_raw(root / "stores")
    feed = DataFeed(parse_config(raw, origin="a.yaml"), mesh())
    with feed, manager(root) as mngr, pytest.raises(LedgerError, match=r"not JSON") as info:
        mngr.restore(6, args=ocp.args.Composite(data=DataRestore(feed)))
    assert "the file is truncated or damaged" in str(info.value)
    assert str(path) in one_line(info.value)
    config = write_yaml(root / "a.yaml", raw)
    code, err = cli(capsys, "inspect", config, "--step", 1, "--ledger", root / "ckpt" / "6")
    assert code == 2 and str(path) in err and "not JSON" in err


def test_the_cli_refuses_a_ledger_with_an_edited_counter(switched_checkpoint, capsys):
    root = switched_checkpoint
    raw = data_state.load_ledger(root / "ckpt" / "6").to_json()
    raw["segments"][1]["counters"]["docs"] += 5  # counters are not in the segment fingerprint
    path = root / "ledger.json"
    path.write_text(json.dumps(raw))
    config = write_yaml(root / "changed.yaml", switched_raw(root))
    code = main(["inspect", str(config), "--step", "5", "--ledger", str(path)])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and lines[0].startswith(f"error: {path}: the data state disagrees")
    assert lines[1].startswith("  segments[1].counters.docs: ") and len(lines) == 2


# -- 2. verify-store and a manifest that lies ------------------------------------------------


def test_an_edited_manifest_is_refused_when_the_store_opens(tmp_path, capsys):
    store = synthetic(tmp_path)
    edit_manifest(store, lambda m: m["shards"][0].update(tokens=90), redo_checksum=False)
    code, err = cli(capsys, "verify-store", store)
    assert code == 2 and f"{store / MANIFEST}: the manifest's checksum" in err
    with pytest.raises(StoreError, match="edited or damaged"):
        TokenStore(store)


def lower_shard_tokens(manifest: dict) -> None:
    manifest["shards"][0]["tokens"] -= 10
    manifest["num_tokens"] -= 10


def test_verify_store_checks_token_counts_against_the_shards(tmp_path, capsys):
    """The index matches its checksum, so the resealed manifest is named, not the index."""
    store = synthetic(tmp_path, flat=False)  # no sidecar, whose size would give it away first
    edit_manifest(store, lower_shard_tokens, redo_checksum=True)  # the checksum is redone
    code, err = cli(capsys, "verify-store", store)
    named = f"error: {store / MANIFEST}: says tokens 0..90, shard-00000-of-00003.index.npy "
    assert code == 2 and err.startswith(named) and "spans tokens 0..100" in err
    assert "the manifest was edited and its checksum redone" in err
    with pytest.raises(StoreError, match="spans tokens"):  # and so does the first read
        TokenStore(store).read_tokens(0, 5)


def test_verify_store_checks_the_dtype_against_the_records(tmp_path, capsys):
    """The records match the sampled digest, so the resealed manifest's dtype is named."""
    store = synthetic(tmp_path, flat=False)  # no sidecar, whose size would give it away first
    edit_manifest(store, lambda m: m.update(dtype="uint16"), redo_checksum=True)
    code, err = cli(capsys, "verify-store", store)
    named = f"error: {store / MANIFEST}: says dtype uint16, record 0 of shard-00000-of-00003."
    assert code == 2 and err.startswith(named) and "holds 64 bytes for 16 tokens" in err
    assert "the manifest was edited and its checksum redone" in err


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lower_shard_tokens, "90 tokens of uint32 (360"),
        (lambda m: m.update(dtype="uint16"), "100 tokens of uint16 (200"),
    ],
)
def test_open_checks_counts_and_dtype_against_the_flat_sidecar(tmp_path, capsys, edit, says):
    """The sidecar matches its checksum: the resealed manifest is named, not the sidecar."""
    store = synthetic(tmp_path)
    edit_manifest(store, edit, redo_checksum=True)
    code, err = cli(capsys, "verify-store", store)
    assert code == 2 and err.startswith(f"error: {store / MANIFEST}: shards[0] says {says} "), err
    assert "flat token sidecar shard-00000-of-00003.flat.bin holds 400 bytes" in err
    assert "the manifest was edited and its checksum redone" in err


def test_a_sidecar_of_the_wrong_size_that_fails_its_checksum_is_named(tmp_path, capsys):
    """Not the manifest's fault: a sidecar truncated after prepare is named itself."""
    store = synthetic(tmp_path)
    sidecar = store / "shard-00000-of-00003.flat.bin"
    sidecar.write_bytes(sidecar.read_bytes()[:-4])
    code, err = cli(capsys, "verify-store", store)
    assert code == 2 and err.startswith(f"error: {sidecar}: flat token sidecar"), err


# -- 3. same-size damage ---------------------------------------------------------------------


@pytest.mark.parametrize("flat", [False, True], ids=["array_record", "sidecar"])
def test_a_same_size_shard_of_a_twin_store_is_refused_not_served(tmp_path, capsys, flat):
    """The identity is checked on the bytes served: a shard's records, or its flat sidecar
    (a twin's sidecar copied with its shard is named, not served)."""
    store = synthetic(tmp_path, flat=flat)
    twin = synthetic(tmp_path, "twin", first=1000, flat=flat)
    victim, donor = TokenStore(store), TokenStore(twin)
    assert victim.shard_file(1).stat().st_size == donor.shard_file(1).stat().st_size
    keys = ("file", "flat") if flat else ("file",)
    for key in keys:  # the sizes cannot tell them apart
        name = victim.manifest["shards"][1][key]
        shutil.copyfile(twin / name, store / name)
    named = store / victim.manifest["shards"][1][keys[-1]]
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"s": store}))
    plan = Plan.from_config(load_config(config))  # opening checks sizes: they agree
    with pytest.raises(StoreError) as info:
        for step in range(40):
            plan.batch(step)
    key = f"{config}: sources.s.path: {named}"  # named by its config key, as at open
    assert one_line(info.value).startswith(f"{key}: its sampled records do not match")
    code, err = cli(capsys, "dump", config, "--steps", "0:40", "--out", tmp_path / "d.npz")
    assert code == 2 and key in err


def test_a_twin_shard_behind_its_own_sidecar_is_named_when_read_through(tmp_path, capsys):
    """A shard served from its sidecar opens no ArrayRecord reader: with only the shard file
    replaced by a twin's, the batches are still the store's own tokens; the first read through
    ArrayRecord and `verify-store` name the shard."""
    store = synthetic(tmp_path)
    twin = synthetic(tmp_path, "twin", first=1000)
    config = load_config(write_yaml(tmp_path / "d.yaml", config_over(tmp_path, {"s": store})))
    expected = [Plan.from_config(config).batch(step) for step in range(12)]
    victim = TokenStore(store).shard_file(1)
    shutil.copyfile(TokenStore(twin).shard_file(1), victim)
    plan = Plan.from_config(config)
    for step, want in enumerate(expected):
        for field in FIELDS:
            np.testing.assert_array_equal(plan.batch(step)[field], want[field])
    reader = TokenStore(store)
    with pytest.raises(StoreError) as info:
        reader.read_tokens(0, reader.num_tokens)
    assert one_line(info.value).startswith(f"{victim}: its sampled records do not match")
    code, err = cli(capsys, "verify-store", store)
    assert code == 2 and err.startswith(f"error: {victim}: ")


def edit_document_index(store: Path) -> Path:
    """Move a document boundary of shard 2 (the file keeps its size); returns the index."""
    docs = TokenStore(store).path / "shard-00002-of-00003.docs.npy"
    values = np.load(docs)
    values[2] += 3  # same file size, other document boundaries
    np.save(docs, values)
    return docs


def test_an_edited_document_index_value_is_refused(tmp_path, capsys):
    store = synthetic(tmp_path)
    docs = edit_document_index(store)
    with pytest.raises(StoreError) as info:
        TokenStore(store).read_tokens(0, int(TokenStore(store).num_tokens))
    assert one_line(info.value).startswith(f"{docs}: does not match its checksum")
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"s": store}))
    code, err = cli(capsys, "dump", config, "--steps", "0:40", "--out", tmp_path / "d.npz")
    assert code == 2 and f"{config}: sources.s.path: {docs}: does not match its checksum" in err


def test_a_best_fit_source_names_a_damaged_document_index_by_its_key(tmp_path, monkeypatch):
    """Packing reads every document index when the plan is made (no packing kept: off)."""
    monkeypatch.setenv("PIPELINE_PACKING_CACHE", "off")
    store = synthetic(tmp_path)
    docs = edit_document_index(store)
    raw = config_over(tmp_path, {"s": store}, seed=11)  # a seed no packing in memory has
    raw["sources"]["s"]["packing"] = "best_fit"
    config = write_yaml(tmp_path / "data.yaml", raw)
    with pytest.raises(StoreError) as info:
        Plan.from_config(load_config(config))
    key = f"{config}: sources.s.path: {docs}"
    assert one_line(info.value).startswith(f"{key}: does not match its checksum")


# -- 4. a store replaced under a running feed ------------------------------------------------


def corpus(directory: Path, words: str, count: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (directory / f"doc{i:03d}.txt").write_text(f"{words} {i} " * (5 + i % 7))
    return directory


def feed_across_a_replacement(tmp: Path, out: Any, **overrides) -> str:
    """Feed a store of 8 shards (`out`: a local path or a bucket URL's `location`), replace it
    after the first step by `prepare --overwrite` of a corpus of the same lengths (the same
    record layout: only the tokens differ), and feed until the feed stops. Every batch served
    must be the old store's: a fresh prepare of it (prepare is deterministic) gives them. Returns
    the stop's one-line error."""
    old = corpus(tmp / "old", "alpha", 60)
    new = corpus(tmp / "new", "omega", 60)
    prepare(PrepareOptions([str(old)], out, num_shards=8, progress=False))
    config = parse_config(config_over(tmp, {"s": out}, **overrides), "r.yaml")
    served = []
    with DataFeed(config, mesh(), prefetch=1, threads=1) as feed:
        served.append(np.asarray(next(feed)["inputs"]))
        prepare(PrepareOptions([str(new)], out, num_shards=8, overwrite=True, progress=False))
        with pytest.raises(FeedError) as info:
            for _ in range(500):
                served.append(np.asarray(next(feed)["inputs"]))
    reference = tmp / "reference"
    prepare(PrepareOptions([str(old)], reference, num_shards=8, progress=False))
    expected = Plan.from_config(
        parse_config(config_over(tmp, {"s": reference}, **overrides), "r.yaml")
    )
    for step, batch in enumerate(served):
        np.testing.assert_array_equal(batch, expected.batch(step)["inputs"])
    return one_line(info.value)


def test_a_store_replaced_under_a_running_feed_stops_it_and_serves_nothing_new(tmp_path):
    out = tmp_path / "store"
    message = feed_across_a_replacement(tmp_path, out, lanes=1, global_batch_size=2)
    assert f"{out / MANIFEST}: the store was replaced or changed after it was opened" in message


def test_a_flat_sidecar_replaced_after_its_first_use_is_refused_at_its_next(tmp_path):
    store = TokenStore(synthetic(tmp_path), max_open_shards=1)
    flat = store.path / store.manifest["shards"][0]["flat"]
    out = np.zeros((1, 5), np.uint32)
    read_pieces([store], [0], [0], [0], [5], out, [0], [0])  # its identity taken
    read_pieces([store], [0], [1], [0], [5], out, [0], [0])  # shard 0 closed (the bound)
    content = flat.read_bytes()
    flat.unlink()
    flat.write_bytes(content)  # the same bytes in another file: still not the one read
    with pytest.raises(StoreError) as info:
        read_pieces([store], [0], [0], [0], [5], out, [0], [0])
    assert one_line(info.value).startswith(f"{flat}: the flat token sidecar was replaced")
    np.testing.assert_array_equal(TokenStore(store.path).read_tokens(0, 5).tokens, np.arange(5))


def prepared_twice(tmp: Path) -> tuple[Path, Callable[[], None]]:
    """A store prepared at `tmp`/store, and what prepares other content there (`--overwrite`)."""
    out = tmp / "store"
    old, new = corpus(tmp / "old", "alpha", 60), corpus(tmp / "new", "omega", 61)
    prepare(PrepareOptions([str(old)], out, num_shards=2, progress=False))
    options = PrepareOptions([str(new)], out, num_shards=2, overwrite=True, progress=False)
    return out, lambda: prepare(options)


def replaced_line(key: str, store: Path, recorded: str) -> str:
    """The one line of a store whose content changed since the ledger recorded `recorded`."""
    return (
        f"{key}: {store}: the store has content fingerprint {StoreMeta.load(store).fingerprint}, "
        f"the ledger recorded {recorded}: it was replaced after the ledger recorded it (by "
        "`prepare --overwrite`?); a new run: restart it to read the new store; a resumed run: "
        "put the recorded store back there (the same inputs and prepare options rebuild it) and "
        "prepare new content at another path to switch to it"
    )


def test_a_store_replaced_before_its_first_read_is_named_by_its_key(tmp_path):
    """A plan of metadata opens a store at its first read: content replaced since the plan
    read the manifest is refused there (not served), named by the source's config key."""
    store, replace = prepared_twice(tmp_path)
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"s": store}))
    meta = StoreMeta.load(store)
    plan = Plan.from_config(load_config(config), {"s": meta})
    replace()
    with pytest.raises(StoreError) as info:
        plan.batch(0)
    assert one_line(info.value) == replaced_line(
        f"{config}: sources.s.path", store, meta.fingerprint
    )


def test_a_best_fit_store_replaced_before_its_layout_is_named_by_its_key(tmp_path):
    """A best_fit source's store opens when its segment is laid out (`resume.reconcile` lays
    out a switch from metadata): a replaced one is named by the source's key there too."""
    store, replace = prepared_twice(tmp_path)
    raw = config_over(tmp_path, {"s": store})
    raw["sources"]["s"]["packing"] = "best_fit"
    config = load_config(write_yaml(tmp_path / "data.yaml", raw))
    meta = StoreMeta.load(store)
    segment = Plan.from_config(config, {"s": meta}).ledger.segments[0]
    replace()
    with pytest.raises(StoreError) as info:
        SegmentPlan(segment, config, {"s": meta})
    key = f"{config.origin}: sources.s.path"
    assert one_line(info.value) == replaced_line(key, store, meta.fingerprint)


def test_a_restore_onto_a_store_prepared_again_in_place_says_to_put_it_back(tmp_path):
    """Even a declared switch cannot plan the steps drawn from the old content; the remedy the
    line gives works: the old store prepared again from the same inputs resumes the run."""
    store, replace = prepared_twice(tmp_path)
    config = parse_config(config_over(tmp_path, {"s": store}, lanes=1), "r.yaml")
    with DataFeed(config, mesh()) as feed, manager(tmp_path) as mngr:
        next(feed)
        save(mngr, 1, feed)
    recorded = StoreMeta.load(store).fingerprint
    replace()
    with (
        DataFeed(config, mesh()) as feed,
        manager(tmp_path) as mngr,
        pytest.raises(StoreError) as info,
    ):
        mngr.restore(1, args=ocp.args.Composite(data=DataRestore(feed, switch=True)))
    key = "ledger segment 0 (from step 0): sources.s.path"
    assert one_line(info.value) == replaced_line(key, store, recorded)
    old = [str(tmp_path / "old")]
    prepare(PrepareOptions(old, store, num_shards=2, overwrite=True, progress=False))
    with DataFeed(config, mesh()) as feed, manager(tmp_path) as mngr:
        mngr.restore(1, args=ocp.args.Composite(data=DataRestore(feed)))
        assert feed.step == 1


def test_a_ledgers_store_prepared_again_in_place_is_one_line_in_the_cli(tmp_path, capsys):
    """A run switched from store `a` to `b`, then `a` was prepared again in place: the steps
    before the switch cannot be planned, and every plan command says so in one line."""
    store, replace = prepared_twice(tmp_path)
    first = load_config(write_yaml(tmp_path / "a.yaml", config_over(tmp_path, {"s": store})))
    other = synthetic(tmp_path, "b")
    second = write_yaml(tmp_path / "b.yaml", config_over(tmp_path, {"s": other}))
    ledger = reconcile(Plan.from_config(first), load_config(second), 3, switch=True)
    ledger.save(tmp_path / "ledger.json")
    recorded = ledger.segments[0].fingerprints["s"]
    replace()
    key = "ledger segment 0 (from step 0): sources.s.path"
    args = [second, "--ledger", tmp_path / "ledger.json"]
    for command in (
        ["inspect", *args, "--step", 0],
        ["dump", *args, "--steps", "0:2", "--out", tmp_path / "d.npz"],
        ["verify", *args, "--steps", "0:2"],
    ):
        code, err = cli(capsys, *command)
        assert (code, err) == (2, f"error: {replaced_line(key, store, recorded)}\n"), command


# -- 5. duplicate YAML keys ------------------------------------------------------------------

DUPLICATES = {
    "seq_len": "seq_len: 8\nglobal_batch_size: 4\nseq_len: 16\n",
    "path": "seq_len: 8\nglobal_batch_size: 4\nsources:\n  a: {path: x, path: y}\n",
    "weight": "seq_len: 8\nglobal_batch_size: 4\nmix:\n  a: 1\n  b: 2\n  a: 3\n",
    "point": "seq_len: 8\nglobal_batch_size: 4\nmix:\n  a: {linear: {0: 1, 10: 2, 0: 5}}\n",
}


@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_duplicate_keys_are_refused_with_their_lines(tmp_path, case):
    path = tmp_path / "dup.yaml"
    path.write_text(DUPLICATES[case])
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line(info.value)
    assert message.startswith(f"{path}:") and "duplicate key" in message
    assert "(first at line" in message


# -- 6. stores of different tokenizers -------------------------------------------------------


def test_stores_of_different_tokenizers_do_not_mix_silently(tmp_path, hf_tokenizer_json, capsys):
    text = corpus(tmp_path / "text", "mixed tokenizers", 30)
    prepare(PrepareOptions([str(text)], tmp_path / "bytes", num_shards=2, progress=False))
    spec = f"hf:{hf_tokenizer_json}"
    options = PrepareOptions([str(text)], tmp_path / "hf", tokenizer=spec, progress=False)
    prepare(options)
    sources = {"a": tmp_path / "bytes", "b": tmp_path / "hf"}
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, sources))
    code, err = cli(capsys, "stages", config)
    assert code == 2 and "sources.a and sources.b were prepared with different tokenizers" in err
    assert "(bytes, vocab 257 vs hf:tokenizer.json@" in err and "shared_vocabulary" in err
    raw = config_over(tmp_path, sources, shared_vocabulary=True)
    shared = write_yaml(tmp_path / "shared.yaml", raw)
    assert Plan.from_config(load_config(shared)).batch(0)["inputs"].shape == (4, 8)


def test_an_eval_store_of_another_tokenizer_is_refused(tmp_path, hf_tokenizer_json, capsys):
    text = corpus(tmp_path / "text", "eval tokenizers", 30)
    prepare(PrepareOptions([str(text)], tmp_path / "bytes", num_shards=2, progress=False))
    spec = f"hf:{hf_tokenizer_json}"
    prepare(PrepareOptions([str(text)], tmp_path / "hf", tokenizer=spec, progress=False))
    held = {"sources": {"held": {"path": str(tmp_path / "hf")}}}
    raw = config_over(tmp_path, {"a": tmp_path / "bytes"}, eval=held)
    code, err = cli(capsys, "stages", write_yaml(tmp_path / "data.yaml", raw))
    assert code == 2 and "sources.a and eval.sources.held were prepared with different" in err


# -- 7. schedules cost O(points) -------------------------------------------------------------


@pytest.mark.parametrize("last", [3 * 10**8, 10**12])
def test_a_far_schedule_point_costs_what_a_near_one_costs(tmp_path, last):
    store = synthetic(tmp_path)
    twin = synthetic(tmp_path, "twin", first=1000)
    mix = {"a": {"linear": {0: 1, last: 0}}, "b": {"step": {0: 1, last: 3}}}
    raw = config_over(tmp_path, {"a": store, "b": twin}, mix=mix)
    tracemalloc.start()
    try:
        plan = Plan.from_config(parse_config(raw, "far.yaml"))
        for step in (0, last // 2, last - 1, last, last + 10**6):
            assert plan.batch(step)["inputs"].shape == (4, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak  # the plan holds O(points), not O(steps)


# -- the full checksum pass as a feed policy -----------------------------------------------


def damage_an_unsampled_record(store: Path) -> Path:
    """Flip a byte of record 1 of shard 2 (records 0, 4, 8 and 12 are the sampled ones)."""
    shard = store / "shard-00002-of-00003.array_record"
    reader = TokenStore(store)
    start, stop = reader.record_offsets(2)[1:3]
    tokens = reader.read_shard_tokens(2, int(start), int(stop)).tokens  # record 1's tokens
    data = bytearray(shard.read_bytes())
    where = bytes(data).index(tokens.tobytes())
    data[where + 5] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize("policy", ["open", "background"])
def test_the_feed_verify_policy_finds_damage_the_identity_cannot(tmp_path, policy):
    store = synthetic(tmp_path)
    shard = damage_an_unsampled_record(store)
    raw = config_over(tmp_path, {"s": store}, feed={"verify": policy})
    TokenStore(store).record_offsets(2)  # the shard's identity checks pass: not sampled
    named = f"v.yaml: sources.s.path: {shard}"  # the source's config key, as at open
    if policy == "open":
        with pytest.raises(StoreError) as info:
            DataFeed(parse_config(raw, "v.yaml"), mesh()).close()
        assert one_line(info.value).startswith(f"{named}: content checksum does not match")
        return
    with DataFeed(parse_config(raw, "v.yaml"), mesh()) as feed:
        feed._verifier._thread.join()  # let the pass finish, so the next step must see it
        with pytest.raises(FeedError) as info:
            next(feed)
    message = one_line(info.value)
    assert message.startswith(f"background store verification failed: {named}: content")


def test_a_store_shared_by_two_sources_is_named_by_the_first(tmp_path):
    """One store (one fingerprint, verified once) under two keys: the first of the config's
    sources (by name) finds its path, the same under both, and the line keeps the one-key
    format of a read."""
    store = synthetic(tmp_path)
    shard = damage_an_unsampled_record(store)
    raw = config_over(tmp_path, {"web": store, "code": store}, feed={"verify": "background"})
    with DataFeed(parse_config(raw, "v.yaml"), mesh()) as feed:
        feed._verifier._thread.join()
        with pytest.raises(FeedError) as info:
            next(feed)
    named = f"v.yaml: sources.code.path: {shard}: content checksum does not match"
    assert one_line(info.value).startswith(f"background store verification failed: {named}")


@pytest.mark.parametrize(
    ("value", "policy"),
    [(None, "read"), (False, "off"), ("off", "off"), ("read", "read"), ("open", "open")],
)
def test_the_verify_policy_parses(tmp_path, value, policy):
    feed = {} if value is None else {"verify": value}
    raw = config_over(tmp_path, {"s": tmp_path / "s"}, feed=feed)
    assert parse_config(raw, "v.yaml").feed.verify == policy
    raw["feed"]["verify"] = "always"
    expected = r"feed\.verify: expected one of off, read, open, background"
    with pytest.raises(ConfigError, match=expected):
        parse_config(raw, "v.yaml")


@pytest.mark.parametrize(("value", "threads"), [(None, "auto"), ("auto", "auto"), (3, 3)])
def test_the_thread_count_parses(tmp_path, value, threads):
    feed = {} if value is None else {"threads": value}
    raw = config_over(tmp_path, {"s": tmp_path / "s"}, feed=feed)
    assert parse_config(raw, "t.yaml").feed.threads == threads


@pytest.mark.parametrize("value", ["two", "Auto", "AUTO", 0, -2, 1.5, True, [1]])
def test_a_bad_thread_count_is_one_line(tmp_path, value):
    """Only lower-case `auto`, like every other word of the config (`verify: open`)."""
    raw = config_over(tmp_path, {"s": tmp_path / "s"}, feed={"threads": value})
    with pytest.raises(ConfigError) as info:
        parse_config(raw, "t.yaml")
    assert str(info.value) == (
        f"t.yaml: feed.threads: expected an integer >= 1 or auto, got {value!r}"
    )


# -- 8. one line instead of a traceback ------------------------------------------------------


def test_a_config_that_is_not_utf8_is_one_line(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("seq_len: 8\n# café\n".encode("latin-1"))
    code, err = cli(capsys, "stages", path)
    assert code == 2 and f"{path}:2: not UTF-8 text" in err


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"global_batch_size": 10**12}, "global_batch_size"),
        ({"seq_len": 2**40}, "seq_len"),
        ({"seed": 2**70}, "seed"),
        ({"mix": {"s": {"step": {0: 1, 10**19: 2}}}}, "mix.s"),
        ({"feed": {"threads": 10**9}}, "feed.threads"),
    ],
)
def test_absurd_values_are_one_line(tmp_path, capsys, override, key):
    store = synthetic(tmp_path)
    config = write_yaml(tmp_path / "big.yaml", config_over(tmp_path, {"s": store}, **override))
    code, err = cli(capsys, "stages", config)
    assert code == 2 and f"{config}: {key}: " in err and "beyond" in err


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[: len(b) // 2], lambda b: b[:10] + bytes(len(b) - 10), lambda b: b"garbage"],
    ids=["truncated", "garbled-header", "not-npy"],
)
def test_a_damaged_index_is_one_line_naming_it(tmp_path, capsys, damage):
    store = synthetic(tmp_path)
    for index in store.glob("*.index.npy"):  # every shard's, so any read meets one
        index.write_bytes(damage(index.read_bytes()))
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"s": store}))
    named = f"{config}: sources.s.path: {store}/shard-0000"  # the source's key, as at open
    dump = ["dump", config, "--steps", "0:40", "--out", tmp_path / "o.npz"]
    for command in (["inspect", config, "--step", 0], dump):
        code, err = cli(capsys, *command)
        assert code == 2 and named in err and ".index.npy: " in err
    with DataFeed(load_config(config), mesh()) as feed, pytest.raises(FeedError) as info:
        for _ in range(40):
            next(feed)
    assert named in one_line(info.value) and ".index.npy: " in str(info.value)


@pytest.mark.parametrize("redo", [False, True])
def test_a_manifest_without_shards_is_one_line(tmp_path, capsys, redo):
    store = synthetic(tmp_path)
    edit_manifest(store, lambda m: m.pop("shards"), redo_checksum=redo)
    code, err = cli(capsys, "verify-store", store)
    expected = "manifest field 'shards' must be a non-empty list" if redo else "checksum"
    assert code == 2 and f"{store / MANIFEST}: " in err and expected in err


def test_a_store_whose_manifest_has_no_created_record_verifies(tmp_path, capsys):
    """`created` (how the store was prepared) is informative: a manifest need not have it."""
    store = synthetic(tmp_path)
    edit_manifest(store, lambda m: m.pop("created"), redo_checksum=True)
    code = main(["verify-store", str(store)])
    assert code == 0 and capsys.readouterr().out.startswith(f"ok: {store}: ")


@pytest.mark.parametrize("suffix", ["array_record", "flat.bin"])
def test_verify_store_and_the_feed_on_a_zeroed_file_name_it(tmp_path, capsys, suffix):
    """A zeroed shard (in a store without sidecars, where the feed reads it) or sidecar (which
    the feed reads instead of the shard): named by `verify-store`, and by the first read."""
    store = synthetic(tmp_path, flat=suffix == "flat.bin")
    zeroed = store / f"shard-00000-of-00003.{suffix}"
    zeroed.write_bytes(bytes(zeroed.stat().st_size))
    code, err = cli(capsys, "verify-store", store)
    assert code == 2 and err.startswith(f"error: {zeroed}: ")
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"s": store}))
    code, err = cli(capsys, "dump", config, "--steps", "0:40", "--out", tmp_path / "o.npz")
    named = f"error: {config}: sources.s.path: {zeroed}: "  # the source's key, as at open
    assert code == 2 and err.startswith(named) and "[0, 0)" not in err


def test_damage_in_a_store_nested_in_another_names_the_nested_source(tmp_path, capsys):
    """Both roots prefix the damaged file's path: the longer one, the nested store's, is it."""
    outer = synthetic(tmp_path, "web")
    inner = synthetic(outer, "eval", first=7)  # other content: a store of its own
    zeroed = inner / "shard-00000-of-00003.flat.bin"
    zeroed.write_bytes(bytes(zeroed.stat().st_size))
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"a": outer, "b": inner}))
    code, err = cli(capsys, "dump", config, "--steps", "0:40", "--out", tmp_path / "o.npz")
    assert code == 2 and err.startswith(f"error: {config}: sources.b.path: {zeroed}: "), err


@pytest.mark.parametrize("verify", ["read", "background"])
def test_damage_in_one_of_two_copies_of_a_store_names_the_copy_read(tmp_path, capsys, verify):
    """Two sources on copies of one store (one fingerprint, so one copy is read for both):
    the key named is the source whose path holds the file named, never the other copy's."""
    first = synthetic(tmp_path, "a")
    second = tmp_path / "b"
    shutil.copytree(first, second)
    for copy in (first, second):  # whichever copy the plan reads, it is damaged
        if verify == "background":
            damage_an_unsampled_record(copy)  # found by the full pass only
        else:
            zeroed = copy / "shard-00000-of-00003.flat.bin"
            zeroed.write_bytes(bytes(zeroed.stat().st_size))
    sources = {"a": first, "b": second}
    if verify == "read":
        config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, sources))
        code, err = cli(capsys, "dump", config, "--steps", "0:40", "--out", tmp_path / "o.npz")
        assert code == 2, err
        message = err.removeprefix("error: ")
    else:
        raw = config_over(tmp_path, sources, feed={"verify": "background"})
        with DataFeed(parse_config(raw, "v.yaml"), mesh()) as feed:
            feed._verifier._thread.join()
            with pytest.raises(FeedError) as info:
                next(feed)
        message = one_line(info.value).removeprefix("background store verification failed: ")
    name, file = re.match(r"\S+: sources\.(\w+)\.path: (\S+): ", message).groups()
    assert Path(file).is_relative_to(sources[name]), message


def test_prepare_overwrite_refuses_a_regular_file_before_touching_it(tmp_path, capsys):
    text = corpus(tmp_path / "text", "hello", 3)
    out = tmp_path / "notes.txt"
    out.write_text("my notes")
    code, err = cli(capsys, "prepare", text, "--out", out, "--overwrite", "--no-progress")
    assert code == 2 and f"{out}: --out exists and is not a directory" in err
    assert "--overwrite replaces a directory, deleting whatever it holds" in err  # not "a store"
    assert out.read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "text"]


def test_prepare_help_says_overwrite_deletes_any_directory_at_out(capsys):
    """A newcomer reading --help must not take --overwrite for a store-only replacement."""
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--overwrite replace an existing --out directory, deleting whatever it holds" in (
        help_text
    )


# -- 9. smaller ones -------------------------------------------------------------------------


def test_yaml_syntax_errors_name_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seq_len: 8\nsources:\n  a: {path: x\nmix: {a: 1}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line(info.value)
    assert message.startswith(f"{path}:4:4: not valid YAML: expected ',' or '}}'"), message


@pytest.mark.parametrize("command", ["inspect", "verify", "stages", "epochs"])
def test_a_missing_or_too_small_eval_store_is_refused_by_every_command(tmp_path, capsys, command):
    store = synthetic(tmp_path)
    small = tmp_path / "small"
    write_synthetic_store(small, [[5, 6]])
    extra = {"inspect": ["--step", 0], "verify": ["--steps", "0:2"]}.get(command, [])
    cases = ((tmp_path / "absent", "no such store directory"), (small, "do not fill one batch"))
    for eval_path, expected in cases:
        held = {"sources": {"held": {"path": str(eval_path)}}}
        raw = config_over(tmp_path, {"s": store}, eval=held)
        config = write_yaml(tmp_path / "data.yaml", raw)
        code, err = cli(capsys, command, config, *extra)
        assert code == 2 and "eval.sources.held" in err and expected in err
        assert err.count("sources.held") == 1, err  # the key once, not the eval's and the plan's


def test_leftovers_of_killed_prepares_are_cleaned_by_the_next_one(tmp_path):
    text = corpus(tmp_path / "text", "left over", 5)
    out = tmp_path / "store"
    retired = tmp_path / ".store.retired-0badf00d"
    dead = tmp_path / ".store.partial-999999999-0badf00d"  # no such process
    alive = tmp_path / f".store.partial-{os.getpid()}-0badf00d"  # a run still going
    other = tmp_path / ".other.retired-0badf00d"  # another --out's
    for path in (retired, dead, alive, other):
        (path / "shard").mkdir(parents=True)
    prepare(PrepareOptions([str(text)], out, num_shards=1, progress=False))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == sorted(
        [alive.name, other.name]
    )


def test_a_bad_manifest_dtype_is_blamed_on_the_manifest(tmp_path, capsys):
    store = synthetic(tmp_path)
    edit_manifest(store, lambda m: m.update(dtype="float7"), redo_checksum=True)
    code, err = cli(capsys, "verify-store", store)
    assert code == 2 and f"{store / MANIFEST}: manifest field 'dtype'" in err


# -- 7 (issue). randomized kill -9 against the plan, real processes -------------------------


@pytest.mark.multiprocess
def test_random_kills_never_change_a_trained_batch(tmp_path):
    """kill -9 at random steps, some while an async save is in flight; every step trained,
    replayed ones included, equals the plan's batch. The seed is printed on failure."""
    from tests.test_multihost import launch, read_log, reference_checksums, worker_output

    seed = int(os.environ.get("PIPELINE_TEST_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    total, every = 24, 3
    raw = two_stage_raw(tmp_path / "stores")
    plan = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
    # One kill while the async save of its step is in flight (steps k * every save), two more
    # at any step (right after that step's save was started, when it has one).
    in_save = rng.randrange(every, total - 2, every)
    others = rng.sample([s for s in range(2, total - 2) if s != in_save], 2)
    kills = sorted([(in_save, "save"), *((s, "step") for s in others)])
    for kill_at, mode in [*kills, (None, "step")]:
        task = {"kind": "train", "ckpt": str(tmp_path / "ckpt"), "steps": total,
                "log": str(tmp_path / "run.jsonl"), "save_every": every,
                "kill_at": kill_at, "kill_mode": mode}  # fmt: skip
        codes = launch(tmp_path, raw, [task], 2, 2, timeout=180)
        expected = [0, 0] if kill_at is None else [-signal.SIGKILL] * 2
        assert codes == expected, (seed, kill_at, mode, worker_output(tmp_path))
    entries = read_log(tmp_path / "run.jsonl")
    assert {e["step"] for e in entries} == set(range(total)), seed
    for entry in entries:
        expected = reference_checksums(plan.batch(entry["step"]))
        np.testing.assert_array_equal(entry["sums"], expected, err_msg=f"seed {seed}")
    assert FIELDS  # the checksums cover every field (reference_checksums)


def train_in_processes(
    tmp_path: Path,
    raw: dict,
    processes: int,
    total: int,
    every: int,
    kill_at: int | None,
    **task: Any,
) -> list[dict]:
    """Train `raw` on `processes` real processes (4 devices in all) to step `total`, saving every
    `every` steps into tmp_path/ckpt and SIGKILLed at step `kill_at` (None: to the end); the
    log entries of this launch (tmp_path/run.jsonl), checked to be consecutive steps."""
    from tests.test_multihost import launch, read_log, worker_output

    log = tmp_path / "run.jsonl"
    seen = len(read_log(log)) if log.exists() else 0
    task = {"kind": "train", "ckpt": str(tmp_path / "ckpt"), "steps": total, "log": str(log),
            "save_every": every, "kill_at": kill_at, "kill_mode": "step", **task}  # fmt: skip
    codes = launch(tmp_path, raw, [task], processes, 4 // processes, timeout=180)
    expected = [0] * processes if kill_at is None else [-signal.SIGKILL] * processes
    assert codes == expected, (kill_at, worker_output(tmp_path))
    entries = read_log(log)[seen:]
    steps = [e["step"] for e in entries]
    assert steps == list(range(steps[0], total if kill_at is None else kill_at + 1))
    return entries


@pytest.mark.multiprocess
def test_kills_and_a_host_count_change_across_a_skip_keep_every_batch_exact(tmp_path):
    """2 processes killed at step 10; 1 process resumes from the latest checkpoint skipping 5
    steps and is killed at step 17; 2 processes resume from the latest checkpoint (its ledger
    holds the skip): every step trained before the skip is the plan's step, every one after
    it the plan's step + 5, and `pipeline dump --ledger` of the last checkpoint agrees."""
    from tests.test_multihost import reference_checksums

    total, every, skip = 24, 4, 5
    raw = two_stage_raw(tmp_path / "stores")
    plan = Plan.from_config(parse_config(raw, origin="multihost.yaml"))
    firsts = []
    for processes, kill_at, skip_steps in ((2, 10, 0), (1, 17, skip), (2, None, 0)):
        entries = train_in_processes(
            tmp_path, raw, processes, total, every, kill_at, skip_steps=skip_steps
        )
        firsts.append(entries[0]["step"])  # a restored checkpoint's data step (N holds N + 1)
        shift = skip if len(firsts) > 1 else 0
        for entry in entries:
            batch = plan.batch(entry["step"] + shift)
            np.testing.assert_array_equal(entry["sums"], reference_checksums(batch))
    assert firsts[0] == 0 and 0 < firsts[1] <= 11 and firsts[2] > firsts[1]
    dumped = tmp_path / "dump.npz"
    last = max(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    config = write_yaml(tmp_path / "multihost.yaml", raw)
    steps = range(firsts[1], last + 1)
    argv = ["dump", config, "--ledger", tmp_path / "ckpt" / str(last), "--steps",
            f"{steps[0]}:{steps[-1] + 1}", "--out", dumped]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    inputs = np.load(dumped)["inputs"]
    for offset, step in enumerate(steps):
        np.testing.assert_array_equal(inputs[offset], plan.batch(step + skip)["inputs"])


SWITCH_TOTAL, SWITCH_EVERY = 26, 4  # the switch test's runs: train to 26, saving every 4 steps


@pytest.fixture(scope="module")
def killed_before_a_switch(tmp_path_factory) -> tuple[Path, list[dict]]:
    """2 processes at seq_len 32 on 1 lane (`geometry_raw`), killed at step 10: the first launch
    of each switch test below, run once (its directory and log entries); each test continues a
    copy of its checkpoints and log, never the original."""
    from tests.feedstores import geometry_raw

    base = tmp_path_factory.mktemp("before-switch")
    raw = geometry_raw(base / "stores")
    return base, train_in_processes(base, raw, 2, SWITCH_TOTAL, SWITCH_EVERY, 10)


@pytest.mark.multiprocess
@pytest.mark.parametrize("switch", ["seq_len", "exclude"])
def test_kills_and_host_count_changes_across_a_seq_len_switch_keep_every_batch_exact(
    tmp_path, switch, killed_before_a_switch
):
    """2 processes at seq_len 32 on 1 lane, killed at step 10; 1 process restores the latest
    checkpoint switching to seq_len 64 on 2 lanes without chat (or to a config that takes
    documents down), killed at step 18; 4 processes resume (bringing chat back at seq_len 64:
    it carries its counter and epoch from step 10's segment, issue 35), killed at step 22; 2
    processes finish. Every step trained (the replayed ones on another process count included)
    is the switched plan's, `pipeline dump --ledger` agrees, and `pipeline verify --ledger`
    finds no row served twice."""
    from tests.feedstores import excluding_raw, geometry_raw
    from tests.test_multihost import reference_checksums

    total, every = SWITCH_TOTAL, SWITCH_EVERY
    base, killed = killed_before_a_switch
    shutil.copytree(base / "ckpt", tmp_path / "ckpt")
    shutil.copyfile(base / "run.jsonl", tmp_path / "run.jsonl")
    stores = base / "stores"  # read only; the take-down files are written beside them
    before = geometry_raw(stores)
    if switch == "seq_len":
        after, shape = geometry_raw(stores, 64, 2), (4, 64)
        without_chat = geometry_raw(stores, 64, 2)
        del without_chat["sources"]["chat"]
        without_chat["stages"][0]["mix"] = {"web": 1}
        runs = ((1, 18, without_chat, True), (4, 22, after, True), (2, None, after, False))
    else:
        after, shape = excluding_raw(stores), (4, 32)
        runs = ((1, 18, after, True), (4, 22, after, False), (2, None, after, False))
    firsts, plan = [killed[0]["step"]], Plan.from_config(parse_config(before, "multihost.yaml"))
    for entry in killed:  # the shared first launch: 2 processes on `before`, killed at step 10
        np.testing.assert_array_equal(entry["sums"], reference_checksums(plan.batch(entry["step"])))
    for processes, kill_at, raw, switch_to in runs:
        entries = train_in_processes(
            tmp_path, raw, processes, total, every, kill_at, switch_to=raw if switch_to else None
        )
        firsts.append(entries[0]["step"])
        if switch_to:  # the switch the restore declared, at the restored step
            switched = parse_config(raw, origin="switched.yaml")
            plan = Plan(reconcile(plan, switched, firsts[-1], switch=True), plan.stores())
        for entry in entries:
            batch = plan.batch(entry["step"])
            np.testing.assert_array_equal(entry["sums"], reference_checksums(batch))
    assert firsts[1] < 10 < 18 and firsts[1] < firsts[2] <= 18 and firsts[3] <= 22  # replayed
    assert plan.batch(firsts[1])["inputs"].shape == shape
    last = max(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    config_file = write_yaml(tmp_path / "multihost.yaml", after)
    dumped = tmp_path / "dump.npz"
    argv = ["dump", config_file, "--ledger", tmp_path / "ckpt" / str(last), "--steps",
            f"{firsts[1]}:{last + 1}", "--out", dumped]  # fmt: skip
    assert main([str(a) for a in argv]) == 0
    inputs = np.load(dumped)["inputs"]
    for offset, step in enumerate(range(firsts[1], last + 1)):
        np.testing.assert_array_equal(inputs[offset], plan.batch(step)["inputs"])
    argv = ["verify", config_file, "--ledger", tmp_path / "ckpt" / str(last), "--steps",
            f"0:{last + 1}"]  # fmt: skip
    assert main([str(a) for a in argv]) == 0  # no window twice in an epoch, epochs complete
    if switch == "seq_len":  # chat came back where it had been left out
        ledger = data_state.load_ledger(tmp_path / "ckpt" / str(last))
        left = plan.segment_plan(0).counters_at(firsts[1])["chat"]
        assert "chat" not in ledger.segments[1].counters
        assert ledger.segments[2].counters["chat"] == left > 0


# -- 4 and issue 17: one host's fatal data error stops every host with its line --------------


def last_line(log: Path) -> str:
    return [line for line in log.read_text().splitlines() if line.strip()][-1]


def launch_until_ready(tmp: Path, raw: dict, task: dict, between) -> tuple[list[int], list[str]]:
    """Run the 'stop' task on 2 processes; `between()` runs once both served 3 steps."""
    from tests.test_multihost import launch

    def release() -> None:
        deadline = time.monotonic() + 120
        while not all((tmp / f"ready-{i}").exists() for i in range(2)):
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        between()
        (tmp / "go").touch()

    helper = threading.Thread(target=release, daemon=True)
    helper.start()
    codes = launch(tmp, raw, [task], 2, 2, timeout=150)
    helper.join()
    return codes, [last_line(log) for log in sorted(tmp.glob("spec-*-*.log"))]


def feed_until_error(feed: DataFeed) -> str:
    """Step `feed` until it raises, for up to 30 s: the watcher's identity check runs on its own
    period, not per step. Returns the one-line error."""
    with pytest.raises(FeedError) as info:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            next(feed)
            time.sleep(0.01)
    return one_line(info.value)


def test_a_store_replaced_after_every_shard_was_opened_stops_the_feed(tmp_path, monkeypatch):
    """No shard opens after the replacement: the feed's periodic identity check finds it."""
    monkeypatch.setenv(host_stop.STORE_CHECK_ENV, "0.05")
    out = tmp_path / "store"
    old = corpus(tmp_path / "old", "alpha", 60)
    prepare(PrepareOptions([str(old)], out, num_shards=1, progress=False))
    config = parse_config(config_over(tmp_path, {"s": out}, lanes=1, global_batch_size=2), "r.yaml")
    with DataFeed(config, mesh(), prefetch=1, threads=1) as feed:
        next(feed)
        assert feed.plan.stores()[0].num_shards == 1  # opened by the first step
        new = corpus(tmp_path / "new", "omega", 60)
        prepare(PrepareOptions([str(new)], out, num_shards=1, overwrite=True, progress=False))
        message = feed_until_error(feed)
    assert message == (
        f"r.yaml: sources.s.path: {out / MANIFEST}: the store was replaced or changed after it "
        "was opened (by `prepare --overwrite`?); restart the job to read the new store"
    )


@pytest.fixture
def quick_stop(monkeypatch):
    """The stop watcher's periods cut for the 2-process tests (their workers inherit the
    environment): at the defaults (2 s poll, 10 s store check and grace) a test only waits."""
    monkeypatch.setenv(host_stop.STORE_CHECK_ENV, "0.25")
    monkeypatch.setenv(host_stop.POLL_ENV, "0.25")
    monkeypatch.setenv(host_stop.GRACE_ENV, "2")


@pytest.mark.multiprocess
def test_a_store_replaced_under_two_processes_stops_both_with_its_line(tmp_path, quick_stop):
    """One shard, opened by the first step on both processes: what finds the replacement is
    the feed's periodic identity check, on one host or both."""
    out = tmp_path / "store"
    old = corpus(tmp_path / "old", "alpha", 60)
    new = corpus(tmp_path / "new", "omega", 60)
    prepare(PrepareOptions([str(old)], out, num_shards=1, progress=False))
    raw = config_over(tmp_path, {"s": out}, lanes=2, global_batch_size=4)

    def replace() -> None:
        argv = ["prepare", str(new), "--out", str(out), "--num-shards", "1", "--overwrite"]
        assert main(argv) == 0

    task = {"kind": "stop", "fault": "replace", "faulty": None}
    codes, lines = launch_until_ready(tmp_path, raw, task, replace)
    from tests.test_multihost import worker_output

    assert codes == [2, 2], worker_output(tmp_path)
    for line in lines:  # each found it itself, or raised or logged the other's line
        assert f"{out / MANIFEST}: the store was replaced or changed after it was opened" in line


@pytest.mark.multiprocess
def test_a_bucket_store_is_checked_by_one_process_and_its_replacement_stops_both(
    tmp_path, quick_stop
):
    """A gs:// store is one object for every host, and each check a billed request: one process
    re-checks it, whatever the host count, and its stop ends the other with the same line. Each
    process (and this test) talks to its own port of one emulator, whose log names who made
    each request."""
    from tests.gcs_emulator import ENDPOINTS, point_at, serving
    from tests.test_multihost import worker_output

    log = tmp_path / "requests.log"
    old = corpus(tmp_path / "old", "alpha", 60)
    new = corpus(tmp_path / "new", "omega", 60)
    counts: list[int] = []
    with serving(log=log, listeners=3) as bucket:
        endpoints = os.environ[ENDPOINTS].split(",")  # process i uses the i-th (multihost_worker)
        point_at(endpoints[2])
        url = f"{bucket}/replaced"
        assert main(["prepare", str(old), "--out", url, "--num-shards", "1", "--no-progress"]) == 0
        fingerprint = StoreMeta.load(url).fingerprint
        checker = next(i for i in range(2) if host_stop.checks_remote(fingerprint, i, 2))
        manifest = f"/o/{quote(f'replaced/{MANIFEST}', safe='')}"
        prefix = f"/storage/v1/b/{bucket.removeprefix('gs://')}"  # a metadata or delete request

        def asked(process: int, since: int) -> int:
            """Metadata reads of the manifest by `process` after log line `since` (a download
            would say alt=media)."""
            port = endpoints[process].rsplit(":", 1)[1]
            return sum(
                line.startswith(f"{port} GET ") and manifest in line and "alt=media" not in line
                for line in log.read_text().splitlines()[since:]
            )

        def replace() -> None:
            """Both processes wait at step 2: what reads the manifest's metadata now is the
            watchers' identity check. After the replacement, `go` waits for the checker's first
            check since `--overwrite` deleted the manifest (it finds none, or the new one: either
            stops it): otherwise the other process may first fail to read the replaced shard and
            stop with that line instead."""
            start = len(log.read_text().splitlines())
            time.sleep(2.0)
            counts.extend(asked(process, start) for process in range(2))
            argv = ["prepare", str(new), "--out", url, "--num-shards", "1", "--overwrite"]
            assert main([*argv, "--no-progress"]) == 0
            lines = log.read_text().splitlines()
            replaced = max(
                i for i, line in enumerate(lines) if f"DELETE {prefix}{manifest}" in line
            )
            deadline = time.monotonic() + 60
            while not asked(checker, replaced) and time.monotonic() < deadline:
                time.sleep(0.05)

        raw = config_over(tmp_path, {"s": url}, lanes=2, global_batch_size=4)
        task = {"kind": "stop", "fault": "replace", "faulty": None}
        codes, lines = launch_until_ready(tmp_path, raw, task, replace)
    assert codes == [2, 2], worker_output(tmp_path)
    assert lines[checker] == (
        f"error: multihost.yaml: sources.s.path: {url}/{MANIFEST}: the store was "
        "replaced or changed after it was opened (by `prepare --overwrite`?); restart the job "
        "to read the new store"
    )
    assert lines[1 - checker].endswith(f"host {checker}: {lines[checker].removeprefix('error: ')}")
    assert counts[1 - checker] == 0, counts  # never asked: the other process checks it
    assert counts[checker] >= 2, counts  # about one request every 0.25 s


def test_the_stop_periods_come_from_the_environment(monkeypatch):
    """Set: its value (the bucket test above shows a feed using it); empty: the default."""
    monkeypatch.setenv(host_stop.POLL_ENV, "")
    assert positive_number(host_stop.POLL_ENV, host_stop.POLL_S, "seconds") == host_stop.POLL_S
    monkeypatch.setenv(host_stop.GRACE_ENV, " 1.5 ")
    assert positive_number(host_stop.GRACE_ENV, host_stop.GRACE_S, "seconds") == 1.5


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e999", "two", "2s"])
@pytest.mark.parametrize("variable", ["POLL_ENV", "STORE_CHECK_ENV", "GRACE_ENV"])
def test_a_bad_stop_period_is_refused_by_the_feed_in_one_line(tmp_path, monkeypatch, variable,
                                                               value):  # fmt: skip
    """Before the feed acquires a store or starts a thread: nothing is left held."""
    name = getattr(host_stop, variable)
    monkeypatch.setenv(name, value)
    config = parse_config(config_over(tmp_path, {"s": synthetic(tmp_path)}), "r.yaml")
    acquired = []
    monkeypatch.setattr(shared_stores, "acquire", lambda path: acquired.append(path))
    threads = threading.enumerate()
    with pytest.raises(ConfigError) as info:
        DataFeed(config, mesh())
    assert one_line(info.value) == f"${name}: expected a number of seconds > 0, got {value!r}"
    assert acquired == [] and threading.enumerate() == threads


@given(st.text("0123456789abcdef", min_size=16, max_size=16), st.integers(1, 5000))
def test_exactly_one_process_checks_each_bucket_store(fingerprint, processes):
    checkers = [p for p in range(processes) if host_stop.checks_remote(fingerprint, p, processes)]
    assert len(checkers) == 1


@given(st.floats(0.01, 60), st.integers(1, 100_000))
def test_the_job_polls_the_stop_directory_within_its_budget_and_spread_over_the_period(
    poll_s, processes
):
    """Whatever the process count, the whole job asks the coordinator at most JOB_POLLS_PER_S
    times a second (one feed), a small job keeps the configured period, and the processes'
    first polls fall at distinct times within one period."""
    period = host_stop.poll_period(poll_s, processes)
    assert processes / period <= host_stop.JOB_POLLS_PER_S * (1 + 1e-9)
    if processes <= host_stop.JOB_POLLS_PER_S * poll_s:
        assert period == poll_s
    offsets = [host_stop.first_poll_offset(period, p, processes) for p in range(processes)]
    assert offsets[0] > 0 and offsets[-1] == pytest.approx(period)
    assert all(a < b for a, b in itertools.pairwise(offsets))


@pytest.mark.multiprocess
def test_a_persistent_read_failure_on_one_process_stops_every_process_with_its_line(
    tmp_path, quick_stop
):
    raw = two_stage_raw(tmp_path / "stores", flat=False)  # every read goes through ArrayRecord
    task = {"kind": "stop", "fault": "read", "faulty": 1}
    codes, lines = launch_until_ready(tmp_path, raw, task, lambda: None)
    from tests.test_multihost import worker_output

    assert codes == [2, 2], worker_output(tmp_path)
    failing = lines[1]
    assert failing.startswith("error: step "), failing
    assert "(6 tries): UNAVAILABLE: injected persistent fault" in failing
    assert ".array_record" in failing  # names the shard file
    assert re.search(r": sources\.(code|docs)\.path: \S+\.array_record: ", failing), failing
    assert lines[0].endswith(f"host 1: {failing.removeprefix('error: ')}"), lines[0]


@pytest.mark.multiprocess
def test_a_failed_background_verification_on_one_process_stops_every_process_with_its_line(
    tmp_path, quick_stop
):
    """Damage only the full pass finds, in shard 2: process 0's share of 2 (shard i on process
    i mod 2), so process 1's pass succeeds and it learns of the failure from the published stop."""
    from tests.test_multihost import launch, worker_output

    store = synthetic(tmp_path)
    shard = damage_an_unsampled_record(store)
    raw = config_over(tmp_path, {"s": store}, feed={"verify": "background"})
    (tmp_path / "go").touch()  # no pause at step 2: the failure may come before it
    task = {"kind": "stop", "fault": "verify", "faulty": 0}
    codes = launch(tmp_path, raw, [task], 2, 2, timeout=60)
    assert codes == [2, 2], worker_output(tmp_path)
    failing, other = (last_line(log) for log in sorted(tmp_path.glob("spec-*-*.log")))
    named = f"multihost.yaml: sources.s.path: {shard}"  # the source's config key, as at open
    assert failing.startswith(
        f"error: background store verification failed: {named}: content checksum does not match"
    ), failing
    assert other.endswith(f"host 0: {failing.removeprefix('error: ')}"), other


def test_a_store_a_switch_adds_is_watched_too(tmp_path, monkeypatch):
    """The identity check follows the feed's current plan, not the stores open at its start."""
    from pipeline.plan.resume import reconcile

    monkeypatch.setenv(host_stop.STORE_CHECK_ENV, "0.05")
    first = tmp_path / "first"
    added = tmp_path / "added"
    for out, word in ((first, "alpha"), (added, "beta")):
        prepare(PrepareOptions([str(corpus(tmp_path / word, word, 60))], out, num_shards=1,
                               progress=False))  # fmt: skip
    before = parse_config(
        config_over(tmp_path, {"s": first}, lanes=1, global_batch_size=2), "a.yaml"
    )
    after = parse_config(
        config_over(tmp_path, {"s": first, "t": added}, lanes=1, global_batch_size=2), "b.yaml"
    )
    with DataFeed(before, mesh(), prefetch=1, threads=1) as feed:
        next(feed)
        feed.adopt(reconcile(feed.plan, after, feed.step, switch=True), feed.step)
        next(feed)
        assert len(feed.plan.stores()) == 2  # the switch opened the added store
        prepare(PrepareOptions([str(corpus(tmp_path / "new", "omega", 60))], added, num_shards=1,
                               overwrite=True, progress=False))  # fmt: skip
        message = feed_until_error(feed)
    # named by the key of the segment that added it (adopted: labelled by its ledger segment)
    key = "ledger segment 1 (from step 1): sources.t.path"
    assert message.startswith(f"{key}: {added / MANIFEST}: the store was replaced")


# -- messages that name the real cause -------------------------------------------------------


def test_inspect_of_an_unreadable_shard_says_permission_denied(tmp_path):
    """ArrayRecord reads a file it cannot open as a shard of no records; the shard is named by
    its OS error instead. Tests run as root, whom a mode of 000 does not stop: the CLI runs
    without the capabilities that let root read any file (`setpriv`), so the open really fails."""
    store = synthetic(tmp_path, flat=False)
    shard = store / "shard-00000-of-00003.array_record"
    shard.chmod(0)
    config = write_yaml(tmp_path / "data.yaml", config_over(tmp_path, {"s": store}))
    command = [sys.executable, "-m", "pipeline", "inspect", str(config), "--step", "0"]
    if os.geteuid() == 0:
        command = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    named = f"error: {config}: sources.s.path: {shard}: cannot read: Permission denied\n"
    assert result.returncode == 2 and result.stderr == named, result.stderr
