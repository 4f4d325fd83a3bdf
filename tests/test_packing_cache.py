"""The packing kept on disk: used only when sound and for its key, rebuilt otherwise."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from pipeline import Plan, parse_config
from pipeline.config.parse import PACKINGS
from pipeline.errors import ConfigError
from pipeline.plan import packing, packing_cache
from pipeline.plan.packing_cache import CACHE_ENV, MAX_GB_ENV, cached
from pipeline.store.token_store import TokenStore
from tests.test_packing import write_masked_store

KEY = {"store": "abc", "seed": 1, "source": "sft", "seq_len": 8, "lanes": 1, "too_long": "drop"}


def _packing(documents: int = 5) -> dict[str, np.ndarray]:
    return {
        "doc_start": np.arange(documents, dtype=np.int64) * 4,
        "doc_tokens": np.full(documents, 4, np.int64),
        "row_offsets": np.array([0, 2, documents], np.int64),
        "row_docs": np.arange(documents, dtype=np.int64)[::-1].copy(),
        "counts": np.array([0, 1], np.int64),
    }


def _never() -> dict[str, np.ndarray]:
    raise AssertionError("packed again although a sound entry was kept")


def _equal(one: dict, other: dict) -> bool:
    return one.keys() == other.keys() and all(np.array_equal(one[k], other[k]) for k in one)


@pytest.fixture
def directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "packings"))
    return tmp_path / "packings"


def test_a_kept_packing_is_read_instead_of_packed(directory: Path) -> None:
    assert _equal(cached(KEY, 5, _packing), _packing())
    assert len(list(directory.iterdir())) == 1
    kept = cached(KEY, 5, _never)
    assert _equal(kept, _packing()) and not kept["row_docs"].flags.writeable


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_entry_is_rebuilt_not_used(directory: Path, damage: str, caplog) -> None:
    cached(KEY, 5, _packing)
    (path,) = directory.iterdir()
    data = bytearray(path.read_bytes())
    if damage == "flip":  # inside row_docs' data: the zip stays readable, the digest does not
        at = data.find(np.arange(5, dtype=np.int64)[::-1].tobytes())
        assert at > 0
        data[at] ^= 1
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a packing")
    path.write_bytes(bytes(data))
    other = {**_packing(), "row_docs": np.arange(5, dtype=np.int64)}
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert _equal(cached(KEY, 5, lambda: other), other)
    assert f"{path}: packing cache entry not used" in caplog.text
    assert _equal(cached(KEY, 5, _never), other)  # the rebuilt entry replaced the damaged one


def test_a_stale_entry_is_rebuilt_not_used(directory: Path, caplog) -> None:
    cached({**KEY, "seed": 2}, 5, _packing)
    (stale,) = directory.iterdir()
    cached(KEY, 5, _packing)
    (path,) = set(directory.iterdir()) - {stale}
    path.write_bytes(stale.read_bytes())  # a sound file of another key, under this key's name
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert _equal(cached(KEY, 5, _packing), _packing())
    assert "written for other settings or another store" in caplog.text
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        cached(KEY, 6, _packing)  # a sound entry whose arrays do not fit the store
    assert "its arrays do not fit the store" in caplog.text


def test_a_cache_that_cannot_be_written_is_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """$PIPELINE_PACKING_CACHE naming a file (not a directory): the packing is still served."""
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "afile"))
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert _equal(cached(KEY, 5, _packing), _packing())
    assert "packing not kept" in caplog.text and (tmp_path / "afile").read_text() == ""


def test_off_keeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cached(KEY, 5, _packing)
    assert not list(tmp_path.iterdir())


def test_plans_from_a_kept_packing_give_the_same_batches(
    directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    store = write_masked_store(tmp_path / "sft", [[(3 + i % 11, i % 4) for i in range(60)]] * 2)
    raw = {"seed": 5, "seq_len": 16, "global_batch_size": 4, "lanes": 2, "mix": {"sft": 1},
           "sources": {"sft": {"path": str(store.path), "packing": "best_fit"}}}  # fmt: skip

    def batches() -> list[dict[str, np.ndarray]]:
        packing._CACHE.clear()  # as in a new process
        plan = Plan.from_config(parse_config(raw))
        return [plan.batch(step) for step in (0, 7, 10**6)]

    monkeypatch.setenv(CACHE_ENV, "off")
    expected = batches()
    monkeypatch.setenv(CACHE_ENV, str(directory))
    assert all(map(_equal, batches(), expected))  # packs, and keeps the packing
    (path,) = directory.iterdir()
    written = path.stat().st_ino
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert all(map(_equal, batches(), expected))  # reads it
    assert path.stat().st_ino == written and "not used" not in caplog.text  # not rewritten


def _keep(directory: Path, seed: int, last_use: int | None = None) -> Path:
    """The entry of `KEY` with `seed`, written now; used last `last_use` seconds after 1970."""
    before = set(directory.iterdir()) if directory.exists() else set()
    cached({**KEY, "seed": seed}, 5, _packing)
    (path,) = set(directory.iterdir()) - before
    if last_use is not None:
        os.utime(path, (last_use, last_use))
    return path


def _bound(monkeypatch: pytest.MonkeyPatch, path: Path, entries: float) -> None:
    """Bound the cache to `entries` times the size of the entry at `path` (all are as large)."""
    monkeypatch.setenv(MAX_GB_ENV, str(entries * path.stat().st_size / 1e9))


def test_the_least_recently_used_entries_are_removed_first(
    directory: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Use order, not write order: 2 was used longest ago, then 1; the new entry 4 stays."""
    one = _keep(directory, 1, 2000)
    _keep(directory, 2, 1000)
    three = _keep(directory, 3)
    size = one.stat().st_size
    _bound(monkeypatch, one, 2.5)
    with caplog.at_level(logging.INFO, logger="pipeline"):
        four = _keep(directory, 4)
    assert set(directory.iterdir()) == {three, four}
    assert f"packing cache: removed 2 entries ({2 * size / 1e6:.1f} MB) to stay under" in (
        caplog.text
    )
    assert caplog.text.count("packing cache: removed") == 1
    _bound(monkeypatch, three, 0.5)  # the new entry alone is over the bound: it is kept anyway
    five = _keep(directory, 5)
    assert set(directory.iterdir()) == {five}


