"""Checksummed reads of a flat token sidecar: every byte served is checked before it is served.

The feed serves a shard's flat sidecar (`*.flat.bin`) by slices of its memory map, so a byte
flipped on disk after prepare would be served as a wrong token id: the shard's first use hashes
only a few sampled records, and the full pass (`TokenStore.verify`) is not run by default.
Prepare records the running CRC32C of the sidecar at every `BLOCK_BYTES` boundary
(`prefix_crcs`: entry i is the CRC32C of the first i blocks) in the shard's block checksum file
(`flat_blocks`, a .npy listed with its SHA-256 in the manifest, with the block size,
`flat_block_bytes`, which readers follow). `FlatBlocks.read` checks the blocks a read touches
that this process has not checked yet, as one run: extending the recorded CRC at the run's
start over its bytes must give the recorded CRC at its end, one C call (`google_crc32c.extend`)
whatever the run's length. Checked blocks are marked in a bitmap (one byte per block), so a
later read of them costs one `bytearray.find`.

Why 64 KiB blocks: a check costs its Python calls (~1 us: the call and its slice ~0.5, the
bitmap) and the CRC of its bytes, which a block's first read brings from memory (~6 us a
64 KiB block, ~11 GB/s, where the cache gives ~20 GB/s: `checked_reads_bench.py
--unit-costs`). With 64 KiB blocks an epoch makes one check per 16 2,049-token uint16 windows
and hashes each byte once; the first read of a block hashes more than it serves (4 KiB of 64),
work the next reads into it skip. So a run that reads a small share of its stores pays for
bytes it never serves: the bench's mixture, whose first 100 steps read 13 % of its biggest
store, hashes 8.5 bytes per token served from memory (python-code's 3.7), its checks' whole
cost. Smaller blocks hash less there but make a check of every window's first read, dearer
over an epoch, the common run, and no cheaper at a fifth in Python (4 and 16 KiB against 64:
docs/benchmarks.md, "Checked reads on the mixture"; 4 KiB blocks checked a step at a time in
compiled code cost half as much at a fifth and next to nothing over an epoch, a prototype:
`benchmarks/compiled_check.py`). Stores of another block size are read and checked in their
own (the manifest's `flat_block_bytes`).

A store prepared before block checksums existed has none: with checks on, a shard's sidecar is
then hashed whole against the manifest's `flat_sha256` on its first read, so nothing is served
unchecked (docs/token-store.md). With checks off (`feed: {verify: off}`), every block counts as
checked.
"""

from __future__ import annotations

import array
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np

from pipeline.errors import StoreError

BLOCK_BYTES = 1 << 16  # bytes per checked block of the sidecars prepare and index write


def block_count(size: int, block_bytes: int) -> int:
    """Blocks of a sidecar of `size` bytes (the last may be shorter)."""
    return -(-size // block_bytes)


def prefix_crcs(
    path: Path, block_bytes: int = BLOCK_BYTES, on_chunk: Callable[[bytes], None] | None = None
) -> np.ndarray:
    """The running CRC32C of the file at `path` at each `block_bytes` boundary and at its end
    (uint32, blocks + 1 entries, the first 0: the CRC of nothing): what prepare records.
    `on_chunk` sees every chunk read (a caller that checks the bytes too reads them once)."""
    crcs, running = [0], 0
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(block_bytes * 1024), b""):
            if on_chunk is not None:
                on_chunk(chunk)
            for at in range(0, len(chunk), block_bytes):
                running = google_crc32c.extend(running, chunk[at : at + block_bytes])
                crcs.append(running)
    return np.array(crcs, dtype=np.uint32)


class FlatBlocks:
    """A shard's flat sidecar as the feed serves it: its tokens (memory-mapped) and which of its
    blocks this process has checked. `crcs` are the sidecar's recorded running CRC32Cs at its
    block boundaries (`prefix_crcs`), None for a store prepared without them (then the sidecar
    is hashed whole against `whole_sha256`); `check` False marks every block checked.
    `identify` raises for a sidecar of another store (`shard_check.check_sample`), run before
    an altered block is refused, so that the error says which (`identify`).
    Thread-safe without a lock: a block is marked only once it has passed (two threads may
    both check a run, which is harmless)."""

    __slots__ = (
        "_bytes", "_crcs", "_identify", "_lock", "_path", "_remedy", "_whole_sha256",
        "block_bytes", "checked", "shift", "tokens",
    )  # fmt: skip

    def __init__(
        self,
        path: str | Path,
        tokens: np.ndarray,
        crcs: np.ndarray | None,
        *,
        block_bytes: int,
        whole_sha256: str,
        check: bool = True,
        remedy: str = "the sidecar was altered or damaged; prepare the store again",
        identify: Callable[[], None] | None = None,
    ) -> None:
        self.tokens = tokens
        self.block_bytes = block_bytes
        # blocks hold a power-of-two number of tokens: a token's block is one shift
        self.shift = (block_bytes // tokens.itemsize).bit_length() - 1
        count = block_count(tokens.nbytes, block_bytes)
        self.checked = bytearray(b"\x01" * count if not check else count)
        self._bytes = tokens.view(np.uint8)
        # 4 bytes a block (a list of Python ints would take ~36), read as Python ints
        self._crcs = (
            None if crcs is None else array.array("I", crcs.astype("=u4", copy=False).tobytes())
        )
        self._path, self._whole_sha256, self._remedy = path, whole_sha256, remedy
        self._identify = identify
        self._lock = threading.Lock()  # one hash of a whole sidecar at a time

    def identify(self) -> None:
        """The identity check its shard's first use left to the reads (`identify`: it raises
        for the sidecar of another store, which a block check would only call altered), until
        it passes once; run before an altered block is refused, and by a caller that reads
        `tokens` unchecked."""
        if self._identify is not None:
            self._identify()
            self._identify = None

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) (a non-empty range) of the sidecar, their blocks checked: the
        run from the first of them not checked yet to the last, hashed in one call (inline,
        not a method: a check's calls, not its bytes, are most of what it costs)."""
        shift, checked = self.shift, self.checked
        last = ((stop - 1) >> shift) + 1
        first = checked.find(0, start >> shift, last)
        if first >= 0:
            crcs = self._crcs
            if crcs is None:
                self._check_whole()
                return self.tokens[start:stop]
            last = checked.rfind(0, first, last) + 1
            size = self.block_bytes  # the last block may be short: the slice stops at the end
            if (
                google_crc32c.extend(crcs[first], self._bytes[first * size : last * size])
                != crcs[last]
            ):
                self._refuse(first, last)
            checked[first:last] = b"\x01" * (last - first)
        return self.tokens[start:stop]

    def _refuse(self, first: int, last: int) -> None:
        """Blocks [first, last) do not extend the recorded CRC at their start to the one at
        their end: the sidecar was altered."""
        self.identify()
        size = self.block_bytes
        end = min(last * size, self._bytes.size)
        raise StoreError(
            f"{self._path}: bytes {first * size}..{end - 1} do not match their block checksums "
            f"(flat_blocks): {self._remedy}"
        )

    def _check_whole(self) -> None:
        """A sidecar without block checksums: its SHA-256 against the manifest, all at once."""
        with self._lock:
            if self.checked.find(0) < 0:  # another thread hashed it meanwhile
                return
            if hashlib.sha256(self._bytes).hexdigest() != self._whole_sha256:
                self.identify()
                raise StoreError(
                    f"{self._path}: does not match its checksum (flat_sha256) in the manifest: "
                    "the sidecar was altered or damaged; prepare the store again"
                )
            self.checked[:] = b"\x01" * len(self.checked)
