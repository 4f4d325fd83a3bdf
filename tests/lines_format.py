"""A test input format, registered by tests/test_corpora.py: one document per line of `.lines`
files, as a contributor would add one (docs/architecture.md)."""

from __future__ import annotations

from collections.abc import Iterator

from pipeline.ingest.chat import RowFields
from pipeline.ingest.formats import Document, InputSpec
from pipeline.ingest.text import read_text

NAME = "lines"
SUFFIXES = (".lines",)
PREFIX = ""
READS_FIELDS = False
READS_ROWS = False
NO_FIELDS = "is lines of text (one document per line)"


def check(argument: str, path: str, text_field: str | None, rows: RowFields | None) -> None:
    """Nothing to check before reading."""


def read(spec: InputSpec, path: str, key: str) -> Iterator[Document]:
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        yield Document(f"{key}:{number}", line)
