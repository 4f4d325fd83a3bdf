"""pipeline: a deterministic, padding-free, exactly resumable multi-host input pipeline for JAX.

The packages are the layers, top to bottom; imports point down only (tests/test_imports.py
checks it, and that there is no import circle)::

    commands/  the `pipeline` CLI (prepare, inspect, dump, verify, epochs, stages, plot, bench)
       |
    maxtext/   MaxText: the adapter its trainer calls, its config keys, `pipeline maxtext install`
       |
    feed/      JAX and Orbax: global jax.Arrays with prefetch, the checkpoint item,
       |       the Grain view of host rows, statistics and metrics
    read/      a plan's rows as the six batch fields: `Plan` (read, batch) over the plan's one
       |       set of open stores, windows and whole-document rows, the loss mask; verify, eval
    plan/      pure data order, `(ledger, step, rows) -> draws`, from store metadata: the row
       |       layouts (concat windows, best-fit packing; `row_layout` is their registry),
       |       mixing/stages (which source), ledger, resume, reports
    ingest/    `prepare`: corpora in (`formats` is the registry of input formats), tokenizers,
       |       token stores out (local and Beam)
    config/    YAML -> a validated DataConfig (schedules included)
    store/     token stores: the format, its reader and writer, their metadata, the set of
       |       stores a plan opens
    errors, keys, urls, extras, progress, wording, version
               what every layer shares: typed exceptions, the keyed hash, gs:// URLs kept
               apart from local paths (before a Path mangles them) and read through
               etils.epath, optional imports that name the extra to install, progress bars

Only `feed/` and `maxtext/` import JAX, Orbax or Grain; their names below load on first use, so
the other layers (and `pipeline --help`, `prepare`, `verify-store`) start without them.
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
from pipeline.plan.rows import host_rows, micro_batch_rows
from pipeline.read.plan import Plan
from pipeline.store.meta import StoreMeta
from pipeline.store.token_store import TokenStore
from pipeline.version import __version__ as __version__  # `pipeline.__version__`

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
