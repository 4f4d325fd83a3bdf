"""Megatron-LM's indexed dataset files (`PREFIX.idx` + `PREFIX.bin`), read and written.

The format, as Megatron-LM's `megatron/core/datasets/indexed_dataset.py` writes it (all
integers little-endian)::

    PREFIX.idx  b"MMIDIDX\\x00\\x00"     9-byte magic
                uint64 version          1
                uint8  dtype code       DTYPE_CODES below
                uint64 sequence count   S
                uint64 document count   D (document indices, so documents + 1)
                int32  [S]              tokens per sequence
                int64  [S]              byte offset of each sequence in the .bin
                int64  [D]              sequence index where each document starts, then S
                int8   [S]              multimodal datasets only: each sequence's mode
    PREFIX.bin  the sequences' tokens, of the dtype, back to back

A document spans the sequences between two consecutive document indices. Multimodal mode
bytes (an image or audio sequence among the text ones) are refused by name: their tokens are
not a text stream. `write_megatron` writes the same bytes, for tests and fixtures (checked
against this layout byte by byte in tests/test_megatron.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.errors import StoreError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
DTYPE_CODES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}


@dataclass(frozen=True)
class MegatronIndex:
    """What a `.idx` holds: the token dtype and, memory-mapped, its three arrays."""

    path: Path
    dtype: np.dtype
    sequence_lengths: np.ndarray  # int32 [S]
    sequence_pointers: np.ndarray  # int64 [S], bytes
    document_indices: np.ndarray  # int64 [documents + 1]

    def document_offsets(self, bin_bytes: int) -> np.ndarray:
        """Token offsets in the `.bin` where each document starts, then the total (int64,
        documents + 1), refused unless the sequences lie back to back from byte 0 and fill a
        `.bin` of `bin_bytes` (what Megatron writes: then the `.bin` is one token array)."""
        lengths = self.sequence_lengths.astype(np.int64)
        if lengths.size and int(lengths.min()) < 0:
            raise StoreError(f"{self.path}: a sequence length is negative; the index is corrupt")
        starts = np.concatenate([[0], np.cumsum(lengths)])
        itemsize = self.dtype.itemsize
        if not np.array_equal(self.sequence_pointers, starts[:-1] * itemsize):
            raise StoreError(
                f"{self.path}: the sequences do not lie back to back in the .bin (their "
                "pointers are not the running sum of their lengths); only contiguous data is "
                "read in place"
            )
        if int(starts[-1]) * itemsize != bin_bytes:
            raise StoreError(
                f"{self.path}: the sequences hold {int(starts[-1])} tokens of {self.dtype.name} "
                f"({int(starts[-1]) * itemsize} bytes), the .bin holds {bin_bytes} bytes; the "
                ".bin and .idx are not one dataset"
            )
        docs = self.document_indices
        count = len(lengths)
        if not docs.size or docs[0] != 0 or docs[-1] != count or np.any(np.diff(docs) < 0):
            raise StoreError(
                f"{self.path}: document indices must rise from 0 to the sequence count {count}; "
                "the index is corrupt"
            )
        return starts[docs]


def read_index(path: Path) -> MegatronIndex:
    """The `.idx` at `path`, its header and size checked (one clear line on any mismatch)."""
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:
        raise StoreError(f"{path}: cannot read the Megatron index: {error}") from None
    if data.size < HEADER.size:
        raise StoreError(f"{path}: {data.size} bytes, too short for a Megatron index header")
    magic, version, code, sequences, documents = HEADER.unpack(bytes(data[: HEADER.size]))
    if magic != MAGIC:
        raise StoreError(f"{path}: not a Megatron index (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise StoreError(f"{path}: Megatron index version {version}; this reads version 1")
    if code not in DTYPE_CODES:
        raise StoreError(f"{path}: unknown Megatron dtype code {code} (known: 1..8)")
    body = HEADER.size + 12 * sequences + 8 * documents
    if data.size == body + sequences and sequences:
        raise StoreError(
            f"{path}: a multimodal Megatron dataset (it ends with one mode byte per sequence); "
            "only text token datasets are read in place"
        )
    if data.size != body:
        raise StoreError(
            f"{path}: {data.size} bytes, but a Megatron index of {sequences} sequences and "
            f"{documents} document indices is {body} bytes; the file is truncated or corrupt"
        )
    at = HEADER.size
    lengths = data[at : at + 4 * sequences].view("<i4")
    at += 4 * sequences
    pointers = data[at : at + 8 * sequences].view("<i8")
    at += 8 * sequences
    docs = data[at : at + 8 * documents].view("<i8")
    return MegatronIndex(path, DTYPE_CODES[code], lengths, pointers, docs)


def write_megatron(
    prefix: str | Path,
    documents: list[list[list[int]]],
    dtype: np.dtype | type = np.uint16,
) -> None:
    """Write `PREFIX.bin` / `PREFIX.idx`: each document a list of sequences of token ids (a
    Megatron document may hold several sequences, e.g. one per sentence)."""
    dtype = np.dtype(dtype)
    code = next(code for code, known in DTYPE_CODES.items() if known == dtype)
    sequences = [np.asarray(seq, dtype=dtype) for doc in documents for seq in doc]
    lengths = np.array([len(seq) for seq in sequences], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])[:-1] * dtype.itemsize
    doc_indices = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])])
    prefix = str(prefix)
    with open(f"{prefix}.bin", "wb") as out:
        for seq in sequences:
            out.write(seq.astype(dtype.newbyteorder("<")).tobytes())
    with open(f"{prefix}.idx", "wb") as out:
        out.write(HEADER.pack(MAGIC, VERSION, code, len(sequences), len(doc_indices)))
        out.write(lengths.tobytes())
        out.write(pointers.astype("<i8").tobytes())
        out.write(doc_indices.astype("<i8").tobytes())
