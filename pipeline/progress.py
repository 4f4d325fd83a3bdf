"""Progress bars that suit where stderr goes: a live bar on a terminal, one summary line in a log.

A tqdm bar redraws with a carriage return, which a log file or a pipe keeps as thousands of
fragments of one line. Off a terminal the bar draws nothing while it runs and writes tqdm's own
summary (count, elapsed time, rate) once, as a line, when it closes.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


class _SummaryBar(tqdm):
    """A bar that never redraws (`delay` and `mininterval` are infinite) and ends with a line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # an error already being handled when the bar is made (it runs inside an `except`) is
        # not one that ends the bar's work
        self._outer_error = sys.exc_info()[1]
        super().__init__(*args, **kwargs)

    def close(self) -> None:
        # the first close only (tqdm's close disables the bar), and not while an error ends the
        # work: the command's one error line would follow a count of what it cut short
        error = sys.exc_info()[1]
        if not self.disable and (error is None or error is self._outer_error):
            self.fp.write(self.format_meter(**self.format_dict) + "\n")
            self.fp.flush()
        super().close()


def progress_bar(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    unit: str,
    total: int | None = None,
    enabled: bool = True,
) -> tqdm:
    """A tqdm bar on stderr: live on a terminal, else silent until one summary line at close."""
    stream = sys.stderr
    if not enabled:
        return tqdm(iterable, disable=True)
    if stream.isatty():
        return tqdm(iterable, desc=desc, unit=unit, total=total, file=stream, dynamic_ncols=True)
    return _SummaryBar(
        iterable,
        desc=desc,
        unit=unit,
        total=total,
        file=stream,
        delay=math.inf,
        mininterval=math.inf,
    )
