"""Audit a plan over a range of steps: the guarantees of docs/data-plan.md, checked by brute force.

For every step in the range the audit computes the whole global batch and checks

* windows: per source (name, store content and layout: a switch that changes `seq_len` or
  `lanes` begins another, whose first epoch may be a transitional one, docs/steering.md) and
  lane, no window is drawn twice in one epoch, and every epoch that begins and rolls over
  inside the range drew each of its windows exactly once, the windows a skip inside the range
  passed over (docs/steering.md) counting as drawn;
* across layouts: per source (name, store content) and epoch, whatever layouts drew it (a
  switch in mid-epoch lays the rest out anew), no pair of consecutive tokens of the epoch
  stream is in two served windows (concat: so no token sequence is served twice) and no
  document is in two packed rows (best_fit);
* no padding: every field is [global_batch_size, seq_len], segment ids are never 0 (targets of
  a masked store's untrained tokens excepted), and the targets are the inputs shifted by one;
* whole documents (`packing: best_fit` rows): segments numbered 1, 2, ... then only padding
  (segment 0, position 0), positions restarting per document, targets' segment either the
  input's or 0; and every document of the source used exactly once in each epoch that every
  lane completes inside the range;
* hosts: for each process count, every process computing only its own rows (`host_rows`, with
  a plan object of its own) gets exactly the single-host rows.

`audit` returns an `AuditReport`; it raises nothing for a violation (the report lists them), only
`ConfigError` for process counts the plan cannot serve.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.errors import ConfigError
from pipeline.plan.packing import PackingStats
from pipeline.plan.row_layout import DOCUMENTS
from pipeline.plan.rows import host_rows
from pipeline.plan.transition import window_edges
from pipeline.progress import progress_bar
from pipeline.read.batch import FIELDS
from pipeline.read.plan import Plan
from pipeline.wording import counted

MAX_VIOLATIONS = 1000


@dataclass
class AuditReport:
    start: int
    stop: int
    rows_checked: int = 0
    windows_checked: int = 0  # distinct (source, lane, epoch, window) draws
    epochs_completed: dict[str, int] = field(default_factory=dict)  # on every lane
    epochs_seen: dict[str, list[int]] = field(default_factory=dict)  # [first, last] epoch
    packing: dict[str, PackingStats] = field(default_factory=dict)  # best_fit sources
    document_epochs: dict[str, int] = field(default_factory=dict)  # epochs checked per doc
    process_counts: tuple[int, ...] = ()
    hosts_checked: int = 0
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0

    @property
    def ok(self) -> bool:
        return self.violation_count == 0

    def violate(self, message: str) -> None:
        self.violation_count += 1
        if len(self.violations) < MAX_VIOLATIONS:
            self.violations.append(message)

    def summary(self) -> list[str]:
        lines = [
            f"steps {self.start}..{self.stop - 1}: {counted(self.rows_checked, 'row')}, "
            f"{counted(self.windows_checked, 'distinct window')} checked",
        ]
        for name in sorted(self.epochs_seen):
            first, last = self.epochs_seen[name]
            lines.append(
                f"  {name}: epochs {first}..{last} drawn, "
                f"{self.epochs_completed.get(name, 0)} completed inside the range on every lane"
            )
            if name in self.packing:
                lines.append(
                    f"    {self.packing[name].describe()}; every document once in "
                    f"{counted(self.document_epochs.get(name, 0), 'complete epoch')}"
                )
        counts = ", ".join(map(str, self.process_counts)) or "none"
        lines.append(
            f"hosts: {counted(self.hosts_checked, 'host plan')} checked (process counts {counts}) "
            "against the single-host rows"
        )
        lines.append(
            "ok: no window repeats, nothing served twice in an epoch, no incomplete epoch, "
            "no padding"
            + (" outside whole-document row tails" if self.packing else "")
            + ", hosts agree"
            if self.ok
            else f"FAILED: {counted(self.violation_count, 'violation')}"
        )
        return lines


def default_process_counts(global_batch_size: int, lanes: int) -> tuple[int, ...]:
    """1, 2, 4, ... dividing the batch and dividing, or divided by, the lane count."""
    out, count = [], 1
    while count <= global_batch_size:
        if compatible(count, global_batch_size, lanes):
            out.append(count)
        count *= 2
    return tuple(out)


def compatible(count: int, global_batch_size: int, lanes: int) -> bool:
    return (
        count >= 1 and global_batch_size % count == 0 and (lanes % count == 0 or count % lanes == 0)
    )


def audit(
    plan: Plan,
    start: int,
    stop: int,
    process_counts: Iterable[int] | None = None,
    progress: bool = False,
) -> AuditReport:
    """Check steps [start, stop) of `plan` (see the module docstring)."""
    if not 0 <= start < stop:
        raise ConfigError(f"steps {start}:{stop}: expected 0 <= A < B")
    plan.batch_size(stop - 1)  # refuses a step past the plan's last before a loop counts them
    report = AuditReport(start, stop)
    counts = None if process_counts is None else tuple(process_counts)
    hosts: dict[int, Plan] = {}
    keys: dict[tuple[str, str, tuple[int, ...]], int] = {}
    names: list[str] = []
    stores: list[str] = []  # the store fingerprint of each key
    layouts: list[Any] = []
    # key, lane, epoch, window, step, row in lane, counter, stream start: one entry per row
    columns: list[list[np.ndarray]] = [[] for _ in range(8)]
    used_counts: set[int] = set()
    for step in range(start, stop) if counts else ():  # every count against every size, first
        size, lanes = plan.batch_size(step), plan.segment_plan_at(step).config.lanes
        for count in counts:
            if not compatible(count, size, lanes):
                raise ConfigError(
                    f"--process-count {count}: the plan at step {step} has global_batch_size "
                    f"{size} and {lanes} lanes; a process count must divide the batch (every "
                    "scheduled size) and divide or be divided by the lane count"
                )
    for step in progress_bar(range(start, stop), desc="verify", unit=" step", enabled=progress):
        draws = plan.draws(step)
        batch = plan.read(draws)
        seg = plan.segment_plan(draws.segment_index)
        config = seg.config
        size = seg.batch_size(step)
        report.rows_checked += len(draws.rows)
        kinds = [seg.layouts[name] for name in draws.source_names]
        whole = np.array([k.row_kind == DOCUMENTS for k in kinds])[draws.source]
        masked = np.array([k.meta.masked for k in kinds])[draws.source]
        _check_padding(report, step, batch, size, config.seq_len, whole, masked)
        step_counts = default_process_counts(size, config.lanes) if counts is None else counts
        for count in step_counts:
            host_plan = hosts.setdefault(
                count, Plan(plan.ledger, plan.store_set, exclude_files=plan.exclude_files)
            )
            used_counts.add(count)
            for index in range(count):
                rows = host_rows(size, index, count)
                mine = host_plan.batch(step, rows)
                for name in FIELDS:
                    if not np.array_equal(mine[name], batch[name][rows]):
                        report.violate(
                            f"step {step}: process {index} of {count} computes {name} of rows "
                            f"{rows[0]}..{rows[-1]} differently from the single-host plan"
                        )
                        break
        key = np.empty(len(draws.rows), dtype=np.int64)
        for s in np.unique(draws.source):
            name = draws.source_names[s]
            ident = (name, seg.segment.fingerprints[name], seg.layouts[name].lineage)
            if ident not in keys:
                keys[ident] = len(keys)
                names.append(name)
                stores.append(ident[1])
                layouts.append(seg.layouts[name])
            key[draws.source == s] = keys[ident]
        lane_rows = draws.rows % seg.rows_per_lane(step)
        for column, values in enumerate(
            (
                key,
                draws.lane,
                draws.epoch,
                draws.window,
                np.full_like(key, step),
                lane_rows,
                draws.counter,
                draws.start,
            )
        ):
            columns[column].append(np.asarray(values, dtype=np.int64))
    report.process_counts = tuple(sorted(used_counts))
    report.hosts_checked = sum(used_counts)
    passed = _skipped_counters(plan, start, stop, keys)
    drawn = [np.concatenate(c) for c in columns]
    _check_windows(report, drawn[:7], names, layouts, passed)
    _check_documents(report, drawn, names, layouts)
    _check_served_once(report, drawn, names, stores, layouts)
    return report


def _check_padding(
    report: AuditReport,
    step: int,
    batch: dict[str, np.ndarray],
    rows: int,
    seq_len: int,
    whole: np.ndarray,
    masked: np.ndarray,
) -> None:
    """Windows: no padding, targets shifted; whole-document rows: `_check_whole_rows`."""
    for name in FIELDS:
        if batch[name].shape != (rows, seq_len):
            report.violate(
                f"step {step}: {name} has shape {batch[name].shape}, expected ({rows}, {seq_len})"
            )
            return
    windows = ~whole
    for name, checked in (
        ("inputs_segmentation", windows),
        ("targets_segmentation", windows & ~masked),
    ):
        bad = np.flatnonzero((batch[name] <= 0).any(axis=1) & checked)
        if bad.size:
            report.violate(f"step {step}: {name} has padding (segment id 0) in rows {bad[:8]}")
    moved = (batch["inputs"][:, 1:] != batch["targets"][:, :-1]).any(axis=1)
    shifted = np.flatnonzero(moved & windows)
    if shifted.size:
        report.violate(f"step {step}: targets are not the inputs shifted by one in rows {shifted}")
    if whole.any():
        _check_whole_rows(report, step, {k: v[whole] for k, v in batch.items()}, whole)


def _check_whole_rows(
    report: AuditReport, step: int, batch: dict[str, np.ndarray], whole: np.ndarray
) -> None:
    seg, pos = batch["inputs_segmentation"], batch["inputs_position"]
    before, after = seg[:, :-1], seg[:, 1:]
    numbered = (seg[:, 0] == 1) & ((after == before) | (after == before + 1) | (after == 0)).all(1)
    tail = ~((before == 0) & (after != 0)).any(axis=1)
    steps = np.where(after != before, pos[:, 1:] == 0, pos[:, 1:] == pos[:, :-1] + 1)
    counted = (pos[:, 0] == 0) & (steps | (after == 0)).all(axis=1)
    padding = seg == 0
    quiet = ~(padding & ((pos != 0) | (batch["targets_position"] != 0))).any(axis=1)
    targets = batch["targets_segmentation"]
    masked_only = ((targets == 0) | (targets == seg)).all(axis=1)
    same_pos = (batch["targets_position"] == pos).all(axis=1)
    rows = np.flatnonzero(whole)
    for ok, what in (
        (numbered & tail, "segments are not 1, 2, ... followed only by padding"),
        (counted & quiet & same_pos, "positions do not restart per document"),
        (masked_only, "a target's segment is neither its input's nor 0"),
    ):
        if not ok.all():
            report.violate(f"step {step}: whole-document rows {rows[~ok][:8]}: {what}")


def _check_documents(
    report: AuditReport, columns: list[np.ndarray], names: list[str], layouts: list[Any]
) -> None:
    """Per best_fit source, every epoch that all its lanes complete in the range: each
    document exactly once (through the packed rows drawn)."""
    key, _, epoch, window = columns[:4]
    for k, layout in enumerate(layouts):
        if layout.row_kind != DOCUMENTS:
            continue
        report.packing[names[k]] = layout.stats
        mine = key == k
        for e in np.unique(epoch[mine]).tolist():
            rows = np.unique(window[mine & (epoch == e)])
            every = layout.epoch_rows(e)
            if len(rows) < len(every):
                continue  # not complete in the range
            size = len(layout.doc_tokens)
            counts = np.bincount(layout.documents_of(rows), minlength=size)
            expected = np.zeros_like(counts)
            expected[layout.documents_of(every)] = 1
            if not np.array_equal(counts, expected):
                bad = np.flatnonzero(counts != expected)
                report.violate(
                    f"source {names[k]} epoch {e}: documents {bad[:8].tolist()} are used "
                    f"{counts[bad[:8]].tolist()} times (each is used exactly once per epoch)"
                )
                continue
            report.document_epochs[names[k]] = report.document_epochs.get(names[k], 0) + 1


def _skipped_counters(
    plan: Plan, start: int, stop: int, keys: dict[tuple[str, str, tuple[int, ...]], int]
) -> dict[int, list[tuple[int, int]]]:
    """Per source key, the counter ranges [a, b) that skips at steps in [start, stop) passed
    over: drawn by the plan of the segment before the skip (its sources, whether or not the
    skipping segment keeps them: one left out there carries what was passed over when it comes
    back), served on no lane (the same range on every lane)."""
    passed: dict[int, list[tuple[int, int]]] = {}
    segments = plan.ledger.segments
    for index in range(1, len(segments)):
        segment = segments[index]
        if not segment.skip or not start <= segment.start_step < stop:
            continue
        previous = plan.segment_plan(index - 1)
        before = previous.counters_at(segment.start_step)
        after = previous.counters_at(segment.start_step + segment.skip)
        for name, layout in previous.layouts.items():
            key = keys.get((name, previous.segment.fingerprints[name], layout.lineage))
            if key is not None and after[name] > before[name]:
                passed.setdefault(key, []).append((before[name], after[name]))
    return passed


def _check_windows(
    report: AuditReport,
    columns: list[np.ndarray],
    names: list[str],
    layouts: list[Any],
    passed: dict[int, list[tuple[int, int]]],
) -> None:
    order = np.lexsort(tuple(reversed(columns[:6])))  # by key, lane, epoch, window, step, row
    key, lane, epoch, window, step, row, counter = (c[order] for c in columns)
    same_window = (
        (key[1:] == key[:-1])
        & (lane[1:] == lane[:-1])
        & (epoch[1:] == epoch[:-1])
        & (window[1:] == window[:-1])
    )
    report.windows_checked = int(len(key) - same_window.sum())
    for i in np.flatnonzero(same_window):
        if i > 0 and same_window[i - 1]:
            continue  # the same repeat, already reported at its first pair
        report.violate(
            f"source {names[key[i]]} lane {lane[i]} epoch {epoch[i]}: window {window[i]} used "
            f"again at step {step[i + 1]} (row {row[i + 1]} of the lane) after step {step[i]} "
            f"(row {row[i]}): a window is used at most once per epoch"
        )
    # epochs that begin and roll over inside the range must hold every window exactly once
    group_start = np.flatnonzero(
        np.concatenate(
            [[True], (key[1:] != key[:-1]) | (lane[1:] != lane[:-1]) | (epoch[1:] != epoch[:-1])]
        )
    )
    bounds = np.append(group_start, len(key))
    last_epoch: dict[tuple[int, int], int] = {}
    for g in group_start:
        ident = (int(key[g]), int(lane[g]))
        last_epoch[ident] = max(last_epoch.get(ident, -1), int(epoch[g]))
    complete: dict[tuple[int, int], list[int]] = {}  # (key, epoch) -> lanes completed
    for lo, hi in itertools.pairwise(bounds):
        k, ln, e = int(key[lo]), int(lane[lo]), int(epoch[lo])
        name = names[k]
        seen = report.epochs_seen.setdefault(name, [e, e])
        seen[0], seen[1] = min(seen[0], e), max(seen[1], e)
        windows = layouts[k].epoch_windows(e)
        first = layouts[k].epoch_start(e)
        end = first + windows
        skips = passed.get(k, [])
        begun = np.any(counter[lo:hi] == first) or any(a <= first < b for a, b in skips)
        if not begun or last_epoch[(k, ln)] <= e:
            continue
        distinct = np.unique(window[lo:hi])
        skipped = sum(max(0, min(b, end) - max(a, first)) for a, b in skips)
        if len(distinct) + skipped != windows:
            report.violate(
                f"source {name} lane {ln} epoch {e}: rolled over after drawing "
                f"{len(distinct)} of its {windows} windows"
                + (f" and skipping {skipped}" if skipped else "")
                + " (an epoch uses every window exactly once)"
            )
            continue
        complete.setdefault((k, e), []).append(ln)
    lanes = {int(k): len(np.unique(lane[key == k])) for k in np.unique(key)}
    for (k, _), done in complete.items():
        if len(done) == lanes[k]:
            report.epochs_completed[names[k]] = report.epochs_completed.get(names[k], 0) + 1


def _check_served_once(
    report: AuditReport,
    columns: list[np.ndarray],
    names: list[str],
    stores: list[str],
    layouts: list[Any],
) -> None:
    """Per source (name, store content) and epoch, over every layout that drew it: no edge of
    the epoch stream in two windows, no document in two packed rows. Each distinct drawn row
    counts once (a row drawn twice is `_check_windows`' report), as [lo, hi) pieces: a
    window's edges (`transition.window_edges`), a document d as [d, d + 1)."""
    key, lane, epoch, window, step, _, _, start = columns
    pieces: dict[tuple[str, str, str, int], list[tuple[np.ndarray, ...]]] = {}
    for k, layout in enumerate(layouts):
        mine = key == k
        for e in np.unique(epoch[mine]).tolist():
            rows = np.flatnonzero(mine & (epoch == e))
            rows = rows[
                np.unique(np.stack([lane[rows], window[rows]]), axis=1, return_index=True)[1]
            ]
            if layout.row_kind == DOCUMENTS:
                documents = layout.documents_of(window[rows])
                sizes = layout.row_offsets[window[rows] + 1] - layout.row_offsets[window[rows]]
                found = (documents, documents + 1, np.repeat(step[rows], sizes))
            else:
                owner, lo, hi = window_edges(layout, e, start[rows])
                found = (lo, hi, step[rows][owner])
            pieces.setdefault((names[k], stores[k], layout.row_kind, e), []).append(found)
    for (name, _, kind, e), found in pieces.items():
        lo, hi, steps = (np.concatenate(parts) for parts in zip(*found))
        order = np.argsort(lo, kind="stable")
        lo, hi, steps = lo[order], hi[order], steps[order]
        reach = np.maximum.accumulate(hi)
        # the piece that reaches furthest so far: the latest whose end is the running reach
        holder = np.maximum.accumulate(np.where(hi == reach, np.arange(hi.size), 0))
        for i in (np.flatnonzero(lo[1:] < reach[:-1]) + 1).tolist():
            when = " and ".join(map(str, sorted({int(steps[holder[i - 1]]), int(steps[i])})))
            what = (
                f"document {lo[i]} is in rows of steps {when}"
                if kind == DOCUMENTS
                else f"tokens {lo[i]}..{min(hi[i], reach[i - 1])} of its epoch stream are in "
                f"windows of steps {when}"
            )
            report.violate(
                f"source {name} epoch {e}: {what} (nothing is served twice in an epoch, across "
                "switches too)"
            )
