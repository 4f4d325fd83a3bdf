"""Windows to MaxText batch fields. A window of seq_len + 1 tokens gives one row:

    inputs  = w[:-1]    targets = w[1:]
    *_segmentation: 1, 2, 3, ... numbering the documents inside the row (a new one starts after
                    every end-of-document); never 0, because there is never padding
    *_position:     offset of each token from the start of its document *within the row*; a
                    document continued from the previous row counts from the row's first token,
                    so positions stay below seq_len for any position embedding

`targets_*` describe the target tokens (w[1:]), so `targets_segmentation` is the segment of the
token being predicted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.store import TokenSpan

FIELDS = (
    "inputs",
    "targets",
    "inputs_segmentation",
    "targets_segmentation",
    "inputs_position",
    "targets_position",
)


def assemble(windows: Sequence[TokenSpan], seq_len: int) -> dict[str, np.ndarray]:
    """Stack windows into the six int32 fields, each [len(windows), seq_len]."""
    rows = len(windows)
    tokens = np.empty((rows, seq_len + 1), dtype=np.int32)
    starts = np.zeros((rows, seq_len + 1), dtype=bool)
    for row, window in enumerate(windows):
        tokens[row] = window.tokens
        starts[row, window.doc_starts] = True
    starts[:, 0] = True
    segments = np.cumsum(starts, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(seq_len + 1, dtype=np.int32), tokens.shape)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "inputs_segmentation": segments[:, :-1],
        "targets_segmentation": segments[:, 1:],
        "inputs_position": positions[:, :-1],
        "targets_position": positions[:, 1:],
    }
