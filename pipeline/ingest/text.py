"""The `text` input format: any file no other format claims is one document, as UTF-8."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import BinaryIO

from pipeline.errors import PrepareError
from pipeline.ingest.chat import RowFields
from pipeline.ingest.formats import Document, InputSpec
from pipeline.urls import location

NAME = "text"
SUFFIXES: tuple[str, ...] = ()  # the default of `formats.file_format`
PREFIX = ""
READS_FIELDS = False
READS_ROWS = False
NO_FIELDS = "is plain text (one document per file)"


def check(argument: str, path: str, text_field: str | None, rows: RowFields | None) -> None:
    """Nothing to check before reading: any bytes are read, and refused if not UTF-8."""


def read(spec: InputSpec, path: str, key: str) -> Iterator[Document]:
    yield Document(key, read_text(path))


def open_input(path: str) -> BinaryIO:
    """A local file or a bucket object (through etils.epath and gcsfs) opened for reading."""
    try:
        return location(path).open("rb")
    except OSError as error:
        raise unreadable(path, error) from None


def unreadable(path: str, error: OSError) -> PrepareError:
    return PrepareError(
        f"cannot read {path} ({error.strerror or error}); check that it exists and is readable"
    )


def read_bytes(path: str) -> bytes:
    with open_input(path) as f:
        try:
            return f.read()
        except OSError as error:
            raise unreadable(path, error) from None


def read_text(path: str) -> str:
    data = read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PrepareError(
            f"{path} is not valid UTF-8 (byte {error.start}: {error.reason}); convert it to "
            "UTF-8 or leave it out of the inputs"
        ) from None


def walk_files(root: str, skip_dir: Callable[[str], bool] | None = None) -> list[str]:
    """Relative POSIX paths of the regular, non-hidden files under ``root``, sorted."""
    found: list[str] = []
    for directory, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(directory, root)
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and not (skip_dir and skip_dir(os.path.normpath(os.path.join(rel_dir, d))))
        ]
        for name in files:
            full = os.path.join(directory, name)
            if not name.startswith(".") and os.path.isfile(full):
                found.append(os.path.normpath(os.path.join(rel_dir, name)).replace(os.sep, "/"))
    return sorted(found)
