"""The packing kept on disk: used only when sound and for its key, rebuilt otherwise."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from pipeline import Plan, parse_config
from pipeline.plan import packing
from pipeline.plan.packing_cache import CACHE_ENV, cached
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
    written = path.stat().st_mtime_ns
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        assert all(map(_equal, batches(), expected))  # reads it
    assert path.stat().st_mtime_ns == written and "not used" not in caplog.text