def test_a_hit_marks_its_entry_used(directory: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    one, two = _keep(directory, 1, 1000), _keep(directory, 2, 2000)
    assert _equal(cached({**KEY, "seed": 1}, 5, _never), _packing())
    assert one.stat().st_mtime > two.stat().st_mtime
    _bound(monkeypatch, one, 2.5)
    three = _keep(directory, 3)
    assert set(directory.iterdir()) == {one, three}


def test_files_that_are_not_entries_are_left_alone(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither removed nor counted: another program's file, a write in progress."""
    one = _keep(directory, 1, 1000)
    _bound(monkeypatch, one, 2.5)
    size = one.stat().st_size
    others = [directory / "notes.npz", directory / f".{one.name}.123-abcdef01.partial"]
    for other in others:
        other.write_bytes(b"x" * 10 * size)
        os.utime(other, (1, 1))
    two = _keep(directory, 2)
    assert set(directory.iterdir()) == {one, two, *others}
    _bound(monkeypatch, one, 0.5)
    three = _keep(directory, 3)
    assert set(directory.iterdir()) == {three, *others}


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "ten", "10GB"])
def test_a_bad_bound_is_refused_in_one_line_before_packing(
    directory: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(MAX_GB_ENV, value)
    with pytest.raises(ConfigError) as error:
        cached(KEY, 5, _never)
    assert str(error.value) == f"${MAX_GB_ENV}: expected a number of GB > 0, got {value!r}"


def test_an_entry_removed_before_it_is_read_is_packed_again_quietly(
    directory: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Another process's eviction removed it after this one found it: no damage to report."""
    path = _keep(directory, 1)
    load = np.load

    def removed_first(file: Path, **options: object) -> object:
        Path(file).unlink()
        return load(file, **options)

    monkeypatch.setattr(packing_cache.np, "load", removed_first)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert _equal(cached({**KEY, "seed": 1}, 5, _packing), _packing())
    assert not [record for record in caplog.records if record.name == "pipeline"]
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ENV, str(directory))
    assert path.exists() and _equal(cached({**KEY, "seed": 1}, 5, _never), _packing())


class OnePerRow(packing.PackedLayout):
    """A second packing policy, registered by the test below: one document per row."""

    policy = "one_per_row"

    @staticmethod
    def pack(
        store: TokenStore, seed: int, name: str, seq_len: int, lanes: int, too_long: str
    ) -> dict[str, np.ndarray]:
        packed = dict(packing.PackedLayout.pack(store, seed, name, seq_len, lanes, too_long))
        docs = np.sort(packed["row_docs"])
        packed["row_docs"], packed["row_offsets"] = docs, np.arange(docs.size + 1)
        return packed


LAYOUT = OnePerRow  # this module is the policy's module: its registry line names it


def test_two_packing_policies_never_share_a_cache_entry(
    directory: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(PACKINGS, OnePerRow.policy, __name__)  # the one registry line
    store = write_masked_store(tmp_path / "sft", [[(3 + i % 5, 0) for i in range(12)]])
    raw = {"seed": 5, "seq_len": 16, "global_batch_size": 1, "lanes": 1, "mix": {"sft": 1},
           "sources": {"sft": {"path": str(store.path), "packing": "best_fit"}}}  # fmt: skip
    best_fit = Plan.from_config(parse_config(raw)).segment_plan(0).layouts["sft"]
    raw["sources"]["sft"]["packing"] = OnePerRow.policy
    for new_process in (False, True):  # served from memory, then from the disk
        if new_process:
            packing._CACHE.clear()
        plan = Plan.from_config(parse_config(raw))
        layout = plan.segment_plan(0).layouts["sft"]
        assert isinstance(layout, OnePerRow)
        assert layout.row_offsets.tolist() == list(range(13))
        assert len(best_fit.row_offsets) < 13  # best-fit packs several documents per row
        assert plan.batch(0)["inputs_segmentation"].max() == 1
    assert len(list(directory.iterdir())) == 2
