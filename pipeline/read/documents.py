"""Reading the rows of whole-document layouts (`best_fit`): a row is its documents, then padding.

The documents of the drawn rows are read one after another into one buffer (`read_pieces`,
one pass), then each field is one gather of rows * seq_len values (`document_fields`). Slot j
of a document has input token j and target token j + 1; padding has token, segment and
position 0.
"""

from __future__ import annotations

import numpy as np

from pipeline.plan.packing import PackedLayout
from pipeline.read import compact
from pipeline.read.batch import FIELDS, mask_untrained, untrained_ranges
from pipeline.store.token_store import TokenStore, read_pieces


def row_documents(
    layout: PackedLayout, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documents of packed rows `rows` one after another, each row's count of them, and
    the running total of those counts."""
    first = layout.row_offsets[rows]
    counts = layout.row_offsets[rows + 1] - first
    ends = np.cumsum(counts)
    return (
        layout.row_docs[np.repeat(first - ends + counts, counts) + np.arange(ends[-1])],
        counts,
        ends,
    )


def document_pieces(
    layout: PackedLayout, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shard pieces (shard, lo, hi) of the documents of packed rows `rows`."""
    docs, _, _ = row_documents(layout, np.asarray(rows, dtype=np.int64))
    start = layout.doc_start[docs]
    return layout.doc_shard[docs], start, start + layout.doc_tokens[docs]


def document_fields(
    layout: PackedLayout, store: TokenStore, rows: np.ndarray, *, packed: bool = False
) -> dict[str, np.ndarray]:
    """The six batch fields of packed rows `rows` of `layout` (its store: `store`),
    [len(rows), seq_len] each (`packed`: their compact form, `pipeline.read.compact`).

    The rows' documents are read one after another into one buffer, then zeros that
    padding reads. A row is its documents' slots, then padding, so each token field is one
    gather of len(rows) * seq_len values, no mask or scatter: slot j of a document read at
    `at` has input token at + j and target token at + j + 1 (a document's inputs are its
    tokens but the last, its targets its tokens but the first)."""
    rows = np.asarray(rows, dtype=np.int64)
    docs, counts, ends = row_documents(layout, rows)
    tokens = layout.doc_tokens[docs]
    at = np.concatenate([[0], np.cumsum(tokens)])
    size = int(at[-1])
    buffer = np.empty(size + layout.seq_len + 1, dtype=np.int32)
    buffer[size:] = 0
    shards, start = layout.doc_shard[docs], layout.doc_start[docs]
    zeros = np.zeros_like(docs)  # every piece: of store 0 (the only one), into row 0
    pieces = (zeros, shards, start, start + tokens, buffer[None], zeros, at[:-1])
    read_pieces([store], *pieces, doc_starts=False)
    # Entries: each row's documents, then its padding (maybe empty), read from the zeros.
    filled = np.concatenate([[0], np.cumsum(tokens - 1)])
    entry = np.arange(docs.size) + np.repeat(np.arange(rows.size), counts)
    pad = ends + np.arange(rows.size)
    slots, source = np.empty((2, docs.size + rows.size), dtype=np.int64)
    slots[entry], slots[pad] = tokens - 1, layout.seq_len - filled[ends] + filled[ends - counts]
    source[entry], source[pad] = at[:-1], size
    number = np.zeros(slots.size, dtype=np.int32)
    number[entry] = np.arange(docs.size) - np.repeat(ends - counts, counts) + 1
    begin = np.cumsum(slots) - slots  # of each entry in the rows' slots
    cells = rows.size * layout.seq_len
    kind = np.int32 if max(cells, buffer.size) < 2**31 else np.int64
    index = np.arange(cells, dtype=kind)
    position = index - np.repeat(begin.astype(kind), slots)
    index += np.repeat((source - begin).astype(kind), slots)
    segment = np.repeat(number, slots)
    position *= segment != 0  # padding: position 0
    inputs = buffer[index]
    index += 1
    targets = buffer[index]
    trained = _target_segments(store, segment, shards, start, tokens, begin[entry])
    position = position.astype(np.int32, copy=False)
    shape = (rows.size, layout.seq_len)
    if packed:
        untrained = None if trained is segment else trained == 0  # padding too: no matter
        bounds = compact.pack(segment, position)  # consumes segment
        if untrained is not None:
            bounds[untrained] |= compact.UNTRAINED
        fields = {"inputs": inputs, "targets": targets, "bounds": bounds}
        return {name: values.reshape(shape) for name, values in fields.items()}
    fields = {
        "inputs": inputs,
        "targets": targets,
        "inputs_segmentation": segment,
        "targets_segmentation": trained,
        "inputs_position": position,
        "targets_position": position,
    }
    return {name: fields[name].reshape(shape) for name in FIELDS}


def _target_segments(
    store: TokenStore,
    segment: np.ndarray,
    shards: np.ndarray,
    first: np.ndarray,
    tokens: np.ndarray,
    begin: np.ndarray,
) -> np.ndarray:
    """`segment` with 0 on each untrained target (`mask_untrained`): token t >= 1 of the
    document whose slots begin at begin[i] is the target of slot begin[i] + t - 1 (its
    first token is none). An unmasked store has none: `segment` itself, as batch fields
    are read-only."""
    if not store.masked:
        return segment
    trained = segment.copy()
    owner = np.zeros_like(shards)  # every document: of the one store
    mask_untrained(
        trained, untrained_ranges([store], owner, shards, first, first + tokens, begin, begin)
    )
    return trained
