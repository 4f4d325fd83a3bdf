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
* A skip (`skip=N`, docs/steering.md), alone or with a switch: append a segment at the
  restored step s that serves plan step s + N there (and so on), carrying each source's counter
  as the previous segment had it at that plan step, so what is skipped counts as drawn. With a
  switch, the skip passes over the old config's steps, then the new config takes over
  (`starts_at: switch` lays it out from the restored step). A restore at the step where the
  ledger's last segment starts replaces that segment (it drew nothing): its skip and the new
  one add up, both passing over the segment before it.
* A skip at a named step (`skip_at=S`, `pipeline.plan.skips`): made at S once, however often
  the restore is repeated; restored before S, a segment that skips is scheduled at S (segments
  after the restored step are such skips: each restore keeps them, laid out after it).
"""

from __future__ import annotations

import logging

from pipeline.config import DataConfig
from pipeline.errors import LedgerError
from pipeline.plan import skips
from pipeline.plan.ledger import (
    Ledger,
    Segment,
    config_mapping,
    data_order,
    describe_diff,
    fingerprint_of,
)
from pipeline.plan.plan import DrawPlan, SegmentPlan
from pipeline.plan.skips import Skip
from pipeline.plan.sources import load_metas

log = logging.getLogger("pipeline")

FIXED_IN_A_RUN = ("seed",)


def reconcile(
    plan: DrawPlan,
    config: DataConfig,
    step: int,
    switch: bool = False,
    switch_flag: str = "reconcile(..., switch=True)",
    skip: int = 0,
    skip_at: int | None = None,
    events: list[str] | None = None,
) -> Ledger:
    """The ledger to continue with at `step` under `config` (see module docstring).

    `switch_flag` is how the caller's user declares a switch (a trainer flag, a MaxText key, a
    library argument): the refusal names it, so the fix it gives is the one that works there.
    `skip`: steps of data to pass over, from `step` on, or from `skip_at` on (`skips`: once
    in the run, however often the request is repeated). The skips the ledger holds scheduled
    after `step` stay scheduled, laid out again after whatever this restore changes.
    `events`: where the one-line events go (the switch, a skip made, scheduled or held
    already), for a caller that logs them once its whole restore succeeded (a model state
    restored after the data state may still fail: `DataFeed.adopt`); None: logged now.
    """
    said: list[str] = []
    request = Skip.of(skip, skip_at)
    now, future = skips.resolve(plan.ledger, step, request, said)
    past = plan.ledger.until(step)
    base = plan if past is plan.ledger else plan.with_ledger(past)  # its layouts, if it can
    ledger = _reconcile(base, config, step, switch, switch_flag, now, request.at is None, said)
    if ledger is past and future == skips.scheduled(plan.ledger, step):
        ledger = plan.ledger  # nothing changed: the ledger as restored
    else:
        for at, steps in sorted(future.items()):
            ledger = _reconcile(
                plan.with_ledger(ledger), config, at, False, switch_flag, steps, False, said
            )
    if events is None:
        for line in said:
            log.info("%s", line)
    else:
        events.extend(said)
    return ledger


def _reconcile(
    plan: DrawPlan,
    config: DataConfig,
    step: int,
    switch: bool,
    switch_flag: str,
    skip: int,
    add_up: bool,
    events: list[str],
) -> Ledger:
    """`reconcile` of a ledger without segments after `step`, skipping `skip` steps there;
    `add_up`: a skip at a segment's first step adds to that segment's (a bare skip), else
    replaces it (a skip at a named step: one skip there, whatever was asked before). The
    switch or skip it makes is one line of `events`."""
    metas = load_metas(config)
    fingerprints = {name: meta.fingerprint for name, meta in metas.items()}
    mapping = config_mapping(config)
    order = data_order(mapping, fingerprints)
    ledger = plan.ledger
    last = ledger.last
    same = fingerprint_of(order) == fingerprint_of(last.order)
    if same and not skip:
        return ledger
    paths = tuple(
        {name: entry["path"] for name, entry in sources.items()}
        for sources in (last.config["sources"], mapping["sources"])
    )
    diff = describe_diff(last.order, order, paths)
    if not same and not switch:
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
            f"cannot {'switch' if not same else 'skip'} at step {step}: the ledger's last "
            f"segment starts at step {last.start_step}"
        )
    replaced = step == last.start_step  # a segment's first step: it drew nothing, replace it
    kept = ledger.segments[:-1] if replaced else ledger.segments
    skip += last.skip if replaced and add_up else 0
    if skip and not kept:
        raise LedgerError(
            f"cannot skip data at step {step}: nothing was trained before it; start the run "
            "with the data it should see instead"
        )
    if kept:
        counters = plan.without_mixes_from(step).carried_counters(
            len(kept) - 1, step + skip, fingerprints, mapping["sources"]
        )
    else:
        counters = dict.fromkeys(config.source_names, 0)
    base = Ledger(kept) if kept else None
    shift = (base.shift(len(kept) - 1) if base else 0) + skip
    if base is not None and fingerprint_of(order) == fingerprint_of(base.last.order):
        anchor = base.last.stages_from  # the same plan, passed over: its layout continues
    else:
        anchor = 0 if config.starts_at == "run" else step + shift
    segment = Segment(step, mapping, fingerprints, counters, anchor, skip)
    # lays the new segment out now: a config error names the file
    SegmentPlan(segment, config, metas, shift=shift)
    # mixes and objectives set before the step stay
    steered = Ledger(kept, ledger.mixes, ledger.objectives).append(segment)
    changed = sorted({line.split(":")[0].split(".")[0].split("[")[0] for line in diff})
    what = [f"{', '.join(changed)} changed"] if changed else []
    what += [f"skips {skip} steps (serves plan step {step + shift})"] if skip else []
    events.append(
        f"ledger {'switch' if changed else 'skip'} at step {step}: {'; '.join(what)}; carried "
        f"counters {counters}; stages laid out from plan step {anchor} (starts_at: "
        f"{config.starts_at})"
    )
    return steered
