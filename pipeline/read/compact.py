"""The compact form of a step's rows: what the feed transfers when the devices build the fields.

The six batch fields repeat themselves: `targets` is `inputs` shifted by one token, and the
segment and position fields are functions of where documents start. So the feed can transfer
less and build the fields on the devices (`pipeline.feed.expand`, exactly today's values):

* windows (every source of the step's ledger segment is a `concat` source): `tokens`, the
  int32 windows [rows, seq_len + 1], and `bounds`, uint32 [rows, seq_len + 1]: per token
  column c, its segment number << SEGMENT_SHIFT | UNTRAINED when the target at column c (target
  column c - 1) carries no loss | its position. 8 bytes per token instead of 24.
* documents (every source `best_fit`): `inputs` and `targets`, int32 [rows, seq_len], whose
  slots are not one shifted stream (a document's inputs end before its last token), and
  `bounds` per slot as above (padding: segment 0, position 0). 12 bytes per slot.

A segment that mixes both kinds of rows has no compact form, nor does a `seq_len` whose
positions need more than 15 bits (`MAX_SEQ_LEN`): the feed transfers the six fields there.
Packing positions and segment numbers (not document starts alone) keeps the expansion free of
per-row scans, which cost more than the transfer they save on CPU devices.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pipeline.plan.row_layout import DOCUMENTS, WINDOWS

SEGMENT_SHIFT = 16
UNTRAINED = 1 << 15
POSITION_MASK = UNTRAINED - 1
MAX_SEQ_LEN = POSITION_MASK  # a window's positions (< seq_len + 1) fit in 15 bits
NAMES = {WINDOWS: ("tokens", "bounds"), DOCUMENTS: ("inputs", "targets", "bounds")}


def form(row_kind: str | None, seq_len: int) -> str | None:
    """The compact form of a segment whose sources' layouts all make rows of `row_kind`
    (`RowLayout.row_kind`; None: of several kinds, `SourceKinds.only`); None: the six fields."""
    if seq_len > MAX_SEQ_LEN or row_kind not in NAMES:
        return None
    return row_kind


def pack(segments: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`bounds` (uint32) of int32 `segments` and `positions`, in `segments`' buffer (a fresh
    array of the caller's, which this consumes)."""
    segments <<= SEGMENT_SHIFT  # wraps to the same bits as uint32 for segment 2**15
    segments |= positions
    return segments.view(np.uint32)


def mark_untrained(bounds: np.ndarray, ranges: Iterable[tuple[int, int]]) -> None:
    """Set UNTRAINED on the flat ranges [a, b) of `bounds` (C-contiguous), in place."""
    flat = bounds.reshape(-1)
    for a, b in ranges:
        flat[a:b] |= UNTRAINED
