"""One host's fatal data error stops every host, with that host's one line.

Multi-controller JAX cannot raise in another process. When one process's feed stops on a data
error (a store replaced under the run, a read that fails on every retry, a failed background
verification), its peers go on into the step's collectives and wait there for it until JAX
gives up on the lost peer, with JAX's message instead of ours. So:

* the failing process's `next()` writes the line it raises to the coordination service's
  key-value store (the one `jax.distributed.initialize` started), under `pipeline/stop/<its
  process index>`;
* the process's watcher thread (`pipeline.feed.watcher`: one per process, for all its feeds)
  polls that directory (one small RPC every `poll_period`: `POLL_S`, or longer in a large job
  so that the whole job asks at most `JOB_POLLS_PER_S` times a second; each process's first
  poll is offset by its share of the period, so the job's polls are spread evenly over it
  rather than arriving together; never on the training thread) and, on a peer's line, logs
  `host <i>: <line>` at ERROR; the next `next()` of every feed raises that line as a
  `FeedError`. A process whose training thread is stuck in a collective waiting for the stopped
  peer never calls `next()` again: when the line has not been raised `GRACE_S` after it was
  seen, the watcher leaves JAX's coordination service (as the stopped process does at exit),
  logs the line once more and ends the process with exit status 2, so that host's log ends
  with the same line.
* a trainer that exits on a data error may still not end: the MaxText adapter raises a
  `SystemExit` (`pipeline.maxtext.adapter.DataStop`), and the interpreter then waits for its
  non-daemon threads, such as an Orbax checkpoint save waiting for a peer that stops too.
  `end_process_after` ends such a process the same way `GRACE_S` later.
* the watcher also asks each store, every `STORE_CHECK_S`, whether it is still the store it
  opened (`TokenStore.check_unchanged`), so a host that never opens a replaced shard still
  stops on the replacement; `next()` raises and publishes it, after the config key of the
  store's source (`Plan.store_message`), as a read's error. A local store is checked by every
  process (one `stat` of its manifest: each host may hold its own copy). A cloud store is one
  object for all hosts and its check is a billed metadata request, so one process checks it
  (`checks_remote`: its fingerprint modulo the process count) and the others learn of a
  replacement from that process's published stop: stores / `STORE_CHECK_S` requests a second
  whatever the host count. A store that several feeds of a process share is checked once.

`POLL_S`, `STORE_CHECK_S` and `GRACE_S` may be set per job through the environment variables
`PIPELINE_STOP_POLL_S`, `PIPELINE_STOP_STORE_CHECK_S` and `PIPELINE_STOP_GRACE_S` (a large job
polls the coordinator less often, at the cost of a later stop: docs/jax-integration.md).

A published stop ends the data of the whole `jax.distributed` session: every feed of every
process stops on it, as the job cannot go on without the failed process. In one process there
is nothing to publish or poll, and the store re-check is the watcher's only work.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any, NamedTuple

import jax

from pipeline.config.env import positive_number

log = logging.getLogger("pipeline")

PREFIX = "pipeline/stop/"
"""The key-value directory of published stops: key PREFIX + process index, value the line."""
POLL_S = 2.0
"""Seconds between two polls of the stop directory (one RPC to the coordinator each)."""
JOB_POLLS_PER_S = 100.0
"""The most polls of the stop directory a second from all processes of the job together
(whatever the number of feeds in each): from `JOB_POLLS_PER_S * POLL_S` processes on (200 at
the defaults) the period grows with the process count (`poll_period`), as does the delay
before a peer's stop is seen."""
STORE_CHECK_S = 10.0
"""Seconds between two checks that each store is still the one opened."""
GRACE_S = 10.0
"""Seconds a peer's stop may wait for `next()` to raise it before the watcher ends the process."""
SHUTDOWN_S = 60.0
"""Seconds the watcher waits for JAX's shutdown barrier before ending the process anyway."""
EXIT_STATUS = 2  # a PipelineError's exit status
POLL_ENV = "PIPELINE_STOP_POLL_S"  # overrides POLL_S
STORE_CHECK_ENV = "PIPELINE_STOP_STORE_CHECK_S"  # overrides STORE_CHECK_S
GRACE_ENV = "PIPELINE_STOP_GRACE_S"  # overrides GRACE_S


