"""The `pipeline` command line. Each group of subcommands lives in a module beside this one.

Errors of our own (`PipelineError`) print as one line on stderr with exit code 2; anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from pipeline.commands import bench, plan, store
from pipeline.commands.help_format import state_defaults
from pipeline.errors import PipelineError
from pipeline.maxtext import cli as maxtext
from pipeline.version import __version__

COMMAND_MODULES = (store, plan, bench, maxtext)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline",
        description="Deterministic, padding-free, exactly resumable input pipeline for JAX.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"pipeline {__version__}",
        help="print the release (the one stores, indexes and ledgers record) and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(commands)
    state_defaults(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # the pipeline's own progress lines; other libraries' only from warnings up (gcsfs, for
    # one, announces its experimental features at INFO on every import)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("pipeline").setLevel(logging.INFO)
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after a lone `--` is for another program (e.g. Beam)
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # a gs:// argument needs gcsfs (MissingExtraError)
        if passthrough and not getattr(args, "takes_passthrough", False):
            parser.error(f"{args.command} takes no options after --")
        args.passthrough = passthrough
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, in the handler
        return code
    except PipelineError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except BrokenPipeError:  # `pipeline inspect ... | head`: the reader has what it wanted
        # send what is still buffered to /dev/null, so that the interpreter's last flush at
        # exit does not fail on the closed pipe too (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE (128 + 13)
