"""The checkpointed data state, `{version, step, ledger, digest}`: its one reader and writer.

The Orbax item (`pipeline.feed.checkpoint`), the MaxText adapter (`pipeline.maxtext.adapter`), the
CLI's `--ledger` and `scripts/demo.py` all go through this module, which imports no Orbax, so
the file format lives in one place. In a checkpoint it is `STEP/data/data_state.json`.

`digest` is a SHA-256 of the rest of the state: a state damaged on disk (a truncated or edited
file) is named as damaged rather than trusted. What the digest cannot tell apart (a hand edit
that recomputes it) `verify` catches by re-deriving what the ledger implies.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import LedgerError, StoreError
from pipeline.plan.ledger import Ledger
from pipeline.plan.plan import DrawPlan
from pipeline.urls import check_reachable, location

log = logging.getLogger("pipeline")

FILENAME = "data_state.json"
"""The data state's file name inside the checkpoint item directory (`STEP/data/`)."""
ITEM = "data"
"""The item name under which trainers save the data state in a `CheckpointManager`."""
MAXTEXT_ITEM = "iter"
"""The item name of MaxText's data iterator state (`pipeline.maxtext.adapter`)."""
STATE_VERSION = 2
"""Version 2 added `digest`; version-1 states (no digest) are refused by name."""


@dataclass(frozen=True)
class DataState:
    """The next step to train and the ledger: the whole data state of a run."""

    step: int
    ledger: Ledger
    origin: str = field(default="<data state>", compare=False)
    """Where the state was read from, for error messages."""

    def to_json(self) -> dict[str, Any]:
        body = {"version": STATE_VERSION, "step": self.step, "ledger": self.ledger.to_json()}
        return {**body, "digest": digest_of(body)}

    @classmethod
    def from_json(cls, raw: Any, origin: str) -> DataState:
        """Parse and check a state: its version, its digest, its step and its ledger."""
        if (
            isinstance(raw, dict)
            and raw.get("version") == 1
            and isinstance(raw.get("ledger"), dict)
        ):
            # pipeline 0.1 wrote it: its ledger's order version says why it cannot resume here
            Ledger.from_json(raw["ledger"], origin=f"{origin}: ledger")
        if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
            found = raw.get("version") if isinstance(raw, dict) else type(raw).__name__
            raise LedgerError(
                f"{origin}: not a version-{STATE_VERSION} data state (found version {found!r}); "
                "restore it with the pipeline release that wrote it, or start the data afresh"
            )
        body = {key: value for key, value in raw.items() if key != "digest"}
        if raw.get("digest") != digest_of(body):
            raise LedgerError(
                f"{origin}: the data state's digest does not match its content: the file was "
                "damaged or edited; restore an earlier checkpoint"
            )
        step = raw.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise LedgerError(f"{origin}: 'step' must be an integer >= 0, got {step!r}")
        ledger = Ledger.from_json(raw.get("ledger"), origin=f"{origin}: ledger")
        later = [i for i, s in enumerate(ledger.segments) if s.start_step > step]
        if not all(ledger.skips_only(i) for i in later):  # only a skip is scheduled ahead
            raise LedgerError(
                f"{origin}: step {step} is before the ledger's last segment (from step "
                f"{ledger.last.start_step}); restore an earlier checkpoint"
            )
        return cls(step, ledger, origin)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)


