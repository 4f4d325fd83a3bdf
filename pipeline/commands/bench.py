"""`bench`: DataFeed -> global arrays (what users run) against Grain's best, and the limits.

The measurements live in `benchmarks/bench.py` of the source checkout (they import Grain's
packing and spawn worker processes, which the library itself never needs). This module only
registers the command; the file is loaded, and parses its own options, when `bench` runs, so
no other `pipeline` command pays for it.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

from pipeline.commands.help_format import DefaultsFormatter
from pipeline.errors import PipelineError

BENCH_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
DESCRIPTION = (
    "Measure, in interleaved rounds (medians), each contender in its own process over "
    "simulated CPU devices: DataFeed -> global arrays, the MaxText iterator, Plan.batch, "
    "Grain's packed pipeline with several ReadOptions and with mp_prefetch, and ArrayRecord/copy "
    "limits; the restore path to the first global batch at steps 0 to 10^9; DataFeed in 1, 2 "
    "and 4 processes. Prints tables with ratios."
)


def register(commands: argparse._SubParsersAction) -> None:
    # '+' as the only prefix: every option (and --help) is passed through to the bench's parser
    b = commands.add_parser(
        "bench",
        help="tokens/s, CPU per token, next() time and restore time: ours vs Grain's best",
        description=DESCRIPTION,
        prefix_chars="+",
        add_help=False,
    )
    b.add_argument(
        "options", nargs="*", metavar="OPTIONS", help="the benchmark's options (see bench --help)"
    )
    b.set_defaults(run=run)


NEEDS_CHECKOUT = (
    "`pipeline bench` runs from a source checkout of pipeline: its benchmarks/ folder is not "
    "part of the installed package (clone the repository and run `make bench` there)"
)


def run(args: argparse.Namespace) -> int:
    if not BENCH_FILE.is_file():  # an installed wheel: the command explains itself
        if {"-h", "--help"} & set(args.options):
            print(f"usage: pipeline bench [options]\n\n{DESCRIPTION}\n\n{NEEDS_CHECKOUT}.")
            return 0
        raise PipelineError(f"{NEEDS_CHECKOUT}; not found: {BENCH_FILE}")
    bench = load()
    parser = argparse.ArgumentParser(
        prog="pipeline bench", description=DESCRIPTION, formatter_class=DefaultsFormatter
    )
    bench.add_arguments(parser)
    return int(bench.report(parser.parse_args(args.options)) or 0)


def load() -> ModuleType:
    """benchmarks/bench.py of the source checkout, loaded as a module."""
    spec = importlib.util.spec_from_file_location("pipeline_bench", BENCH_FILE)
    bench: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench
