"""Every process must make the same `DataFeed.set_mix` calls: checked at each call.

The rows of a step are a pure function of the ledger, so a process whose call differs (other
weights, another step, or no call) would train on other batches than its peers without any
error. At each call every process publishes the entry it records in JAX's coordination
service's key-value store (`pipeline/set_mix/<n>/<process>`, n counting the calls of this
process) and reads every peer's: a difference, or a peer that makes no call within
`WAIT_S`, raises one `LedgerError` naming both processes, on every process. One process: no
check. A process deletes its key of call n - 1 once it has read every key of call n (every
peer has read call n - 1's by then), so the store holds two calls' keys at most.
"""

from __future__ import annotations

import itertools
import json

import jax

from pipeline.errors import LedgerError
from pipeline.feed.host_stop import coordination_client
from pipeline.plan.ledger import MixEntry

PREFIX = "pipeline/set_mix/"
WAIT_S = 300
"""How long a call waits for the peers' (they reach the step at about the same time)."""

_calls = itertools.count()  # this process's calls, over all its feeds, in program order


def check_same_call(entry: MixEntry) -> None:
    """Publish `entry` and compare it with every peer's call of the same rank (see module)."""
    client = coordination_client()
    if client is None:
        return
    call, me = next(_calls), jax.process_index()
    mine = json.dumps(entry.to_json(), sort_keys=True)
    client.key_value_set(f"{PREFIX}{call}/{me}", mine)
    for peer in range(jax.process_count()):
        if peer == me:
            continue
        try:
            theirs = client.blocking_key_value_get(f"{PREFIX}{call}/{peer}", WAIT_S * 1000)
        except Exception as error:  # JAX raises its runtime error type for a deadline
            raise LedgerError(
                f"set_mix at step {entry.step}: process {me} set {mine}, process {peer} made "
                f"no set_mix call {call} within {WAIT_S} s ({type(error).__name__}); every "
                "process must make the same set_mix calls"
            ) from None
        if theirs != mine:
            raise LedgerError(
                f"set_mix call {call}: process {me} set {mine}, process {peer} set {theirs}; "
                "every process must make the same set_mix calls (steps and weights)"
            )
    if call:
        client.key_value_delete(f"{PREFIX}{call - 1}/{me}")
