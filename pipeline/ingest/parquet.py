"""The `parquet` input format: column `--text-field` of each row, read in record batches.

With `--format messages|prompt-completion` a row's columns are an instruction or chat row
(`Document.row`), rendered when tokenized. With `--id-field`, each row's id is that column.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from pipeline.errors import PrepareError
from pipeline.extras import require
from pipeline.ingest.chat import RowFields
from pipeline.ingest.formats import ROWS_HINT, Document, InputSpec, as_text, id_value
from pipeline.ingest.text import open_input
from pipeline.urls import is_url

NAME = "parquet"
SUFFIXES = (".parquet",)
PREFIX = ""
READS_FIELDS = True
READS_ROWS = True
NO_FIELDS = ""
PARQUET_BATCH_ROWS = 1024


def check(argument: str, path: str, text_field: str | None, rows: RowFields | None) -> None:
    """The file's schema has the text column, or the columns of `rows`."""
    if rows is None and text_field is None:
        return
    columns = _parquet_columns(path)  # one open of the file (a remote one for gs://)
    if rows is not None:
        missing = [c for c in rows.columns if c not in columns]
        if missing:
            raise PrepareError(
                f"input {argument!r}: {path} has no column {missing[0]!r} for "
                f"--format {rows.format} (columns: {', '.join(columns)})"
            )
        return
    if text_field not in columns:
        raise PrepareError(
            f"input {argument!r}: {path} has no column {text_field!r} (columns: "
            f"{', '.join(columns)}); pass --text-field with the column that holds the text"
            f"{ROWS_HINT}"
        )


def read(spec: InputSpec, path: str, key: str) -> Iterator[Document]:
    return _iter_parquet(path, key, spec.text_field, spec.fields, spec.id_field)


def _parquet(path: str) -> ModuleType:
    return require("pyarrow.parquet", "parquet", f"{path}: reading Parquet")


@contextlib.contextmanager
def _parquet_file(path: str) -> Iterator[Any]:
    """pyarrow's ParquetFile of a local file (by path) or of a bucket object (`_open`)."""
    pq = _parquet(path)
    with open_input(path) if is_url(path) else contextlib.nullcontext(path) as source:
        yield pq.ParquetFile(source)


def _parquet_columns(path: str) -> list[str]:
    try:
        with _parquet_file(path) as parquet:
            return list(parquet.schema_arrow.names)
    except PrepareError:
        raise
    except Exception as error:  # ArrowInvalid / OSError for a file that is not Parquet.
        raise PrepareError(
            f"{path} is not a readable Parquet file ({str(error).splitlines()[0]}); "
            "check the file or give it a different extension"
        ) from None


def _iter_parquet(
    path: str, key: str, field: str, rows: RowFields | None, id_field: str | None
) -> Iterator[Document]:
    columns = _parquet_columns(path)
    if id_field is not None and id_field not in columns:
        raise PrepareError(
            f"{path} has no column {id_field!r} for --id-field (columns: {', '.join(columns)})"
        )
    ids = [] if id_field is None else [id_field]
    if rows is not None:
        wanted = list(dict.fromkeys([*rows.columns, *ids]))
        for row, record in enumerate(_parquet_records(path, wanted)):
            where = f"{path} row {row}"
            document_id = id_value(record, id_field, where) if id_field else ""
            yield Document(f"{key}:row {row}", "", record, rows, where, document_id)
        return
    if field not in columns:
        raise PrepareError(
            f"{path} has no column {field!r} (columns: {', '.join(columns)}); "
            f"pass --text-field with the column that holds the text{ROWS_HINT}"
        )
    for row, record in enumerate(_parquet_records(path, list(dict.fromkeys([field, *ids])))):
        text = as_text(record[field], f"{path} row {row} column {field!r}")
        document_id = id_value(record, id_field, f"{path} row {row}") if id_field else ""
        yield Document(f"{key}:row {row}", text, id=document_id)


def _parquet_records(path: str, columns: list[str]) -> Iterator[dict[str, Any]]:
    """The rows of `columns`, a dict each; a damaged file is one line naming the row."""
    row = 0
    try:
        with _parquet_file(path) as parquet:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
                for record in batch.to_pylist():
                    yield record
                    row += 1
    except PrepareError:
        raise
    except Exception as error:  # a truncated or corrupt row group.
        raise PrepareError(
            f"{path}: cannot read rows from row {row} ({str(error).splitlines()[0]}); "
            "the file is damaged, write it again"
        ) from None
