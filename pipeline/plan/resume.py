"""Reconciling a restored ledger with the data config a job was started with.

* Same data order (fingerprints equal): keep the ledger. Moving stores, or changing feed options
  or grad_accum, is not a change of data.
* Different and no switch declared: refuse with a readable diff.
* Different and a switch declared: append a segment at the restored step that carries each
  surviving source's counter (same name, same store), so no window drawn before the switch is
  drawn again in its epoch and none is skipped. The new config's stages, schedules and batch
  schedule count from the run's step 0 (`starts_at: run`, the default: the config describes
  the whole run and the run continues wherever it places the switch step) or from the switch
  step (`starts_at: switch`: a new curriculum that begins now).
"""

from __future__ import annotations

import logging

from pipeline.config import DataConfig
from pipeline.errors import LedgerError
from pipeline.plan.ledger import (
    Ledger,
    Segment,
    config_mapping,
    data_order,
    describe_diff,
    fingerprint_of,
)
from pipeline.plan.plan import Plan, SegmentPlan
from pipeline.plan.sources import load_metas

log = logging.getLogger("pipeline")

FIXED_IN_A_RUN = ("lanes", "seed", "seq_len")


def reconcile(
    plan: Plan,
    config: DataConfig,
    step: int,
    switch: bool = False,
    switch_flag: str = "reconcile(..., switch=True)",
) -> Ledger:
    """The ledger to continue with at `step` under `config` (see module docstring).

    `switch_flag` is how the caller's user declares a switch (a trainer flag, a MaxText key, a
    library argument): the refusal names it, so the fix it gives is the one that works there.
    """
    metas = load_metas(config)
    fingerprints = {name: meta.fingerprint for name, meta in metas.items()}
    mapping = config_mapping(config)
    order = data_order(mapping, fingerprints)
    ledger = plan.ledger
    last = ledger.last
    if fingerprint_of(order) == fingerprint_of(last.order):
        return ledger
    diff = describe_diff(last.order, order)
    if not switch:
        raise LedgerError(
            f"{config.origin}: the data config differs from the checkpoint's (ledger segment "
            f"{len(ledger.segments) - 1}, since step {last.start_step}); declare the switch "
            f"with {switch_flag} to switch at step {step}, or restore the original config:\n  "
            + "\n  ".join(diff)
        )
    for key in FIXED_IN_A_RUN:
        if mapping[key] != last.config[key]:
            raise LedgerError(
                f"{config.origin}: {key} cannot change within a run ({last.config[key]} -> "
                f"{mapping[key]}); start a new run instead"
            )
    if step < last.start_step:
        raise LedgerError(
            f"cannot switch at step {step}: the ledger's last segment starts at step "
            f"{last.start_step}"
        )
    kept = ledger.segments if step > last.start_step else ledger.segments[:-1]
    if kept:  # a switch at a segment's first step replaces that segment, which drew nothing
        counters = plan.carried_counters(len(kept) - 1, step, fingerprints, mapping["sources"])
    else:
        counters = dict.fromkeys(config.source_names, 0)
    anchor = 0 if config.starts_at == "run" else step
    segment = Segment(step, mapping, fingerprints, counters, anchor)
    SegmentPlan(segment, config, metas)  # lays the switch out now: a config error names the file
    switched = Ledger(kept).append(segment)
    changed = sorted({line.split(":")[0].split(".")[0].split("[")[0] for line in diff})
    log.info(
        "ledger switch at step %d: %s changed; carried counters %s; stages laid out from step "
        "%d (starts_at: %s)",
        step,
        ", ".join(changed),
        counters,
        anchor,
        config.starts_at,
    )
    return switched
