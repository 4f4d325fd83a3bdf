"""Names the config and store layers share for corpora read in place (docs/in-place-corpora.md):
their format names, where `pipeline index` keeps an index by default, the default token
column."""

from __future__ import annotations

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
