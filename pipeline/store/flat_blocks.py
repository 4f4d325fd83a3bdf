"""Checksummed reads of a flat token sidecar: every byte served is checked before it is served.

The feed serves a shard's flat sidecar (`*.flat.bin`) by slices of its memory map, so a byte
flipped on disk after prepare would be served as a wrong token id: the shard's first use hashes
only a few sampled records, and the full pass (`TokenStore.verify`) is not run by default.
Prepare records the CRC32C of each `BLOCK_BYTES` block of the sidecar (`block_crcs`) in the
shard's block checksum file (`flat_blocks`, a .npy listed with its SHA-256 in the manifest).
`FlatBlocks.read` checks a block the first time a read touches it and marks it in a bitmap
(one byte per block), so a later read of it costs one `bytearray.find`. CRC32C comes from
`google-crc32c`, a C implementation (~6 GB/s here, 3x zlib's CRC-32).

A store prepared before block checksums existed has none: with checks on, a shard's sidecar is
then hashed whole against the manifest's `flat_sha256` on its first read, so nothing is served
unchecked (docs/token-store.md). With checks off (`feed: {verify: off}`), every block counts as
checked.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import google_crc32c
import numpy as np

from pipeline.errors import StoreError

# Each block is checked once per open shard, so an epoch checks every byte once whatever the
# size; large blocks keep the Python work per block (~1 us) small beside the CRC of the block
# (~4 us at 64 KiB): 32,768 uint16 tokens share it. The first read of a block checks more than
# it serves (a 2,049-token window: 4 KiB of 64), work the next windows into it then skip.
BLOCK_BYTES = 1 << 16


def block_crcs(path: Path, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """The CRC32C of each `block_bytes` block of the file at `path` (the last may be shorter),
    read in pieces of a few MiB: what prepare records for a sidecar."""
    crcs = []
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(block_bytes * 1024), b""):
            crcs.extend(
                google_crc32c.value(chunk[at : at + block_bytes])
                for at in range(0, len(chunk), block_bytes)
            )
    return np.array(crcs, dtype=np.uint32)


def block_count(size: int, block_bytes: int) -> int:
    """Blocks of a sidecar of `size` bytes (the last may be shorter)."""
    return -(-size // block_bytes)


class FlatBlocks:
    """A shard's flat sidecar as the feed serves it: its tokens (memory-mapped) and which of its
    blocks this process has checked. `crcs` are the blocks' recorded CRC32Cs (one per block,
    `block_count`), None for a store
    prepared without them (then the sidecar is hashed whole against `whole_sha256`); `check`
    False marks every block checked. Thread-safe: a block is marked only once it has passed."""

    __slots__ = (
        "_bytes", "_crcs", "_lock", "_path", "_whole_sha256", "block_bytes", "checked", "shift",
        "tokens",
    )  # fmt: skip

    def __init__(
        self,
        path: Path,
        tokens: np.ndarray,
        crcs: np.ndarray | None,
        *,
        block_bytes: int,
        whole_sha256: str,
        check: bool = True,
    ) -> None:
        self.tokens = tokens
        self.block_bytes = block_bytes
        # blocks hold a power-of-two number of tokens: a token's block is one shift
        self.shift = (block_bytes // tokens.itemsize).bit_length() - 1
        count = block_count(tokens.nbytes, block_bytes)
        self.checked = bytearray(b"\x01" * count if not check else count)
        self._bytes = tokens.view(np.uint8)
        self._crcs = None if crcs is None else crcs.tolist()  # Python ints: cheap to compare
        self._path, self._whole_sha256 = path, whole_sha256
        self._lock = threading.Lock()

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) (a non-empty range) of the sidecar, their blocks checked."""
        if self.checked.find(0, start >> self.shift, ((stop - 1) >> self.shift) + 1) >= 0:
            self._check(start >> self.shift, ((stop - 1) >> self.shift) + 1)
        return self.tokens[start:stop]

    def _check(self, first: int, last: int) -> None:
        """Check blocks [first, last) not checked yet; refuse the sidecar at the first that
        does not match its checksum."""
        with self._lock:
            if self._crcs is None:
                self._check_whole()
                return
            size = self.block_bytes
            for block in range(first, last):
                if self.checked[block]:
                    continue
                found = google_crc32c.value(self._bytes[block * size : (block + 1) * size])
                if found != self._crcs[block]:
                    end = min((block + 1) * size, self._bytes.size)
                    raise StoreError(
                        f"{self._path}: bytes {block * size}..{end - 1} do not match their "
                        "block checksum (flat_blocks) in the manifest's block checksum file: "
                        "the sidecar was altered or damaged; prepare the store again"
                    )
                self.checked[block] = 1

    def _check_whole(self) -> None:
        """A sidecar without block checksums: its SHA-256 against the manifest, all at once."""
        if self.checked.find(0) < 0:
            return
        if hashlib.sha256(self._bytes).hexdigest() != self._whole_sha256:
            raise StoreError(
                f"{self._path}: does not match its checksum (flat_sha256) in the manifest: the "
                "sidecar was altered or damaged; prepare the store again"
            )
        self.checked[:] = b"\x01" * len(self.checked)
