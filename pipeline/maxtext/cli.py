"""`maxtext install`: patch a MaxText checkout (or installed package) to use the pipeline."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.maxtext import install as installer


def register(commands: argparse._SubParsersAction) -> None:
    group = commands.add_parser(
        "maxtext",
        help="MaxText integration (install)",
        description="MaxText integration: `pipeline maxtext install` edits a MaxText checkout "
        "or package so that its trainer reads batches from the pipeline (docs/maxtext.md).",
    )
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser(
        "install",
        help="add the pipeline's dispatch and config keys to MaxText's source",
        description="Edit MaxText so that `pipeline_data_config=data.yaml` makes the pipeline "
        "serve its batches: the dispatch in create_data_iterator, the keys in configs/types.py "
        "(where this MaxText declares keys) and configs/base.yml, and with --elastic a restore "
        "that accepts any process count in MaxText versions that lack one. Finds each place "
        "by name, in MaxText/, src/MaxText/, src/maxtext/ or an installed maxtext package; "
        "running it again changes nothing.",
    )
    p.add_argument(
        "maxtext_dir",
        type=Path,
        metavar="MAXTEXT_DIR",
        help="root of a MaxText checkout, or the directory of an installed maxtext package",
    )
    p.add_argument("--dry-run", action="store_true", help="print the diff, write nothing")
    p.add_argument("--elastic", action="store_true", help="also the restore with any process count")
    p.set_defaults(run=install)


def install(args: argparse.Namespace) -> int:
    plan = installer.plan_install(args.maxtext_dir, elastic=args.elastic)
    print(f"MaxText package: {plan.package}")
    for note in plan.notes:
        print(f"unchanged: {note}")
    if args.dry_run:
        for edit in plan.edits:
            print(edit.diff(plan.root), end="")
        return 0
    installer.apply(plan)
    for edit in plan.edits:
        print(f"patched {edit.path.relative_to(plan.package).as_posix()}: {edit.what}")
    if not plan.edits:
        print(f"{plan.package}: nothing to change, already installed")
    return 0
