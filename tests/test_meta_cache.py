"""A host's manifest summaries (`meta_cache`): a restart plans from them by stat alone, and
never from a summary of a manifest that changed since."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import parse_config
from pipeline.errors import ConfigError, StoreError
from pipeline.plan.sources import load_metas, plan_stores
from pipeline.read.plan import Plan
from pipeline.store import meta as meta_module
from pipeline.store.megatron import MegatronStore
from pipeline.store.meta import StoreMeta
from pipeline.store.meta_cache import CACHE_ENV, ENTRY, VERSION, Summaries, manifest_stat
from tests.storegen import write_synthetic_store

SOURCES = 3


def mixture(root: Path) -> dict:
    sources = {}
    for k in range(SOURCES):
        path = root / f"s{k}"
        write_synthetic_store(path, [[5 + k, 9], [3, 4 + k]], first=100 * k).close()
        sources[f"s{k}"] = {"path": str(path)}
    return {
        "seed": 3,
        "seq_len": 4,
        "global_batch_size": 4,
        "sources": sources,
        "mix": {name: 1 for name in sources},
    }


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(directory))
    return directory


def reads(monkeypatch) -> list[Path]:
    """The manifests read from now on (the real reads, counted)."""
    seen: list[Path] = []
    real = meta_module.read_manifest

    def counted(path, *args, **kwargs):
        seen.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(meta_module, "read_manifest", counted)
    return seen


def facts(metas: dict) -> dict:
    return {
        name: (m.path, m.fingerprint, m.shard_tokens.tolist(), m.dtype, m.tokenizer, m.masked)
        for name, m in metas.items()
    }


def test_a_restart_plans_from_the_summaries_without_reading_a_manifest(
    tmp_path, cache, monkeypatch
):
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    first = load_metas(config)
    assert [p.name for p in cache.iterdir() if ENTRY.fullmatch(p.name)]  # one file, kept
    seen = reads(monkeypatch)
    again = plan_stores(config)
    assert seen == []
    assert facts(again) == facts(first)
    assert all(isinstance(m.shard_tokens, np.ndarray) for m in again.values())


def test_a_manifest_edited_in_place_is_read_again(tmp_path, cache):
    """Same inode, same size, the modification time put back: the change time still tells."""
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    load_metas(config)
    manifest = tmp_path / "s1" / meta_module.MANIFEST
    before = manifest.stat()
    text = manifest.read_text()
    count = re.search(r'"num_tokens": (\d+)', text)
    edited = text.replace(count[0], f'"num_tokens": {int(count[1]) + 1}', 1)  # 23 -> 24: same size
    assert edited != text and len(edited) == len(text)
    with manifest.open("r+") as file:
        file.write(edited)
    os.utime(manifest, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ConfigError, match=r"mix.yaml: sources.s1.path: .*manifest's checksum"):
        load_metas(config)


def test_a_replaced_store_is_planned_from_its_new_manifest(tmp_path, cache):
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    old = load_metas(config)
    shutil.rmtree(tmp_path / "s2")
    write_synthetic_store(tmp_path / "s2", [[7, 7, 7]], first=5).close()
    new = load_metas(config)
    assert new["s2"].fingerprint != old["s2"].fingerprint
    assert new["s2"].shard_tokens.tolist() == [21]
    assert facts({"s0": new["s0"]}) == facts({"s0": old["s0"]})


def test_a_damaged_summary_file_is_not_used_and_is_written_again(tmp_path, cache, caplog):
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    first = load_metas(config)
    (file,) = cache.iterdir()
    data = bytearray(file.read_bytes())
    data[-20] ^= 1  # a changed token count, say: the file's checksum refuses it
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        again = load_metas(config)
    assert "manifest summaries not used (its content does not match its checksum)" in caplog.text
    assert facts(again) == facts(first)
    assert file.read_bytes() != bytes(data)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        load_metas(config)
    assert caplog.text == ""


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = parse_config(mixture(tmp_path / "stores"), origin="mix.yaml")
    load_metas(config)
    seen = reads(monkeypatch)
    load_metas(config)
    assert len(seen) == SOURCES
    assert not (tmp_path / "xdg").exists()


def test_a_store_replaced_after_a_plan_from_summaries_is_refused_at_its_first_draw(tmp_path, cache):
    raw = mixture(tmp_path)
    config = parse_config(raw, origin="mix.yaml")
    reference = Plan.from_config(config)  # every store opened, before anything changes
    load_metas(config)  # the summaries kept
    plan = Plan.from_config(config, plan_stores(config))
    assert plan.stores() == []  # planned from the summaries: nothing opened
    step = next(s for s in range(100) if 2 in plan.draws(s).source)  # the first draw of s2
    for s in range(step):
        for field, want in reference.batch(s).items():
            np.testing.assert_array_equal(plan.batch(s)[field], want)
    shutil.rmtree(tmp_path / "s2")
    write_synthetic_store(tmp_path / "s2", [[5 + 2, 9], [3, 4 + 2]], first=7).close()  # a twin
    with pytest.raises(StoreError, match=r"sources.s2.path: .* content fingerprint .* recorded"):
        plan.batch(step)
    for store in reference.stores() + plan.stores():
        store.close()


def test_an_in_place_record_beside_a_summarised_manifest_is_still_found(
    tmp_path, cache, monkeypatch
):
    """The probe for an in-place index (`formats._in_place_local`) takes files only: a
    directory of a record's name leaves the store planned from its summary; a file of that
    name makes the source read in place (here a record that is not one, refused)."""
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    first = load_metas(config)
    record = tmp_path / "s1" / MegatronStore.RECORD
    record.mkdir()
    seen = reads(monkeypatch)
    assert facts(plan_stores(config)) == facts(first)
    assert seen == []
    record.rmdir()
    record.write_text("{}")
    with pytest.raises(ConfigError, match=rf"mix.yaml: sources.s1.path: .*{record.name}"):
        plan_stores(config)


TOKENIZERS = [
    {"kind": "synthetic", "model_sha256": "", "vocab_size": v, "eod_id": v - 1, "name": n}
    for v, n in ((300, "a"), (300, "b"), (70_000, "a"))
]
KEPT = st.lists(
    st.tuples(
        st.sampled_from(TOKENIZERS),
        st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
        st.sampled_from(["uint16", "uint32"]),
        st.booleans(),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=25, deadline=None)
@given(stores=KEPT)
def test_summaries_give_back_each_stores_own_metadata(tmp_path_factory, stores):
    """Each tokenizer is written once and shared: every store still gets its own back."""
    directory = tmp_path_factory.mktemp("summaries")
    paths = [directory / f"s{k}" for k in range(len(stores))]
    stats = {path: (1, k, 2, 3, 4) for k, path in enumerate(paths)}
    metas = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(directory / "cache"))
        kept = Summaries(paths)
        for k, (path, (tokenizer, tokens, dtype, masked)) in enumerate(zip(paths, stores)):
            meta = StoreMeta(path, f"f{k}", np.array(tokens), np.dtype(dtype), tokenizer, masked)
            meta.vouch(f"d{k}")
            kept.keep(meta, stats[path])
            metas.append(meta)
        kept.save()
        again = Summaries(paths)
        got = [again.meta(path, stats[path]) for path in paths]
        assert again.meta(paths[0], (9, 9, 9, 9, 9)) is None  # another manifest file
    assert [(*facts({0: m})[0], m.checked) for m in got] == [
        (*facts({0: m})[0], m.checked) for m in metas
    ]
    assert all(m.shard_tokens.dtype == np.int64 for m in got)


def test_a_summary_file_of_another_version_is_rebuilt_not_read(tmp_path, cache, caplog):
    """A version 1 file (all JSON, each store with its tokenizer) where this version keeps
    its file, whole and checksummed, but with counts that are not the store's: they are never
    used."""
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    first = load_metas(config)
    (file,) = cache.iterdir()
    stores = {
        str(m.path): [list(manifest_stat(m.path)), m.fingerprint, [1, 2], "uint32", m.tokenizer,
                      False, m.checked]
        for m in first.values()
    }  # fmt: skip
    body = json.dumps({"version": 1, "stores": stores}).encode()
    file.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        again = load_metas(config)
    assert f"version 1, this version writes {VERSION}" in caplog.text
    assert facts(again) == facts(first)
    header = file.read_bytes().partition(b"\n")[2].partition(b"\n")[0]  # the JSON line
    assert json.loads(header)["version"] == VERSION


def test_a_version_2_summary_without_entry_positions_is_rebuilt(tmp_path, cache, caplog):
    """Version 2 kept no positions of the manifests' shard entries: its file, whole and
    checksummed, is rewritten as this version's, which has them."""
    config = parse_config(mixture(tmp_path), origin="mix.yaml")
    first = load_metas(config)
    (file,) = cache.iterdir()
    line, _, blob = file.read_bytes().partition(b"\n")[2].partition(b"\n")
    header = {**json.loads(line), "version": 2}
    body = json.dumps(header).encode() + b"\n" + blob
    file.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        again = load_metas(config)
    assert f"version 2, this version writes {VERSION}" in caplog.text
    assert facts(again) == facts(first)
    kept = load_metas(config)
    assert all(meta.spans is not None and len(meta.spans) == 2 for meta in kept.values())
