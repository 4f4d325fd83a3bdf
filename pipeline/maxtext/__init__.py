"""MaxText: the adapter its trainer calls, the keys it reads, and `pipeline maxtext install`.

`adapter` serves MaxText's `create_data_iterator(config, mesh)` from a DataFeed (JAX); `keys`
is the one table of our keys in MaxText's config; `install` patches a MaxText checkout and
`cli` is its subcommand. The adapter's names load on first use, so `from pipeline import
maxtext as pipeline_maxtext` (the line the installer writes into MaxText) and the CLI start
without JAX.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_ADAPTER = ("DataStop", "create_data_iterator", "is_enabled", "read_iter_state")


def __getattr__(name: str) -> Any:
    if name in _ADAPTER:
        return getattr(import_module("pipeline.maxtext.adapter"), name)
    raise AttributeError(f"module 'pipeline.maxtext' has no attribute {name!r}")