def digest_of(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def parse(text: str | bytes, origin: str) -> DataState:
    """A state from its JSON text (a truncated or garbled file is one `LedgerError`)."""
    return DataState.from_json(loads(text, origin), origin)


def loads(text: str | bytes, origin: str) -> Any:
    """The JSON of a state's text, unchecked (`DataState.from_json` checks it)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LedgerError(
            f"{origin}: the data state is not JSON ({error}): the file is truncated or "
            "damaged; restore an earlier checkpoint"
        ) from None


def state_file(path: str | Path) -> Any:
    """`path` itself, or the state file of a checkpoint step directory or its data item: ours
    (`data/data_state.json`) or MaxText's `iter` item (`iter/process_0.json`, ...). A bucket
    that cannot be connected to is one line in seconds (`check_reachable`), not gcsfs's
    retries."""
    check_reachable(path)
    path = location(path)  # a local path or a gs:// checkpoint
    if not path.is_dir():
        return path
    for candidate in (path / ITEM / FILENAME, path / FILENAME):
        if candidate.is_file():
            return candidate
    for item in (path / MAXTEXT_ITEM, path):
        found = maxtext_iter_file(item) if item.is_dir() else None
        if found is not None:
            return found
    raise LedgerError(
        f"{path}: no {ITEM}/{FILENAME} or MaxText {MAXTEXT_ITEM}/process_0.json here (not a "
        "checkpoint step directory)"
    )


def maxtext_iter_file(directory: Any) -> Any | None:
    """The data state file of a MaxText `iter` item directory, None if it has none.

    Every process saves the same state, so one file is enough whatever the number of processes
    now: `process_0.json` (MaxText's shared-state layout), else process 0's
    `process_0-of-<n>.json`, else the lowest-numbered `process_<i>-of-<n>.json`.
    """
    files = [(-1, directory / "process_0.json")]
    if not files[0][1].is_file():
        files = []
    for file in directory.glob("process_*-of-*.json"):
        index = file.name[len("process_") :].split("-of-")[0]
        if index.isdigit():
            files.append((int(index), file))
    return min(files)[1] if files else None


def load(path: str | Path) -> DataState:
    """The state saved at `path`: a `data_state.json`, or a checkpoint step directory."""
    file = state_file(path)
    try:
        text = file.read_bytes()
    except OSError as error:
        raise LedgerError(
            f"{file}: cannot read the data state: {error.strerror or error}"
        ) from None
    return parse(text, str(file))


def load_ledger(path: str | Path) -> Ledger:
    """A run's ledger from its JSON, a saved data state or a checkpoint step directory.

    The last two are what a trainer's Orbax `CheckpointManager` holds, so any checkpoint of a
    run is enough to reproduce every step it trained (the CLI's `--ledger`).
    """
    return load_run(path)[0]


def load_run(path: str | Path) -> tuple[Ledger, int | None]:
    """`load_ledger`, with the step of a data state (None for a bare ledger): the segments
    after it are skips scheduled ahead (`pipeline.plan.skips`)."""
    file = state_file(path)
    try:
        raw = json.loads(file.read_bytes())
    except OSError as error:
        raise LedgerError(f"{file}: cannot read the ledger: {error.strerror or error}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LedgerError(f"{file}: the ledger is not JSON ({error})") from None
    if isinstance(raw, dict) and "ledger" in raw and "segments" not in raw:
        state = DataState.from_json(raw, str(file))
        return state.ledger, state.step
    return Ledger.from_json(raw, origin=str(file)), None


def verify(
    state: DataState,
    plan: DrawPlan,
    checkpoint_step: int | None = None,
    *,
    saved_after_step: bool = False,
) -> None:
    """Refuse a state that disagrees with what can be re-derived, one line per difference.

    * Each segment's start counters: zero for the first, and for every later one what the
      plan gives at its start (`DrawPlan.carried_counters`, as a switch wrote them: from the
      previous segment, or from the last one that held a source left out in between). A past
      segment whose stores are gone is not re-derived (a warning says so).
    * The step, exactly, against the checkpoint step it was saved with, by the trainer's
      convention, which only the trainer knows (the file cannot say it: any field of it can be
      edited and its digest redone). Trainers number a checkpoint either by the steps done
      (`mngr.save(feed.step)` before training step N: it holds data step N; scripts/train.py)
      or by the step just trained (`mngr.save(step)` after training step N, as MaxText and
      Orbax's examples do: it holds data step N + 1, `saved_after_step=True`).

    `plan` must plan `state.ledger` (it opens past segments' stores as needed).
    """
    differences = counter_differences(state.ledger, plan, state.origin)
    expected = None if checkpoint_step is None else checkpoint_step + int(saved_after_step)
    if expected is not None and state.step != expected:
        when = "after" if saved_after_step else "before"
        differences.append(
            f"step: {state.step} recorded in checkpoint {checkpoint_step}, which holds step "
            f"{expected} (saved {when} training step {checkpoint_step}: "
            f"saved_after_step={saved_after_step})"
        )
    refuse(differences, state.origin)


def verify_ledger(ledger: Ledger, plan: DrawPlan, origin: str) -> None:
    """`verify` for a bare ledger (the CLI's `--ledger`): each segment's start counters."""
    refuse(counter_differences(ledger, plan, origin), origin)


def refuse(differences: list[str], origin: str) -> None:
    """One `LedgerError` listing every difference, if there is any."""
    if differences:
        raise LedgerError(
            f"{origin}: the data state disagrees with what its ledger and checkpoint "
            "imply (edited?); restore an earlier checkpoint or the original file:\n  "
            + "\n  ".join(differences)
        )


def counter_differences(ledger: Ledger, plan: DrawPlan, origin: str) -> list[str]:
    """One line per segment start counter that differs from what the plan re-derives."""
    differences = []
    segments = ledger.segments
    for name, counter in segments[0].counters.items():
        if counter != 0:
            differences.append(f"segments[0].counters.{name}: {counter} recorded, 0 re-derived")
    for index in range(1, len(segments)):
        segment = segments[index]
        try:
            expected = plan.carried(
                index - 1,
                segment.start_step + segment.skip,  # what a skip passes over counts as drawn
                segment.fingerprints,
                segment.config["sources"],
            )
        except StoreError as error:  # a past segment's store is gone: nothing to compare
            log.warning("%s: segments[%d].counters not re-derived: %s", origin, index, error)
            continue
        for name, counter in segment.counters.items():
            count, held, at = expected[name]
            if counter != count:
                where = "(no segment before held its store)"
                if held is not None:
                    where = f"from segments[{held}] at step {at}"
                differences.append(
                    f"segments[{index}].counters.{name}: {counter} recorded, {count} re-derived "
                    + where
                )
    return differences
