"""The `pipeline` command line. Each subcommand lives in a `commands_*` module beside this one.

Errors of our own (`PipelineError`) print as one line on stderr with exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pipeline import commands_store
from pipeline.errors import PipelineError

COMMAND_MODULES = (commands_store,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline",
        description="Deterministic, padding-free, exactly resumable input pipeline for JAX.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
