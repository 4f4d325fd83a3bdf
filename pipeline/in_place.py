"""Names the config and store layers share for corpora read in place (docs/in-place-corpora.md):
where `pipeline index` keeps an index by default, and the default token column."""

from __future__ import annotations

from pathlib import Path

INDEX_SUFFIX = ".pipeline-index"
DEFAULT_COLUMN = "input_ids"


def default_index_dir(data: str | Path) -> Path:
    """Where `pipeline index` keeps the index when no directory is named: beside the data."""
    return Path(f"{data}{INDEX_SUFFIX}")
