"""A step's windows assembled in compiled code that releases the interpreter lock (numba):
the prototype `benchmarks/native_ab.py` measures against the Python path (not adopted:
docs/benchmarks-history.md, "A step's assembly in compiled code").

The pure-Python read of a step's windows (`read_pieces`, then `batch.boundaries`) is ~60 small
numpy calls and a Python loop over the pieces, each holding the interpreter lock. Here, for
pieces that are all served from local flat sidecars, one compiled call (`_assemble`, nogil)
copies every piece out of its memory map, finds the document starts inside it (a binary search
of the shard's document index) and writes the segment numbers and positions (or the compact
form's `bounds`): the same values, bit for bit (tests/test_native_read.py). Blocks not yet
checked are found by one compiled call too (`_unchecked`) and checked by `FlatBlocks.read`
before anything is copied, so a damaged byte is refused exactly as on the Python path.

The compiled code sees each (store, shard) as raw addresses of its arrays (a per-step table),
which the step's `FlatBlocks` and document indexes keep alive while it runs. `use()` swaps it
into the read path of this process (`pipeline.read.windows._assemble`), the Python path kept
for the pieces it does not serve.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba  # the dev extra's
import numpy as np
from numba import types
from numba.extending import intrinsic

from pipeline.read.compact import SEGMENT_SHIFT
from pipeline.store.flat_blocks import FlatBlocks
from pipeline.store.piece_reads import PieceSource

_KINDS = {np.dtype(np.uint16): 0, np.dtype(np.uint32): 1, np.dtype(np.int32): 2}


_Entry = tuple[FlatBlocks, tuple[int, ...], np.ndarray, np.ndarray, np.ndarray | None]
_ENTRIES: dict[int, _Entry] = {}  # id(FlatBlocks) -> its entry; checked by identity
_MAX_ENTRIES = 4096


def _entry(store: PieceSource, shard: int) -> _Entry | None:
    """(flat blocks, table row, arrays the row points into) of a shard served from a local
    flat sidecar of a supported dtype, else None. The row: the tokens' address, size and
    kind, the document index's address and size, the checked bitmap's address and size, the
    block shift; then, for a compiled check (`compiled_check.use`), the recorded CRCs'
    address and size (0 without them), the 8-byte words a block holds and the whole blocks.
    Kept per `FlatBlocks` (a few numpy attribute reads each), at most `_MAX_ENTRIES` (their
    sidecars stay mapped while kept)."""
    if getattr(store, "remote", False) or not 0 <= shard < store.num_shards:
        return None
    flat = store.flat_blocks(shard)  # every step, as read_pieces: the open shards' recency
    entry = _ENTRIES.get(id(flat))
    if entry is not None and entry[0] is flat:
        return entry
    if not isinstance(flat, FlatBlocks) or flat.tokens.dtype not in _KINDS:
        return None
    docs = np.ascontiguousarray(store.doc_offsets(shard), np.int64)
    checked = np.frombuffer(flat.checked, np.uint8)
    tokens = flat.tokens
    crcs = None if flat._crcs is None else np.frombuffer(flat._crcs, np.uint32)
    row = (
        tokens.ctypes.data, tokens.size, _KINDS[tokens.dtype], docs.ctypes.data, docs.size,
        checked.ctypes.data, checked.size, flat.shift,
        0 if crcs is None else crcs.ctypes.data, 0 if crcs is None else crcs.size,
        flat.block_bytes // 8, tokens.nbytes // flat.block_bytes,
    )  # fmt: skip
    if len(_ENTRIES) >= _MAX_ENTRIES:
        _ENTRIES.clear()
    entry = _ENTRIES[id(flat)] = (flat, row, docs, checked, crcs)
    return entry


def use() -> None:
    """Read the windows of this process's plans through `assemble` where it serves them."""
    from pipeline.read import windows

    python = windows._assemble

    def assembled(stores, pieces, tokens, packed):
        done = assemble(stores, *pieces, tokens, packed=packed)
        return python(stores, pieces, tokens, packed) if done is None else done

    windows._assemble = assembled


