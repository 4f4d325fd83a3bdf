"""Plan commands: `inspect`, `dump`, `verify`, `epochs`, `stages`, `plot`.

Each takes a data config and optionally `--ledger FILE` (a saved `Ledger`): with a ledger the
plan is the ledger's, so any past step of a run that switched configs is reproduced exactly
(the config's stores are offered too, so a ledger whose stores moved still opens them).
"""

from __future__ import annotations

import argparse
import re
from functools import lru_cache
from pathlib import Path

import numpy as np

from pipeline.commands.summary import decode_preview
from pipeline.config import DataConfig, load_config
from pipeline.config.parse import PROVENANCE
from pipeline.errors import ConfigError, LedgerError
from pipeline.extras import require
from pipeline.plan import data_state, skips
from pipeline.plan.draws import Draws
from pipeline.plan.ledger import config_mapping, data_order, fingerprint_of
from pipeline.plan.packing import PackedLayout
from pipeline.plan.report import epoch_table, stage_rows
from pipeline.plan.row_layout import DOCUMENTS
from pipeline.plan.rows import host_rows
from pipeline.plan.sources import keyed, open_stores
from pipeline.read import objective
from pipeline.read.audit import audit
from pipeline.read.batch import FIELDS
from pipeline.read.eval_plan import check_eval
from pipeline.read.plan import Plan
from pipeline.store.meta import StoreFacts
from pipeline.urls import location
from pipeline.wording import counted

MAX_PRINTED_VIOLATIONS = 50


def register(commands: argparse._SubParsersAction) -> None:
    i = commands.add_parser(
        "inspect", help="which documents are in the rows of a step", description=_doc(
            "Show, for rows of one step: lane, stage, source, epoch, counter, window, and the "
            "shard records and token ranges of the documents in the window, with a preview; "
            "for a best_fit source, the row's whole documents and their trained spans; the "
            "documents' ids where the store records them (prepare --id-field/--record-ids)."
        ),
    )  # fmt: skip
    _common(i)
    i.add_argument("--step", type=_nonnegative, required=True, help="the step to show")
    i.add_argument("--rows", type=_row_list, help="rows, e.g. 0,3,5-7 (default: all)")
    i.add_argument("--preview", type=int, default=60, help="characters of decoded preview")
    i.set_defaults(run=run_inspect)

    d = commands.add_parser(
        "dump", help="save one host's rows of a range of steps (.npz)", description=_doc(
            "Write the six batch fields of one host's rows, [steps, rows, seq_len] each, and "
            "each row's provenance: source (index into the file's source_names), epoch and "
            "window, [steps, rows] each; with an objective: loss_weights, [steps, rows, seq_len]."
        ),
    )  # fmt: skip
    _common(d)
    d.add_argument("--steps", type=_step_range, required=True, help="A:B (B exclusive)")
    d.add_argument(
        "--process-index", type=_nonnegative, default=0, help="the host whose rows (default 0)"
    )
    d.add_argument(
        "--process-count", type=_positive, default=1, help="hosts in the run (default 1)"
    )
    d.add_argument("--out", type=Path, required=True, help="FILE.npz")
    d.set_defaults(run=run_dump)

    v = commands.add_parser(
        "verify", help="audit a range of steps: windows, epochs, padding, hosts",
        description=_doc(
            "Check that per source and lane no window repeats in an epoch, epochs that roll over "
            "in the range are complete, there is no padding (best_fit sources: whole documents, "
            "padding only at row tails, each document once per epoch), and every host's rows "
            "equal the single-host rows. Exit 1 on a violation."
        ),
    )  # fmt: skip
    _common(v)
    v.add_argument("--steps", type=_step_range, required=True, help="A:B (B exclusive)")
    v.add_argument(
        "--process-count",
        type=_positive,
        action="append",
        help="process counts to check (repeatable; default 1, 2, 4, ... that fit)",
    )
    v.add_argument("--no-progress", action="store_true", help="no progress bar")
    v.set_defaults(run=run_verify)

    e = commands.add_parser(
        "epochs", help="rows per lane per epoch and the steps epochs roll over",
        description=_doc(
            "For each source: its layout (windows or packed rows per lane per epoch, tokens "
            "left in lane tails, padding of best_fit rows), and the steps where its first "
            "epochs start and end on lane 0."
        ),
    )  # fmt: skip
    _common(e)
    e.add_argument("--count", type=_positive, default=3, help="epochs to locate per source")
    e.set_defaults(run=run_epochs)

    s = commands.add_parser(
        "stages", help="each stage's start and end step and its mix",
        description=_doc(
            "List each stage of the config: where it starts and ends (steps, or rows of a lane "
            "for an epochized blend) and its mix; with --ledger, also each ledger entry "
            "(switch, geometry change, take-down, skip, set_mix) and the step it takes effect at."
        ),
    )  # fmt: skip
    _common(s)
    s.set_defaults(run=run_stages)

    p = commands.add_parser(
        "plot", help="plot target and realised source shares per step",
        description=_doc(
            "Draw each source's target share (the schedule, or the weights set_mix set) and its "
            "realised share of the rows of each step in the range, into a PNG (needs the plot "
            "extra)."
        ),
    )  # fmt: skip
    _common(p)
    p.add_argument("--steps", type=_step_range, required=True, help="A:B (B exclusive)")
    p.add_argument("--out", type=Path, required=True, help="FILE.png")
    p.add_argument("--title", help="plot title")
    p.set_defaults(run=run_plot)


