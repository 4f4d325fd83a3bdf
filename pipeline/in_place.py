"""Names the config and store layers share for corpora read in place (docs/in-place-corpora.md):
their format names, where `pipeline index` keeps an index by default, the default token
column, and what a path that is no token store holds instead (`hint`)."""

from __future__ import annotations

import os
from pathlib import Path

IN_PLACE_FORMATS = ("megatron", "parquet")
"""The `format:` names of corpora read in place: the keys of `store.formats.IN_PLACE`."""
COLUMN_FORMATS = ("parquet",)
"""Of those, the formats whose ids are a named column (`column:`, `--column`, `--labels`,
`--loss-mask`)."""
INDEX_SUFFIX = ".pipeline-index"
DEFAULT_COLUMN = "input_ids"


def default_index_dir(data: str | Path) -> Path:
    """Where `pipeline index` keeps the index when no directory is named: beside the data."""
    return Path(f"{data}{INDEX_SUFFIX}")


COLUMN_SUFFIXES = (".parquet", ".arrow")


def hint(path: Path) -> str:
    """What to do with `path` when it is no token store but a corpus to read in place (a
    Megatron prefix with its .bin/.idx, a directory of Parquet/Arrow files), for the error
    that says it is no store; "" otherwise."""
    if os.path.isfile(f"{path}.bin") and os.path.isfile(f"{path}.idx"):
        return (
            f"; {path}.bin/.idx are a Megatron dataset: read it in place with `format: "
            f"megatron` after `pipeline index {path}` (docs/in-place-corpora.md)"
        )
    if path.is_dir() and any(p.suffix in COLUMN_SUFFIXES for p in path.iterdir()):
        return (
            f"; {path} holds Parquet/Arrow files: read them in place with `format: parquet` "
            f"after `pipeline index {path} --format parquet` (docs/in-place-corpora.md)"
        )
    return ""
