"""Token columns in Parquet and Arrow files, read chunk by chunk (needs the `parquet` extra).

A corpus tokenized by Hugging Face `datasets` (or any Arrow writer) keeps one document per row
as a list of ids in a column (`input_ids`). `ColumnFile` reads that column of one file by
*chunk*: a Parquet row group, or a record batch of an Arrow IPC file (what
`datasets.save_to_disk` writes: `data-00000-of-00001.arrow`, read through a memory map, so its
ids are never copied until served). Each chunk gives the documents' lengths and their ids,
flattened; a null row or a column that is not a list of integer ids (or, for a loss column,
of the values its kind allows: loss_column.py) is refused by name.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreError
from pipeline.extras import require
from pipeline.in_place import COLUMN_SUFFIXES
from pipeline.store.loss_column import LossColumn

SUFFIXES = COLUMN_SUFFIXES
STATE = "state.json"  # a `datasets.save_to_disk` directory's list of its data files


def column_files(spec: str | Path) -> list[Path]:
    """The Parquet/Arrow files of a directory (its `*.parquet` and `*.arrow`, by name; a
    `datasets.save_to_disk` directory's, those its `state.json` lists) or of a glob, refused
    when there are none."""
    path = Path(spec)
    found = saved_files(path) if path.is_dir() else None
    if found is None and path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES and p.is_file())
    elif found is None:
        found = sorted(Path(p) for p in glob.glob(str(spec)) if Path(p).suffix in SUFFIXES)
    if not found:
        raise StoreError(f"{spec}: no .parquet or .arrow files{_splits(path)}")
    return found


def _splits(path: Path) -> str:
    """A `datasets.DatasetDict.save_to_disk` root holds no files, but one directory per
    split: name them (its `dataset_dict.json`)."""
    try:
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    names = ", ".join(str(s) for s in splits)
    return (
        f"; {path} is a DatasetDict of splits {names}: give one split's directory "
        f"({path / str(splits[0])})"
        if splits
        else ""
    )


def saved_files(directory: Path) -> list[Path] | None:
    """The files `directory/state.json` lists (`_data_files`), in its order; None without
    one. A save over an earlier one leaves the earlier shards beside the new ones, and
    `datasets.load_from_disk` reads only the listed files: so does the index."""
    state = directory / STATE
    if not state.is_file():
        return None
    try:
        listed = json.loads(state.read_text())
        if not isinstance(listed, dict) or "_data_files" not in listed:
            return None
        files = [directory / entry["filename"] for entry in listed["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise StoreError(f"{state}: unreadable `datasets` state ({error!r})") from None
    for file in files:
        if not file.is_file():
            raise StoreError(f"{file}: listed in {state}, but missing")
    return files


class ColumnFile:
    """One file's token column, by chunk (see the module docstring)."""

    def __init__(self, path: Path, column: str, loss: LossColumn | None = None) -> None:
        self.path, self.column = path, column
        self._parquet, self._batches = None, []
        pa = require("pyarrow", "parquet", "Parquet/Arrow token columns")
        try:
            if path.suffix == ".parquet":
                parquet = require("pyarrow.parquet", "parquet", "Parquet token columns")
                self._parquet = parquet.ParquetFile(str(path), memory_map=True)
                schema = self._parquet.schema_arrow
                metadata = self._parquet.metadata
                rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
            else:
                schema, self._batches = _arrow_batches(pa, path)
                rows = [batch.num_rows for batch in self._batches]
        except (OSError, pa.ArrowException) as error:
            raise StoreError(f"{path}: cannot read: {error}") from None
        self.count = len(rows)
        self.first_rows = np.cumsum([0, *rows], dtype=np.int64)  # each chunk's first row
        checks = [(column, pa.types.is_integer, "integers")]
        if loss is not None:
            checks.append((loss.column, lambda kind: loss.holds(pa, kind), loss.values))
        for name, holds, values in checks:
            if name not in schema.names:
                names = ", ".join(schema.names) or "none"
                raise StoreError(f"{path}: no column {name!r} (columns: {names})")
            kind = schema.field(name).type
            listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
            if not listed or not holds(kind.value_type):
                raise StoreError(f"{path}: column {name!r} is {kind}, not a list of {values}")
        self.dtype = np.dtype(str(schema.field(column).type.value_type))  # numpy's names

    def chunk(self, index: int, column: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(documents' lengths, their values flattened) of chunk `index` of the token column
        (or of `column`)."""
        name = column or self.column
        if self._parquet is not None:
            table = self._parquet.read_row_group(index, columns=[name])
            array: Any = table.column(0).combine_chunks()
        else:
            array = self._batches[index].column(name)
        values = array.flatten()
        if array.null_count or values.null_count:
            row = self.first_rows[index] + _first_null_row(array, values)
            raise StoreError(f"{self.path}: chunk {index}, row {row}: column {name!r} has nulls")
        lengths = np.asarray(array.value_lengths(), dtype=np.int64)
        return lengths, values.to_numpy(zero_copy_only=False)


def _first_null_row(array: Any, values: Any) -> int:
    """The first row of a list `array` (its `values` flattened) that is null or holds one."""
    ends = np.cumsum(np.asarray(array.value_lengths().fill_null(0), dtype=np.int64))
    rows = np.flatnonzero(np.asarray(array.is_null()))
    at = np.flatnonzero(np.asarray(values.is_null()))[:1]
    return int(np.concatenate([rows, np.searchsorted(ends, at, side="right")]).min())


def _arrow_batches(pa: Any, path: Path) -> tuple[Any, list]:
    """The schema and every record batch of an Arrow IPC file (file or stream format),
    memory-mapped (a file of no batch still has its schema)."""
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_file(source)
        return reader.schema, [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except pa.ArrowInvalid:
        source.seek(0)
        stream = pa.ipc.open_stream(source)
        return stream.schema, list(stream)
