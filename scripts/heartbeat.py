"""The trainer's heartbeat: one line per process saying the step it reached and when.

A hung job (every trainer alive, no step progress: a stuck collective, a dead peer) looks
like a healthy one from outside; the heartbeat tells them apart. tpu/worker.sh sets
PIPELINE_HEARTBEAT to a file, copies it beside the checkpoints, and tpu/recover.sh restarts
the job when no host's step moves for TPU_HANG_TIMEOUT; on GKE the liveness probe reads the
file's age (tpu/gke/). The line is `key=value` words so that a shell can read it:

    step=120 time=1733380000 host=w-0 process=0 save_seconds=95 slowest_process=3

`save_seconds` is the measured time between two checkpoints (steps per save times seconds per
step): the default hang timeout is a multiple of it. `slowest_process` is the feed's straggler
(the host with the longest time to batch), which names the likely culprit of a hang.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


class Heartbeat:
    """Writes the heartbeat file at most every `every_s` seconds (and at the first step)."""

    def __init__(self, path: str | os.PathLike | None, save_every: int, every_s: float = 10.0):
        self.path = Path(path) if path else None
        self.save_every = save_every
        self.every_s = every_s
        self.host = socket.gethostname()
        self._last_write = float("-inf")
        self._first: tuple[int, float] | None = None  # (step, time) of the first beat

    @classmethod
    def from_env(cls, save_every: int) -> Heartbeat:
        return cls(os.environ.get("PIPELINE_HEARTBEAT"), save_every)

    def beat(self, step: int, process: int, feed: object | None = None) -> None:
        """After each step; `feed` (a DataFeed) is asked for its straggler only when writing."""
        if self.path is None:
            return
        now = time.time()
        if self._first is None:
            self._first = (step, now)
        if now - self._last_write < self.every_s:
            return
        first_step, first_time = self._first
        slowest = feed.stats().slowest_process if feed is not None else -1
        per_step = (now - first_time) / (step - first_step) if step > first_step else 0.0
        line = (
            f"step={step} time={int(now)} host={self.host} process={process} "
            f"save_seconds={int(per_step * self.save_every)} slowest_process={slowest}\n"
        )
        partial = self.path.with_name(self.path.name + ".tmp")
        try:  # a full disk or a vanished directory must not stop training
            partial.write_text(line)
            partial.replace(self.path)
        except OSError:
            return
        self._last_write = now