def assemble(
    stores: Sequence[PieceSource],
    which: np.ndarray,
    shards: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    rows: np.ndarray,
    cols: np.ndarray,
    out: np.ndarray,
    *,
    packed: bool,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Copy piece i (tokens [lo[i], hi[i]) of shard shards[i] of stores[which[i]]) into
    `out[rows[i], cols[i]:]` (int32, [rows, width]) and return (segments, positions), int32 of
    `out`'s shape, or with `packed` (bounds, None), as `read_pieces` then `batch.boundaries`
    (or `compact.pack`) give them: every row starts a segment at column 0, a document start
    inside a piece starts one, and so does a piece at a column > 0. None (nothing copied) when
    a piece is not served from a local flat sidecar of a supported dtype: the caller reads."""
    slots: dict[tuple[int, int], int] = {}
    slot = [slots.setdefault(key, len(slots)) for key in zip(which.tolist(), shards.tolist())]
    entries = [_entry(stores[k], shard) for k, shard in slots]
    if not entries or None in entries:
        return None
    table = np.array([entry[1] for entry in entries], np.int64)
    slot = np.array(slot, np.int64)
    if np.any((lo < 0) | (lo >= hi) | (hi > table[slot, 1])):
        return None  # the Python path names the store, shard and range
    for i in _unchecked(table, slot, lo, hi).tolist():
        entries[slot[i]][0].read(int(lo[i]), int(hi[i]))  # checks the blocks, or raises
    segments = np.empty(out.shape, np.int32)
    positions = segments if packed else np.empty(out.shape, np.int32)
    _assemble(table, slot, lo, hi, rows, cols, out, segments, positions, packed)
    del entries  # held every array the kernel read
    if packed:
        return segments.view(np.uint32), None
    return segments, positions


@intrinsic
def _pointer(typingctx, address):
    """The int64 `address` as a void pointer, for `numba.carray`."""
    signature = types.voidptr(address)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


@numba.njit(nogil=True, cache=True)
def _unchecked(table, slot, lo, hi):
    """Pieces that touch a block whose checked byte is still 0."""
    found = np.empty(slot.size, np.int64)
    count = 0
    for i in range(slot.size):
        s = slot[i]
        checked = numba.carray(_pointer(table[s, 5]), (table[s, 6],), np.uint8)
        shift = table[s, 7]
        for block in range(lo[i] >> shift, ((hi[i] - 1) >> shift) + 1):
            if checked[block] == 0:
                found[count] = i
                count += 1
                break
    return found[:count]


@numba.njit(nogil=True, cache=True)
def _copy(table, s, lo, hi, target, at):
    kind = table[s, 2]
    n = hi - lo
    if kind == 0:
        source16 = numba.carray(_pointer(table[s, 0]), (table[s, 1],), np.uint16)
        for t in range(n):
            target[at + t] = source16[lo + t]
    elif kind == 1:
        source32 = numba.carray(_pointer(table[s, 0]), (table[s, 1],), np.uint32)
        for t in range(n):
            target[at + t] = np.int32(source32[lo + t])
    else:
        source = numba.carray(_pointer(table[s, 0]), (table[s, 1],), np.int32)
        for t in range(n):
            target[at + t] = source[lo + t]


@numba.njit(nogil=True, cache=True)
def _assemble(table, slot, lo, hi, rows, cols, out, segments, positions, packed):
    """The copies and the document starts in one pass over the pieces, then the segment
    and position fields run by run (each run one segment: constant, and a ramp)."""
    height, width = out.shape
    flat = out.reshape(-1)
    found = np.empty(slot.size, np.int64)
    total = height + slot.size
    for i in range(slot.size):  # document starts per piece: an upper bound of the starts
        s = slot[i]
        docs = numba.carray(_pointer(table[s, 3]), (table[s, 4],), np.int64)
        found[i] = np.searchsorted(docs, lo[i])
        total += np.searchsorted(docs, hi[i]) - found[i]
    starts = np.empty(total, np.int64)  # flat indices in `out`
    for r in range(height):
        starts[r] = r * width
    count = height
    for i in range(slot.size):
        s = slot[i]
        at = rows[i] * width + cols[i]
        _copy(table, s, lo[i], hi[i], flat, at)
        if cols[i] > 0:
            starts[count] = at
            count += 1
        docs = numba.carray(_pointer(table[s, 3]), (table[s, 4],), np.int64)
        d = found[i]
        while d < docs.size and docs[d] < hi[i]:
            starts[count] = at + docs[d] - lo[i]
            count += 1
            d += 1
    starts = np.sort(starts[:count])
    seg = segments.reshape(-1)
    pos = positions.reshape(-1)
    number = 0
    for k in range(count):
        a = starts[k]
        if k + 1 < count and starts[k + 1] == a:
            continue  # the same start twice (a piece's column and its first document)
        b = starts[k + 1] if k + 1 < count else height * width
        number = 1 if a % width == 0 else number + 1
        if packed:
            for t in range(b - a):
                seg[a + t] = (number << SEGMENT_SHIFT) | t
        else:
            for t in range(b - a):
                seg[a + t] = number
                pos[a + t] = t
