"""pipeline: a deterministic, padding-free, exactly resumable multi-host input pipeline for JAX.

The layers, top to bottom (imports point down only)::

    config (YAML -> DataConfig)      ledger (segments of the run's data state)
        |                               |
    store (token stores) -> layout (epochs, lanes, windows) -> mixing/stages (which source)
        |                               |
        +------------> plan (ledger, step, row) -> batch fields
                                        |
                         feed (global jax.Arrays, prefetch)  <->  checkpoint (Orbax item)

The JAX feed, the Orbax item and the Grain source load on first use of their names.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pipeline.config import DataConfig, load_config, parse_config
from pipeline.errors import (
    ConfigError,
    FeedError,
    LedgerError,
    PipelineError,
    PrepareError,
    StoreError,
    TokenizerError,
)
from pipeline.ledger import Ledger
from pipeline.plan import Plan, host_rows, micro_batch_rows
from pipeline.prepare import PrepareOptions, prepare
from pipeline.store import TokenStore

_LAZY = {
    "DataFeed": "pipeline.feed",
    "EvalFeed": "pipeline.eval_feed",
    "DataSave": "pipeline.checkpoint",
    "DataRestore": "pipeline.checkpoint",
    "restore_or_start": "pipeline.checkpoint",
    "host_dataset": "pipeline.grain_source",
    "reconcile": "pipeline.resume",
}

__all__ = [
    "ConfigError",
    "DataConfig",
    "FeedError",
    "Ledger",
    "LedgerError",
    "PipelineError",
    "Plan",
    "PrepareError",
    "PrepareOptions",
    "StoreError",
    "TokenStore",
    "TokenizerError",
    "host_rows",
    "load_config",
    "micro_batch_rows",
    "parse_config",
    "prepare",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
