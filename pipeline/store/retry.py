"""Retrying reads that a storage client reports as transient, with bounded, jittered backoff.

Cloud Storage answers a busy moment with 429/5xx or a dropped connection; a thousand hosts that
all retry on the same schedule come back at the same moment, so each wait is drawn at random
below an exponentially growing cap ("full jitter"). What is not transient (a missing object, a
checksum, a bad range), and a transient error that outlasts every attempt, is raised as is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# Markers of a retryable failure in the messages of ArrayRecord's C++ GCS client
# (absl status codes, HTTP status) and of Python clients; "Permanent error" is its "do not retry".
_TRANSIENT = (
    "UNAVAILABLE",
    "DEADLINE_EXCEEDED",
    "RESOURCE_EXHAUSTED",
    "Retry policy exhausted",
    "status code: 429",
    "status code: 500",
    "status code: 502",
    "status code: 503",
    "status code: 504",
    "Connection reset",
    "timed out",
)


def is_transient(error: BaseException) -> bool:
    """Whether a read that raised `error` may succeed if tried again."""
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    text = str(error)
    return "Permanent error" not in text and any(marker in text for marker in _TRANSIENT)


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries; before try n+1 a random wait in [0, min(max_delay,
    first_delay * 2**n)) seconds: at most ~`max_delay * attempts` in all, however bad the day."""

    attempts: int = 6
    first_delay: float = 0.05
    max_delay: float = 2.0

    def call(self, action: Callable[[], T]) -> T:
        for attempt in range(self.attempts):
            try:
                return action()
            except Exception as error:
                if attempt + 1 == self.attempts or not is_transient(error):
                    raise
                cap = min(self.max_delay, self.first_delay * 2**attempt)
                time.sleep(random.uniform(0.0, cap))
        raise AssertionError("unreachable: the last attempt returns or raises")
