"""benchmarks/compiled_check.py's compiled step check (numba, a prototype, not adopted) checks
what `FlatBlocks.read` checks: every block a window touches against the recorded running
CRC32Cs (`prefix_crcs`, `google_crc32c`), whichever of its three interleaved chains or its
remainder hashes the block; a flipped byte is refused, and nothing is marked then."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.store.flat_blocks import prefix_crcs

ROOT = Path(__file__).resolve().parents[1]
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
