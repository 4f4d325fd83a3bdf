"""pipeline: a deterministic, padding-free, exactly resumable multi-host input pipeline for JAX.

The packages are the layers, top to bottom; imports point down only::

    commands/  the `pipeline` CLI (prepare, inspect, dump, verify, epochs, stages, plot, bench)
       |
    feed/      JAX and Orbax: global jax.Arrays with prefetch, the checkpoint item,
       |       the Grain view of host rows, the MaxText adapter, statistics and metrics
    plan/      pure data order, from store metadata alone: layout (epochs, lanes, windows)
       |       -> mixing/stages (which source) -> plan (ledger, step, row) -> batch fields;
       |       ledger, resume, reports
    config/    YAML -> a validated DataConfig (schedules included)
    store/     token stores: the reader and their metadata, the writer, prepare (local and
       |       Beam), tokenizers
    errors, keys, urls, extras, progress
               what every layer shares: typed exceptions, the keyed hash, gs:// URLs kept
               apart from local paths (before a Path mangles them) and read through
               etils.epath, optional imports that name the extra to install, progress bars

Only `feed/` imports JAX, Orbax or Grain; its names below load on first use, so the config,
store and plan layers (and `pipeline --help`, `prepare`, `verify-store`) start without them.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from pipeline.config import DataConfig, load_config, parse_config
from pipeline.errors import (
    ConfigError,
    FeedError,
    LedgerError,
    MissingExtraError,
    PipelineError,
    PrepareError,
    StoreError,
    TokenizerError,
)
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.plan.ledger import Ledger
from pipeline.plan.plan import Plan, host_rows, micro_batch_rows
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore

_LAZY = {
    "DataFeed": "pipeline.feed.data_feed",
    "EvalFeed": "pipeline.feed.eval_feed",
    "DataSave": "pipeline.feed.checkpoint",
    "DataRestore": "pipeline.feed.checkpoint",
    "restore_or_start": "pipeline.feed.checkpoint",
    "host_dataset": "pipeline.feed.grain_source",
    "host_source": "pipeline.feed.grain_source",
    "reconcile": "pipeline.plan.resume",
}

__all__ = [
    "ConfigError",
    "DataConfig",
    "FeedError",
    "Ledger",
    "LedgerError",
    "MissingExtraError",
    "PipelineError",
    "Plan",
    "PrepareError",
    "PrepareOptions",
    "StoreError",
    "StoreMeta",
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
