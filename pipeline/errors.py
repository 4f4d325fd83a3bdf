"""Typed errors. Every message names the file, key or step at fault and says how to fix it.

The CLI prints `str(error)` on one line and exits with `error.exit_code`; library users catch
`PipelineError` (or a subclass) and never see an `assert`.
"""

from __future__ import annotations


class PipelineError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = 2


class ConfigError(PipelineError):
    """A data config (YAML or arguments) is malformed; raised before any read."""


class StoreError(PipelineError):
    """A token store is missing, incomplete, corrupt or not a store."""


class UnreachableError(StoreError):
    """Object storage did not answer (no connection, or no answer within `feed.read_timeout_s`):
    nothing is known of the store itself."""


class PrepareError(PipelineError):
    """`prepare` cannot turn its inputs into a store (missing input, empty corpus, ...)."""


class TokenizerError(PipelineError):
    """A tokenizer spec is unknown or its file cannot be loaded."""


class LedgerError(PipelineError):
    """A ledger or checkpointed data state does not fit the run or the config."""


class MissingExtraError(PipelineError):
    """An optional dependency is not installed; the message names the extra to install."""


class FeedError(PipelineError):
    """The JAX feed cannot serve the requested mesh, sharding or step."""


class InstallError(PipelineError):
    """`pipeline maxtext install` cannot find where MaxText's code needs the change."""
