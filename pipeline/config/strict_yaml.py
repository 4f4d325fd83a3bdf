"""Reading a YAML data config strictly: UTF-8 only, no duplicate key, errors with line:column.

PyYAML's `safe_load` lets the last of two equal keys win silently (a second `seq_len:`, a path,
a weight, a schedule point). Here a duplicate is refused with the lines of both, and every
syntax error names the line and column where the parser stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError
from pipeline.urls import is_url, read_bytes

MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a mapping key written twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:  # an unhashable key: PyYAML's own error names it
                continue
            if seen is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen}); a key may appear once",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> Any:
    """The YAML document at a path or URL; any problem is one `ConfigError` naming
    path:line:column."""
    try:
        data = read_bytes(str(path)) if is_url(path) else Path(path).read_bytes()
    except OSError as error:
        why = error.strerror or str(error)
        raise ConfigError(f"{path}: cannot read the data config: {why}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte {data[error.start]:#04x} at offset "
            f"{error.start}); save the config as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = error.problem or error.context or "invalid YAML"
        context = f" ({error.context})" if error.context and error.problem else ""
        raise ConfigError(f"{where}: not valid YAML: {problem}{context}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {str(error).splitlines()[0]}") from None
