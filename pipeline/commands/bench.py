"""`bench`: our host reading path against Grain's packed pipeline and the format/copy limits.

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

from pipeline.errors import PipelineError

BENCH_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
DESCRIPTION = (
    "Measure, interleaved and repeated (medians), on one store and batch shape: our "
    "Plan.batch, Grain's packed ArrayRecord pipeline, ArrayRecord reading exactly the needed "
    "records, a memory copy of the same bytes; resume time at steps 0, 10^3, 10^6; and ours in "
    "1 and 2 processes. Prints a table with ratios."
)


def register(commands: argparse._SubParsersAction) -> None:
    # '+' as the only prefix: every option (and --help) is passed through to the bench's parser
    b = commands.add_parser(
        "bench",
        help="throughput and resume time: ours vs Grain vs ArrayRecord and copy limits",
        description=DESCRIPTION,
        prefix_chars="+",
        add_help=False,
    )
    b.add_argument("options", nargs="*", help="the benchmark's options (see bench --help)")
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not BENCH_FILE.is_file():  # an installed wheel: the command explains itself
        raise PipelineError(
            f"{BENCH_FILE}: missing; `pipeline bench` runs from a source checkout of pipeline"
        )
    spec = importlib.util.spec_from_file_location("pipeline_bench", BENCH_FILE)
    bench: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    parser = argparse.ArgumentParser(prog="pipeline bench", description=DESCRIPTION)
    bench.add_arguments(parser)
    return int(bench.report(parser.parse_args(args.options)) or 0)
