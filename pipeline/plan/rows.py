"""Which rows of a step's global batch a process, or a micro-batch, holds."""

from __future__ import annotations

import numpy as np

from pipeline.errors import ConfigError


def host_rows(global_batch_size: int, process_index: int, process_count: int) -> np.ndarray:
    """The contiguous block of rows a process holds when the batch is split evenly."""
    if global_batch_size % process_count:
        raise ConfigError(
            f"global_batch_size {global_batch_size} is not divisible by {process_count} processes"
        )
    per = global_batch_size // process_count
    return np.arange(process_index * per, (process_index + 1) * per)


def micro_batch_rows(global_batch_size: int, grad_accum: int, micro_batch: int) -> np.ndarray:
    """Rows of micro-batch `micro_batch`: consecutive slices of the step's rows, in order."""
    size = global_batch_size // grad_accum
    return np.arange(micro_batch * size, (micro_batch + 1) * size)