def _doc(text: str) -> str:
    return text + " With --ledger, the plan is the saved ledger's (every segment of a run)."


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=location, metavar="CONFIG", help="data config (YAML)")
    parser.add_argument(
        "--ledger",
        type=location,
        help="a run's ledger: its JSON, a data_state.json, or a checkpoint step directory",
    )


def _at_least(minimum: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def _nonnegative(text: str) -> int:
    return _at_least(0, text)


def _positive(text: str) -> int:
    return _at_least(1, text)


def _step_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match or int(match[1]) >= int(match[2]):
        raise argparse.ArgumentTypeError(f"expected A:B with 0 <= A < B, got {text!r}")
    return int(match[1]), int(match[2])


def _row_list(text: str) -> list[int]:
    rows: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise argparse.ArgumentTypeError(f"expected rows like 0,3,5-7, got {text!r}")
        lo, hi = int(match[1]), int(match[2] or match[1])
        if hi < lo:
            raise argparse.ArgumentTypeError(f"row range {part!r} is empty")
        rows.extend(range(lo, hi + 1))
    return rows


def load_plan(config_path: Path, ledger_path: Path | None) -> Plan:
    """The plan of a config, or of a saved ledger (offered the config's stores)."""
    config = load_config(config_path)
    check_eval(config)
    if ledger_path is None:
        return Plan.from_config(config)
    stores = open_stores(config)
    ledger, step = data_state.load_run(ledger_path)
    plan = Plan(
        ledger, stores.values(),
        check_reads=config.feed.check_reads, exclude_files=config.exclude_files,
    )  # fmt: skip
    data_state.verify_ledger(plan.ledger, plan, str(ledger_path))
    for at, skip in (skips.scheduled(ledger, step) if step is not None else {}).items():
        print(
            f"scheduled: skip {skip} steps at step {at:,} (the checkpoint holds step {step:,}; "
            f"the run serves steps {step:,}..{at - 1:,} as planned, then passes over {skip})"
        )
    fingerprints = {name: store.fingerprint for name, store in stores.items()}
    order = fingerprint_of(data_order(config_mapping(config), fingerprints))
    segments = plan.ledger.segments
    if all(fingerprint_of(segment.order) != order for segment in segments):
        for index in range(len(segments)):  # an exclude file edited since it was recorded
            plan.ledger.parsed(index, plan.exclude_files)
        # the plan is the ledger's: a config of another run would label its output unnoticed
        raise LedgerError(
            f"{config.origin}: this data config is none of the "
            f"{counted(len(segments), 'segment')} of the ledger {ledger_path} (another run's "
            "ledger?); with --ledger, give the config of one of its segments (the run's first "
            "config, or one it switched to)"
        )
    return plan


def run_inspect(args: argparse.Namespace) -> int:
    plan = load_plan(args.config, args.ledger)
    config = plan.segment_plan_at(args.step).config
    batch = plan.batch_size(args.step)
    rows = list(range(batch)) if args.rows is None else args.rows
    bad = [r for r in rows if r >= batch]
    if bad:
        raise ConfigError(f"--rows: row {bad[0]} is outside the batch (rows 0..{batch - 1})")
    draws = plan.draws(args.step, rows)
    seg = plan.segment_plan(draws.segment_index)
    summary = draws.summary()
    print(
        f"step {args.step}: ledger segment {draws.segment_index} (from step "
        f"{seg.segment.start_step}), {counted(batch, 'row')} x seq_len {config.seq_len}, "
        f"{counted(config.lanes, 'lane')} of {counted(batch // config.lanes, 'row')}\n"
        f"these rows: stage {summary.stage_label}; epochs {summary.epochs_label}"
    )
    header = f"{'row':>5} {'lane':>4}  {'stage':<14} {'source':<10} {'epoch':>5} "
    header += f"{'counter':>9} {'window':>7}  documents"
    print(header)
    print("-" * len(header))
    for i, row in enumerate(rows):
        # a store's error names its source by its config key, as at open
        with keyed(config, draws.source_names[draws.source[i]]):
            _print_row(plan, draws, i, row, args.preview)
    return 0


def _print_row(plan: Plan, draws: Draws, i: int, row: int, preview: int) -> None:
    """Row `row` (the `i`th drawn): its lane, stage, source, epoch, counter and window, then
    where its tokens are (shard records, or a packed row's documents), with a preview."""
    seg = plan.segment_plan(draws.segment_index)
    config = seg.config
    name = draws.source_names[draws.source[i]]
    layout = seg.layouts[name]
    store = plan.store(layout.meta)
    epoch, start = int(draws.epoch[i]), int(draws.start[i])
    if layout.row_kind == DOCUMENTS:
        print(
            f"{row:>5} {int(draws.lane[i]):>4}  {draws.stage_names[draws.stage[i]]:<14} "
            f"{name:<10} {epoch:>5} {int(draws.counter[i]):>9,} {int(draws.window[i]):>7}  "
            f"packed row {int(draws.window[i]):,}"
        )
        _print_packed_row(layout, int(draws.window[i]), preview)
        return
    print(
        f"{row:>5} {int(draws.lane[i]):>4}  {draws.stage_names[draws.stage[i]]:<14} {name:<10} "
        f"{epoch:>5} {int(draws.counter[i]):>9,} {int(draws.window[i]):>7}  "
        f"stream tokens {start:,}..{start + config.seq_len + 1:,}"
    )
    for shard, lo, hi in layout.pieces(epoch, start, start + config.seq_len + 1):
        offsets = store.record_offsets(shard)
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        last = int(np.searchsorted(offsets, hi, side="left")) - 1
        tokens = store.read_shard_tokens(shard, lo, hi).tokens
        text = decode_preview(store, tokens, limit=preview)
        text = text.replace("\n", "⏎").replace("\t", " ")
        records = f"record {first}" if first == last else f"records {first}..{last}"
        print(
            f"{'':>44}{store.shard_file(shard).name}  {records}  tokens {lo:,}..{hi:,}"
            f"{_ids_line(store, shard, lo, hi)}\n{'':>44}  {text!r}"
        )


def _ids_line(store: StoreFacts, shard: int, lo: int, hi: int) -> str:
    """The ids of the documents with tokens in [lo, hi) of a shard, as inspect prints them
    ("" for a store without ids)."""
    if not store.has_ids:
        return ""
    offsets = store.doc_offsets(shard)  # type: ignore[attr-defined]
    first = int(np.searchsorted(offsets, lo, side="right")) - 1
    last = int(np.searchsorted(offsets, hi, side="left")) - 1
    ids = _shard_ids(store, shard)[first : last + 1]
    return f"\n{'':>44}  id{'s' if len(ids) > 1 else ''} {', '.join(map(repr, ids))}"


@lru_cache(maxsize=4)
def _shard_ids(store: StoreFacts, shard: int) -> list[str]:
    """A shard's ids, read once per inspect (a row's pieces often share a shard)."""
    return store.document_ids(shard)


def _print_packed_row(layout: PackedLayout, row: int, preview: int) -> None:
    """Each whole document of a packed row: where it is, its trained spans, a preview."""
    store, used = layout.store, 0
    for document in layout.documents(row).tolist():
        shard, index = layout.locate(document)
        start = int(layout.doc_start[document])
        tokens = int(layout.doc_tokens[document])
        used += tokens - 1
        spans = trained_spans(store.trained(shard, start, start + tokens))
        cut = " (truncated)" if tokens < int(store.doc_offsets(shard)[index + 1]) - start else ""
        text = decode_preview(store, store.document(shard, index)[:tokens], limit=preview)
        text = text.replace("\n", "⏎").replace("\t", " ")
        ids = _ids_line(store, shard, start, start + 1)
        print(
            f"{'':>44}{store.shard_file(shard).name}  document {index}  "
            f"{counted(tokens, 'token')}{cut}  trained {spans}{ids}\n{'':>44}  {text!r}"
        )
    print(f"{'':>44}padding: {layout.seq_len - used:,} of {layout.seq_len:,} target slots")


def trained_spans(trained: np.ndarray) -> str:
    """`0..12, 30..41` (document token ranges that carry loss), `all` or `none`."""
    if trained.all():
        return "all"
    edges = np.flatnonzero(np.diff(np.concatenate([[False], trained, [False]]).astype(np.int8)))
    spans = [f"{a}..{b}" for a, b in zip(edges[::2].tolist(), edges[1::2].tolist())]
    return ", ".join(spans) or "none"


def run_dump(args: argparse.Namespace) -> int:
    plan = load_plan(args.config, args.ledger)
    first, stop = args.steps
    if args.process_index >= args.process_count:
        raise ConfigError(
            f"--process-index {args.process_index} is not below --process-count "
            f"{args.process_count}"
        )
    sizes = {plan.batch_size(step) for step in range(first, stop)}
    if len(sizes) != 1:
        raise ConfigError(
            f"--steps {first}:{stop} spans steps with different global batch sizes "
            f"{sorted(sizes)}; dump the steps of each batch size separately"
        )
    rows = host_rows(sizes.pop(), args.process_index, args.process_count)
    segments = range(plan.ledger.segment_index(first), plan.ledger.segment_index(stop - 1) + 1)
    changes = [  # the fields of a step are [rows, seq_len]: steps of two would not stack
        f"{before.config['seq_len']} -> {after.config['seq_len']} at step {after.start_step:,}"
        for before, after in (plan.ledger.segments[i - 1 : i + 1] for i in segments[1:])
        if before.config["seq_len"] != after.config["seq_len"]
    ]
    if changes:
        raise ConfigError(
            f"--steps {first}:{stop} spans a change of seq_len ({'; '.join(changes)}); dump "
            "the steps of each seq_len separately"
        )
    names = sorted({n for i in segments for n in plan.segment_plan(i).config.source_names})
    weighted = any(plan.segment_plan(i).objectives is not None for i in segments)
    extra = ("loss_weights",) if weighted else ()
    stacked: dict[str, list[np.ndarray]] = {n: [] for n in (*FIELDS, *extra, *PROVENANCE)}
    for step in range(first, stop):
        draws = plan.draws(step, rows)
        batch = {**plan.read(draws), **draws.provenance()}
        batch["source"] = np.searchsorted(names, np.asarray(draws.source_names))[draws.source]
        if weighted:  # the whole step's weights (their totals span every row), this host's rows
            whole = objective.step_weights(plan, step)
            trained = (batch["targets_segmentation"] != 0).astype(np.float32)
            batch["loss_weights"] = trained if whole is None else whole[rows]
        for name, values in stacked.items():
            values.append(batch[name])
    arrays = {name: np.stack(values) for name, values in stacked.items()}
    # NumPy adds .npz to a name without it: name the file that is written
    out = args.out if args.out.suffix == ".npz" else args.out.with_name(f"{args.out.name}.npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out, steps=np.arange(first, stop), rows=rows, source_names=np.array(names), **arrays
    )
    shape = arrays["inputs"].shape
    print(
        f"wrote {out}: steps {first}..{stop - 1}, rows {rows[0]}..{rows[-1]} "
        f"(process {args.process_index} of {args.process_count}), fields {shape} each, "
        f"{'loss_weights ' + str(shape) + ', ' if weighted else ''}"
        f"provenance source/epoch/window {shape[:2]} each"
    )
    return 0


def run_verify(args: argparse.Namespace) -> int:
    plan = load_plan(args.config, args.ledger)
    first, stop = args.steps
    report = audit(plan, first, stop, args.process_count, progress=not args.no_progress)
    for line in report.summary():
        print(line)
    if report.ok:
        return 0
    for line in report.violations[:MAX_PRINTED_VIOLATIONS]:
        print(f"violation: {line}")
    if report.violation_count > MAX_PRINTED_VIOLATIONS:
        print(
            f"... and {counted(report.violation_count - MAX_PRINTED_VIOLATIONS, 'more violation')}"
        )
    return 1


def run_epochs(args: argparse.Namespace) -> int:
    plan = load_plan(args.config, args.ledger)
    table = epoch_table(plan, args.count)
    many = len(plan.ledger.segments) > 1
    print(
        f"{'segment  ' if many else ''}{'source':<10} {'rows/lane':>12} {'lanes':>5} "
        f"{'tokens/epoch':>14} {'store tokens':>14}  epoch starts (step, row in lane)"
    )
    for info in table:
        starts = []
        for epoch, where in info.rollovers:
            starts.append(f"{epoch}: never" if where is None else f"{epoch}: {where[0]:,}")
            if where is not None and where[1]:
                starts[-1] += f" r{where[1]}"
        print(
            f"{f'{info.segment_index:>7}  ' if many else ''}{info.name:<10} "
            f"{info.rows_per_lane:>12,} {info.lanes:>5} {info.tokens_per_epoch:>14,} "
            f"{info.store_tokens:>14,}  {'; '.join(starts)}"
        )
        if info.packing is not None:
            print(f"{'':>{9 if many else 0}}{'':<10} {info.packing.describe()}")
        if info.transition is not None:
            epoch, rows = info.transition
            print(
                f"{'':>{9 if many else 0}}{'':<10} epoch {epoch} goes on from the switch: "
                f"{rows:,} rows per lane laid out anew from what it had not served"
            )
    return 0


def run_stages(args: argparse.Namespace) -> int:
    plan = load_plan(args.config, args.ledger)
    rows = stage_rows(plan)
    print(
        f"{'seg':>3} {'stage':<14} {'start step':>12} {'end step':>16}  {'kind':<11} mix / epochs"
    )
    for index, segment in enumerate(plan.ledger.segments):
        seg = plan.segment_plan(index)
        config = seg.config
        anchoring = ""
        if index:
            # after a skip the stages count from a plan step, which no served step may hold
            # (plan step 0 of a run that skipped 10 is "served step -10"): name the plan step
            shift = plan.ledger.shift(index)
            at = "run" if segment.stages_from == 0 else "switch"
            anchoring = (
                f"; stages from plan step {segment.stages_from:,} (served step t is plan step "
                f"t + {shift:,}; starts_at: {at})"
                if shift
                else f"; stages from step {seg.anchor:,} (starts_at: {at})"
            )
        print(
            f"{index:>3} ledger segment from step {segment.start_step:,}: "
            f"{plan.ledger.entry(index)}; "
            f"{', '.join(config.source_names)}; {describe_batch(config)}{anchoring}; "
            "counters at start "
            + ", ".join(f"{k}={v:,}" for k, v in sorted(segment.counters.items()))
        )
        for row in (r for r in rows if r.segment_index == index):
            start = f"{row.start_step:,}" + (f" r{row.start_row}" if row.start_row else "")
            if row.joined_at is not None:
                start = f"{row.joined_at:,} ({start})"
            if row.end_step is None:
                end = "open"
            else:
                end = f"{row.end_step:,}"
                if row.end_row != seg.rows_per_lane(row.end_step):
                    end += f" r{row.end_row}"
            if row.superseded_at is not None and (
                row.end_step is None or row.end_step >= row.superseded_at
            ):
                end = f"({row.superseded_at - 1:,}) switched"
            print(f"{'':>3} {row.name:<14} {start:>12} {end:>16}  {row.kind:<11} {row.mix}")
        mixes = plan.ledger.mixes_of(index)
        if mixes:
            last = dict(mixes[-1].weights)
            shares = ", ".join(f"{n} {w / sum(last.values()):.3f}" for n, w in last.items())
            print(
                f"{'':>3} set_mix: {counted(len(mixes), 'call')}, steps {mixes[0].step:,}.."
                f"{mixes[-1].step:,}; the last from step {mixes[-1].step:,}: {shares}"
            )
    print(
        "end step = the step holding the stage's last row; 'rN' = the stage ends after N rows "
        "of each lane (or starts at row N); 'S (T)' = the run joined at switch step S a stage "
        "that its config starts at T"
    )
    return 0


def describe_batch(config: DataConfig) -> str:
    """`batch 16, 4 rows per lane`, or the schedule: `batch 8 from step 0, 16 from step 50`."""
    if not config.batch_is_scheduled:
        batch = config.global_batch_size
        return f"batch {batch}, {counted(batch // config.lanes, 'row')} per lane"
    steps = ", ".join(f"{size} from step {step:,}" for step, size in config.batch_sizes)
    return f"batch {steps} ({counted(config.lanes, 'lane')})"


def run_plot(args: argparse.Namespace) -> int:
    from pipeline.commands.plot import plot_mixture  # matplotlib only when plotting

    require("matplotlib", "plot", "pipeline plot")  # a missing extra before any store opens
    plan = load_plan(args.config, args.ledger)
    first, stop = args.steps
    plot_mixture(plan, first, stop, args.out, title=args.title or _plot_title(args, plan))
    print(f"wrote {args.out}")
    return 0


def _plot_title(args: argparse.Namespace, plan: Plan) -> str:
    """The config's name; for a ledger of several segments (switches, skips), the run's: the
    plot is then the whole run's, and the config given only one of its segments (the ledger's
    file or folder name, a checkpoint's step number, says nothing)."""
    starts = [f"{segment.start_step:,}" for segment in plan.ledger.segments[1:]]
    if not starts:
        return args.config.name
    shown = ", ".join(starts[:3]) + (", ..." if len(starts) > 3 else "")
    later = f"{counted(len(starts), 'later segment')} from step{'s' * (len(starts) > 1)} {shown}"
    return f"the run of {args.config.name} and {later} (its ledger)"