class Periods(NamedTuple):
    """The watcher's periods in seconds: `POLL_S`, `STORE_CHECK_S` and `GRACE_S`, or their
    environment variables' values."""

    poll_s: float
    store_check_s: float
    grace_s: float


def stop_periods() -> Periods:
    """The periods from the environment (ConfigError if one is not a number of seconds > 0);
    the feed reads them before it acquires anything, so a bad value leaves nothing to undo."""
    return Periods(
        positive_number(POLL_ENV, POLL_S, "seconds"),
        positive_number(STORE_CHECK_ENV, STORE_CHECK_S, "seconds"),
        positive_number(GRACE_ENV, GRACE_S, "seconds"),
    )


def poll_period(poll_s: float, processes: int) -> float:
    """Seconds between two polls of the stop directory by each process: `poll_s`, or longer, so
    that `processes` processes together poll at most `JOB_POLLS_PER_S` times a second."""
    return max(poll_s, processes / JOB_POLLS_PER_S)


def first_poll_offset(period: float, process: int, processes: int) -> float:
    """Seconds after the watcher's start of `process`'s first poll: its share of the period
    (never more than the period), so that processes started together poll at evenly spread
    times, not in one burst."""
    return period * (process + 1) / processes


def checks_remote(fingerprint: str, process: int, processes: int) -> bool:
    """Whether `process` (of `processes`) is the one that re-checks the cloud store of this
    content fingerprint: the same answer on every process, whatever stores each one holds open
    and in which order it opened them."""
    return int(fingerprint, 16) % processes == process


def stopped(polled: dict[str, str]) -> list[tuple[int, str]]:
    """The published stops among the stop directory's keys and values, (process index, line)
    by index; its other keys (the stragglers' verdicts) are not stops."""
    named = ((key.removeprefix(PREFIX), line) for key, line in polled.items())
    return sorted((int(index), line) for index, line in named if index.isdigit())


def coordination_client() -> Any | None:
    """The client `jax.distributed.initialize` set up (None in one process). JAX has no public
    accessor; Orbax reads the same attribute."""
    if jax.process_count() == 1:
        return None
    from jax._src import distributed

    return distributed.global_state.client


def end_process(line: str) -> None:
    """Leave JAX's coordination service as a stopped host does (its exit waits in JAX's
    shutdown barrier for every process; a process gone without it would fail that barrier with
    JAX's message there), then end this process with `line` last in its log, status 2."""
    leaving = threading.Thread(target=jax.distributed.shutdown, daemon=True)
    leaving.start()
    leaving.join(SHUTDOWN_S)
    exit_with(line)


def exit_with(line: str) -> None:
    """End this process now with `line` last in its log and status 2."""
    log.error("%s", line)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(EXIT_STATUS)


_exit_handlers_started = threading.Event()


def end_process_after(line: str) -> None:
    """End the process with `line` `GRACE_S` seconds (`PIPELINE_STOP_GRACE_S`) from now, as
    `end_process` does, unless it has ended by then.

    For a trainer that is told to exit on a data error but may not manage to: a `SystemExit`
    waits for the interpreter's non-daemon threads, and one of them (e.g. Orbax's checkpoint
    finalize) can wait on a barrier of a peer that is stopping too. Both timers start now: at
    interpreter exit Python 3.12 starts no new thread. If the exit handlers have begun by then,
    JAX's own handler is leaving the coordination service; otherwise the first timer leaves it.
    The second ends the process `SHUTDOWN_S` later whatever JAX's shutdown barrier does.
    """
    atexit.register(_exit_handlers_started.set)  # runs before JAX's (registered earlier)
    grace = positive_number(GRACE_ENV, GRACE_S, "seconds")
    for delay, action in ((grace, _leave_and_exit), (grace + SHUTDOWN_S, exit_with)):
        timer = threading.Timer(delay, action, args=(line,))
        timer.daemon = True
        timer.start()


def _leave_and_exit(line: str) -> None:
    if _exit_handlers_started.is_set():
        return  # JAX's exit handler is leaving; the process ends with it, or at the deadline
    try:
        jax.distributed.shutdown()
    except Exception as error:  # a peer gone already: JAX's barrier fails, the line still ends
        log.warning("leaving JAX's coordination service: %s", error)
    exit_with(line)
