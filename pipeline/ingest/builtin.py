"""The `builtin` input format: `builtin:NAME`, corpora that ship with Python (`BUILTIN_CORPORA`).

Every machine with the same Python has the same documents, for demos and tests. Keys:
`builtin:NAME:<path or topic>`. The instruction corpora (`INSTRUCTION_CORPORA`) are rows
whatever `--format` says.
"""

from __future__ import annotations

import os
import sysconfig
import tokenize
from collections.abc import Iterator
from typing import Any

from pipeline.errors import PrepareError
from pipeline.ingest.chat import RowFields
from pipeline.ingest.docstrings import SYSTEM_PROMPT, module_files, pairs
from pipeline.ingest.formats import Document, InputSpec
from pipeline.ingest.text import read_bytes, walk_files

NAME = "builtin"
SUFFIXES: tuple[str, ...] = ()
PREFIX = "builtin:"
READS_FIELDS = False
READS_ROWS = True  # its instruction corpora (`INSTRUCTION_CORPORA`); the others are refused
NO_FIELDS = "is builtin text (no fields)"

BUILTIN_CORPORA: dict[str, str] = {
    "python-code": "the Python standard library's .py sources, without its tests",
    "python-tests": "the Python standard library's test suite (Lib/test/*.py)",
    "python-docs": "the English Python documentation topics (pydoc_data.topics)",
    "python-docstrings": "instruction pairs: a prompt for a stdlib function's docstring, and it",
    "python-docstrings-chat": "the same pairs as chat messages (system, user, assistant)",
}
"""Corpora that need no download: every machine with the same Python has the same documents."""

INSTRUCTION_CORPORA: dict[str, RowFields] = {
    "python-docstrings": RowFields("prompt-completion"),
    "python-docstrings-chat": RowFields("messages"),
}
"""The builtin corpora of instruction rows, and their shape (see `docstrings`)."""

_EXCLUDED_CODE_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def resolve(argument: str, text_field: str, data_dir: str | None) -> InputSpec:
    name = argument[len("builtin:") :]
    if name not in BUILTIN_CORPORA:
        raise PrepareError(
            f"unknown builtin corpus {argument!r}; valid: "
            + ", ".join(f"builtin:{n}" for n in BUILTIN_CORPORA)
        )
    if name == "python-docs":
        return InputSpec("builtin", argument, name=name)
    if name in INSTRUCTION_CORPORA:
        files = tuple(
            (path, "docstrings", f"{argument}:{module}") for module, path in module_files()
        )
        return InputSpec("builtin", argument, files, fields=INSTRUCTION_CORPORA[name], name=name)
    stdlib = sysconfig.get_paths()["stdlib"]
    if name == "python-code":
        rels = walk_files(stdlib, _is_excluded_code_dir)
    else:
        test_dir = os.path.join(stdlib, "test")
        if not os.path.isdir(test_dir):
            raise PrepareError(
                f"input {argument!r}: this Python has no test suite at {test_dir} (Debian-like "
                "systems split it out); install it (e.g. libpython3-testsuite) or use "
                "builtin:python-code"
            )
        rels = ["test/" + rel for rel in walk_files(test_dir)]
    rels = [rel for rel in rels if rel.endswith(".py")]
    if not rels:
        raise PrepareError(f"input {argument!r}: found no .py files under {stdlib}")
    files = tuple((os.path.join(stdlib, rel), "python", f"{argument}:{rel}") for rel in rels)
    return InputSpec("builtin", argument, files, name=name)


def documents(spec: InputSpec) -> Iterator[Document]:
    if spec.name == "python-docs":
        from pydoc_data.topics import topics

        for topic in sorted(topics):
            yield Document(f"{spec.argument}:{topic}", topics[topic])
        return
    for path, kind, key in spec.files:
        if kind == "docstrings":
            yield from _iter_docstrings(spec, path)
        else:
            text = _read_python_source(path)
            if text is not None:
                yield Document(key, text)


def _is_excluded_code_dir(rel_dir: str) -> bool:
    """Test packages and third-party code are not part of ``builtin:python-code``."""
    rel = rel_dir.replace(os.sep, "/")
    return os.path.basename(rel) in _EXCLUDED_CODE_DIRS or rel == "lib2to3/tests"


def _iter_docstrings(spec: InputSpec, path: str) -> Iterator[Document]:
    module = os.path.basename(path)[: -len(".py")]
    for pair in pairs(module, read_bytes(path)):
        if spec.fields.format == "messages":
            row: dict[str, Any] = {
                "messages": [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": pair.prompt},
                    {"role": "assistant", "content": pair.docstring},
                ]
            }
        else:
            row = {"prompt": pair.prompt + "\n", "completion": pair.docstring}
        key = f"{spec.argument}:{pair.name}"
        yield Document(key, "", row, spec.fields, f"{path} ({pair.name})")


def _read_python_source(path: str) -> str | None:
    """Decodes a stdlib source by Python's own rules (PEP 263), as the interpreter would.

    A handful of test fixtures are deliberately undecodable (``badsyntax_pep3120.py``); Python
    cannot read them either, so they are not part of a builtin corpus. That rule depends only on
    the Python version, so the corpus is still the same on every machine with that Python.
    """
    data = read_bytes(path)
    try:
        encoding, _ = tokenize.detect_encoding(iter(data.splitlines(keepends=True)).__next__)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None
