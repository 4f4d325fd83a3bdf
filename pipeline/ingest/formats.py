"""The input formats of `prepare`: the interface each one declares, and their registry.

A file format reads files of its suffixes (`text` reads any other file); a source format reads
the inputs that start with its prefix (`tfds:`, `builtin:`). `FORMATS` is the one registry:
each name and the module that is the format (its module-level names are the interface below),
so a new format is one module and one line here (docs/architecture.md). `corpora` asks the
registry, never a format's name, what an input is and how to read it; the formats share
`Document` and `InputSpec` from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import Any, Protocol, cast

from pipeline.errors import PrepareError
from pipeline.ingest.chat import RowFields, json_kind

FORMATS = {
    "text": "pipeline.ingest.text",
    "jsonl": "pipeline.ingest.jsonl",
    "parquet": "pipeline.ingest.parquet",
    "tfds": "pipeline.ingest.tfds",
    "builtin": "pipeline.ingest.builtin",
}
DEFAULT_FILE_FORMAT = "text"  # a file no suffix claims: one document, the whole file
ROWS_HINT = (
    "; chat or instruction rows need --format messages or --format prompt-completion "
    "(docs/instruction-data.md)"
)
"""Appended where a record lacks a text string: a chat file read as text fails exactly there."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: ``key`` locates it stably (see the module docstring), ``text`` is its text.

    An instruction or chat row has no text yet: ``row`` holds its fields, ``fields`` says their
    shape (rendered by `chat.render`), ``where`` names its file and line for error messages.
    ``id`` is the value of the input's id field (`InputSpec.id_field`); "" when it has none, and
    then the key is the document's id.
    """

    key: str
    text: str
    row: Mapping[str, Any] | None = None
    fields: RowFields | None = None
    where: str = ""
    id: str = ""

    @property
    def document_id(self) -> str:
        """What `prepare --id-field/--record-ids` records: the id field's value, else the key."""
        return self.id or self.key


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One validated input of `prepare`.

    Attributes:
      kind: ``dir``, ``glob``, ``text``, ``jsonl``, ``parquet``, ``tfds`` or ``builtin``.
      argument: the input as the user typed it (used in messages and key prefixes).
      files: for file kinds, ``(path, file kind, file key)`` in read order, resolved up front so
        the file set cannot change between validation and reading.
      key_prefix: prepended to every key of this input to keep keys unique across inputs.
      text_field: JSONL field, Parquet column or TFDS feature that holds the text.
      fields: for instruction and chat rows (JSONL and Parquet only), their shape and fields.
      name: the TFDS ``NAME[/CONFIG]`` or the builtin corpus name.
      split: the TFDS split.
      data_dir: the TFDS data directory.
      id_field: JSONL field or Parquet column of each document's id (`--id-field`), or None.
    """

    kind: str
    argument: str
    files: tuple[tuple[str, str, str], ...] = ()
    key_prefix: str = ""
    text_field: str = "text"
    fields: RowFields | None = None
    name: str = ""
    split: str = ""
    data_dir: str = ""
    id_field: str | None = None


class InputFormat(Protocol):
    """What every format declares."""

    NAME: str  # its name in FORMATS: the `InputSpec.kind` of its inputs, or of its files
    SUFFIXES: tuple[str, ...]  # a file format's suffixes, lower case; () for a source
    PREFIX: str  # a source format's argument prefix; "" for a file format
    READS_FIELDS: bool  # reads the field `--text-field` names
    READS_ROWS: bool  # reads instruction or chat rows (`--format messages|prompt-completion`)
    NO_FIELDS: str  # why an input of it reads no field (`--text-field` refused); "" if it does


class FileFormat(InputFormat, Protocol):
    def check(
        self, argument: str, path: str, text_field: str | None, rows: RowFields | None
    ) -> None:
        """What is cheap to check of file `path` of input `argument` before reading it: the
        field `text_field`, or the fields of `rows`."""
        ...

    def read(self, spec: InputSpec, path: str, key: str) -> Iterator[Document]:
        """The documents of file `path` of `spec`, keyed from `key`."""
        ...


class SourceFormat(InputFormat, Protocol):
    def resolve(self, argument: str, text_field: str, data_dir: str | None) -> InputSpec:
        """Input `argument`, validated before any reading."""
        ...

    def documents(self, spec: InputSpec) -> Iterator[Document]:
        """The documents of `spec` (of each of its files, when it has some)."""
        ...


def input_format(name: str) -> InputFormat:
    """The format registered as `name`."""
    return cast("InputFormat", import_module(FORMATS[name]))


def file_format(path: str) -> FileFormat:
    """The file format of `path`, by its suffix."""
    lower = path.lower()
    formats = [input_format(name) for name in FORMATS]
    claims = (f for f in formats if f.SUFFIXES and lower.endswith(f.SUFFIXES))
    return cast("FileFormat", next(claims, input_format(DEFAULT_FILE_FORMAT)))


def source_format(argument: str) -> SourceFormat | None:
    """The source format whose prefix `argument` starts with, if any."""
    formats = [input_format(name) for name in FORMATS]
    found = (f for f in formats if f.PREFIX and argument.startswith(f.PREFIX))
    return cast("SourceFormat | None", next(found, None))


def is_source(kind: str) -> bool:
    """Whether inputs of `kind` (an `InputSpec.kind`) are a source format's."""
    return kind in FORMATS and bool(input_format(kind).PREFIX)


def id_value(record: Mapping[str, Any], field: str, where: str) -> str:
    """Field `field` of a row as a document id: a non-empty string, or an integer in decimal."""
    if field not in record:
        raise PrepareError(
            f"{where} has no id field {field!r} (keys: {', '.join(sorted(record)) or 'none'}); "
            "give every row an id, or pass --id-field with the field that holds it"
        )
    value = record[field]
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, str) and value:
        return value
    kind = "an empty string" if value == "" else json_kind(value)
    raise PrepareError(
        f"{where}: id field {field!r} is {kind}, not a non-empty string or an integer"
    )


def as_text(value: Any, where: str) -> str:
    """A field's value as text: a string, or UTF-8 bytes."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PrepareError(
                f"{where} is not valid UTF-8 ({error.reason}); store UTF-8 text"
            ) from None
    raise PrepareError(f"{where} is {json_kind(value)}, not text; store a string in every row")
