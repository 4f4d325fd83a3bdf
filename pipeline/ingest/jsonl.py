"""The `jsonl` input format: JSON Lines (`.jsonl`, `.json`), one object per line.

The text is field `--text-field` of each object; with `--format messages|prompt-completion` an
object is an instruction or chat row (`Document.row`), rendered when tokenized. Blank lines
carry no data and are passed over. With `--id-field`, each object's id is that field (a string
or an integer).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from pipeline.errors import PrepareError
from pipeline.ingest.chat import RowFields, json_kind
from pipeline.ingest.formats import ROWS_HINT, Document, InputSpec, id_value
from pipeline.ingest.text import open_input

NAME = "jsonl"
SUFFIXES = (".jsonl", ".json")
PREFIX = ""
READS_FIELDS = True
READS_ROWS = True
NO_FIELDS = ""


def check(argument: str, path: str, text_field: str | None, rows: RowFields | None) -> None:
    """Nothing to check before reading: each line is checked as it is read."""


def read(spec: InputSpec, path: str, key: str) -> Iterator[Document]:
    return _iter_jsonl(path, key, spec.text_field, spec.fields, spec.id_field)


def _iter_jsonl(
    path: str, key: str, field: str, rows: RowFields | None, id_field: str | None
) -> Iterator[Document]:
    with open_input(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PrepareError(
                    f"{path} line {number} is not valid UTF-8 ({error.reason}); convert the "
                    "file to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise PrepareError(
                    f"{path} line {number} is not JSON ({error.msg} at column {error.colno}); "
                    "JSON Lines need one JSON object per line"
                ) from None
            where = f"{path} line {number}"
            document_id = ""
            if id_field is not None and isinstance(record, dict):  # else refused below
                document_id = id_value(record, id_field, where)
            if rows is not None:  # checked when rendered, so that a bad row can be skipped
                yield Document(f"{key}:{number}", "", record, rows, where, document_id)
                continue
            if not isinstance(record, dict):
                raise PrepareError(
                    f"{path} line {number} is {json_kind(record)}, not an object; "
                    f"JSON Lines need one object per line with field {field!r}"
                )
            if field not in record:
                raise PrepareError(
                    f"{path} line {number} has no field {field!r} (keys: "
                    f"{', '.join(sorted(record)) or 'none'}); pass --text-field with the text field"
                    f"{ROWS_HINT}"
                )
            text = record[field]
            if not isinstance(text, str):
                raise PrepareError(
                    f"{path} line {number}: field {field!r} is {json_kind(text)}, not a "
                    f"string; store the text as a JSON string{ROWS_HINT}"
                )
            yield Document(f"{key}:{number}", text, id=document_id)
