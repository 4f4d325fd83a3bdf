"""The skip a restore asks for, and the skips a ledger holds scheduled after its step.

A restore may pass over N steps of data in two forms (docs/steering.md):

* **bare** (`skip_steps=N`): at the restored step, whichever it is. Every restore that asks
  skips again, so it is for a restart run by hand, once.
* **at a step** (`skip_steps=N, skip_at=S`, S a training step: the trainer's step counter,
  which numbers its checkpoints): exactly one skip of N at step S in the run, however often
  the same request is repeated (a restart loop re-running one command). Restored at S: the
  skip is made there. Restored before S: it is *scheduled*, a segment of the ledger that starts
  at S (`Ledger.skips_only`), so the run serves every step up to S, then skips; the
  checkpoints saved meanwhile carry it, so it survives every restore, process-count change and
  switch before S. Restored from a ledger that already holds a skip of N at S: nothing more
  is skipped (one log line says so). Restored after S from a checkpoint without it (the
  request came after the run passed S): refused in one line, since skipping somewhere else
  than asked could be the wrong data and repeating the restore cannot change the outcome.

A scheduled skip restored before S is laid out again with the config of that restore (it
passes over N steps of whatever the run follows at S).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from pipeline.errors import LedgerError
from pipeline.plan.ledger import Ledger

MAX_STEPS = 2**53
"""The largest skip or skip step taken: any larger is a typo (and could overflow int64 lane
positions once added to a step)."""


def checked_steps(value: object, name: str) -> int:
    """`value` as an int if it is an integer from 0 to `MAX_STEPS` (a NumPy integer too; not a
    bool), else one `LedgerError` line naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise LedgerError(f"{name}: expected an integer >= 0, got {value!r}")
    if value > MAX_STEPS:
        raise LedgerError(f"{name}: expected an integer of at most {MAX_STEPS:,}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Skip:
    """What a restore asks to skip: `steps` at `at` (None: at the restored step, bare)."""

    steps: int = 0
    at: int | None = None

    @classmethod
    def of(cls, steps: object = 0, at: object = None) -> Skip:
        """A checked request (`checked_steps`)."""
        steps = checked_steps(steps, "skip_steps")
        return cls(steps, None if at is None else checked_steps(at, "skip_at"))

    def describe(self) -> str:
        return f"skip of {self.steps} steps" + ("" if self.at is None else f" at step {self.at}")


def scheduled(ledger: Ledger, step: int) -> dict[int, int]:
    """The skips `ledger` holds after `step`: {start step: steps skipped}."""
    return {s.start_step: s.skip for s in ledger.segments if s.start_step > step}


def resolve(ledger: Ledger, step: int, skip: Skip, events: list[str]) -> tuple[int, dict[int, int]]:
    """(steps to skip at the restored `step`, the skips to schedule after it) for a restore of
    `ledger` at `step` asking for `skip` (module docstring). The skips `ledger` holds after
    `step` stay scheduled; a request at a later step replaces one held there. What the restore
    will have done (held already, scheduled) goes to `events`, a line each."""
    future = scheduled(ledger, step)
    if skip.at is None or skip.steps == 0:
        return skip.steps, future
    at, steps = skip.at, skip.steps
    held = next((s.skip for s in ledger.segments if s.start_step == at and s.skip), None)
    if held == steps:
        events.append(
            f"{skip.describe()}: already in the ledger (restored at step {step}); nothing more "
            "is skipped"
        )
        return 0, future
    if at < step:
        holds = f"a skip of {held} steps there" if held else "no skip there"
        raise LedgerError(
            f"skip_at {at}: the restored step {step} is past it and the checkpoint's ledger "
            f"holds {holds}, so a {skip.describe()} cannot be made; restore a checkpoint at or "
            "before that step, or skip at the restored step (skip_steps without skip_at)"
        )
    if at == step:
        return steps, future
    events.append(
        f"{skip.describe()} scheduled (restored at step {step}): steps {step}..{at - 1} are "
        f"served as planned, then {steps} steps of data are passed over"
    )
    return 0, {**future, at: steps}
