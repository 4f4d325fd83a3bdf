"""benchmarks/compiled_check.py's compiled step check (numba, a prototype, not adopted) checks
what `FlatBlocks.read` checks: every block a window touches against the recorded running
CRC32Cs (`prefix_crcs`, `google_crc32c`), whichever of its three interleaved chains or its
remainder hashes the block; a flipped byte is refused, and nothing is marked then. In the read
path (`use`: `native_read`'s compiled assembly, its blocks checked by `check_pieces`), the
batches are the Python path's and a flipped byte is refused with its error at the same step."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import parse_config
from pipeline.read import windows
from pipeline.read.plan import Plan
from pipeline.store.flat_blocks import prefix_crcs
from tests.test_checked_reads import masked_store
from tests.test_native_read import refusals

ROOT = Path(__file__).resolve().parents[1]
PYTHON = windows._assemble
TOKENS_PER_BLOCK = 2048  # uint16 tokens in a 4 KiB block
BLOCKS = 12


@pytest.fixture(scope="module")
def compiled_check(tmp_path_factory):
    """The module, its numba compile cache in a temporary directory (not the checkout's)."""
    from numba.core import config

    saved, config.CACHE_DIR = config.CACHE_DIR, str(tmp_path_factory.mktemp("numba-cache"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("compiled_check")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        config.CACHE_DIR = saved


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory) -> Path:
    """A uint16 sidecar of `BLOCKS` whole 4 KiB blocks of random tokens."""
    path = tmp_path_factory.mktemp("sidecar") / "shard.flat.bin"
    tokens = np.random.default_rng(3).integers(0, 50_000, BLOCKS * TOKENS_PER_BLOCK, np.uint16)
    path.write_bytes(tokens.tobytes())
    return path


def check(module, data: bytes, crcs: np.ndarray, starts: list[int], length: int):
    """`check_step` over `data` for windows of `length` tokens at `starts`: (its answer, the
    blocks it marked checked)."""
    checked = np.zeros(BLOCKS, np.uint8)
    todo = np.empty(BLOCKS, np.int64)
    words = np.frombuffer(data, np.uint64)
    found = module.check_step(
        words, crcs, checked, np.array(starts, np.int64), length, 11, 512, todo
    )
    return found, set(np.flatnonzero(checked).tolist())


# two windows touching blocks 0-3 and 5-7 (7 blocks: two chains of three, one remainder)
STARTS, LENGTH = [100, 5 * TOKENS_PER_BLOCK], 3 * TOKENS_PER_BLOCK


def test_the_blocks_the_windows_touch_are_checked_and_marked(compiled_check, sidecar):
    data, crcs = sidecar.read_bytes(), prefix_crcs(sidecar, 4096)
    found, marked = check(compiled_check, data, crcs, STARTS, LENGTH)
    assert found == -1
    assert marked == {0, 1, 2, 3, 5, 6, 7}


@pytest.mark.parametrize("block", [0, 1, 2, 3, 5, 6, 7])
def test_a_flipped_byte_in_any_touched_block_is_refused(compiled_check, sidecar, block):
    """Each of the seven blocks falls in a different place of the interleaved chains (first,
    second or third of a group, or the remainder): a byte flipped in any is found."""
    crcs = prefix_crcs(sidecar, 4096)
    data = bytearray(sidecar.read_bytes())
    data[block * 4096 + 1234] ^= 0x10
    found, marked = check(compiled_check, bytes(data), crcs, STARTS, LENGTH)
    assert found == block
    assert marked == set()


def test_a_flipped_byte_in_a_block_no_window_touches_is_not_read(compiled_check, sidecar):
    crcs = prefix_crcs(sidecar, 4096)
    data = bytearray(sidecar.read_bytes())
    data[4 * 4096 + 99] ^= 0x01  # block 4: between the two windows
    assert check(compiled_check, bytes(data), crcs, STARTS, LENGTH)[0] == -1


@pytest.fixture
def in_path(monkeypatch, compiled_check):
    """`compiled_check.use()` in this process; the Python read path restored after."""
    native_read = importlib.import_module("native_read")
    monkeypatch.setattr(windows, "_assemble", PYTHON)
    monkeypatch.setattr(native_read, "_unchecked", native_read._unchecked)
    compiled_check.use()
    assert native_read._unchecked is compiled_check.check_pieces
    return windows._assemble


def test_in_the_read_path_a_flipped_byte_is_refused_as_the_python_path_refuses_it(
    tmp_path: Path, in_path
) -> None:
    def plan(store: Path) -> Plan:
        raw = {"seed": 1, "seq_len": 63, "global_batch_size": 8,
               "sources": {"code": {"path": str(store)}}, "mix": {"code": 1}}  # fmt: skip
        return Plan.from_config(parse_config(raw, origin="check.yaml"))

    clean = {}
    for assemble in (PYTHON, in_path):
        windows._assemble = assemble
        fresh = plan(masked_store(tmp_path / f"store-{len(clean)}"))
        clean[assemble] = [fresh.read(fresh.draws(step)) for step in range(12)]
    for python, compiled in zip(*clean.values()):
        assert python.keys() == compiled.keys()
        assert all(np.array_equal(python[key], compiled[key]) for key in python)
    errors = refusals(tmp_path, plan, (PYTHON, in_path))
    assert errors[0] == errors[1]
    assert "do not match their block checksums" in errors[0][1]
