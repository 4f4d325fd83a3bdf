"""`bench`: our host reading path against Grain's packed pipeline and the format/copy limits.

The measurements live in `benchmarks/bench.py` of the source checkout (they import Grain's
packing and spawn worker processes, which the library itself never needs); this module only
registers the command and loads that file.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

from pipeline.errors import PipelineError

BENCH_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"


def register(commands: argparse._SubParsersAction) -> None:
    b = commands.add_parser(
        "bench",
        help="throughput and resume time: ours vs Grain vs ArrayRecord and copy limits",
        description="Measure, interleaved and repeated (medians), on one store and batch shape: "
        "our Plan.batch, Grain's packed ArrayRecord pipeline, ArrayRecord reading exactly the "
        "needed records, a memory copy of the same bytes; resume time at steps 0, 10^3, 10^6; "
        "and ours in 1 and 2 processes. Prints a table with ratios.",
    )
    if not BENCH_FILE.is_file():  # an installed wheel: the command explains itself
        b.set_defaults(run=_missing)
        return
    bench = _load()
    bench.add_arguments(b)
    b.set_defaults(run=bench.report)


def _missing(args: argparse.Namespace) -> int:
    raise PipelineError(
        f"{BENCH_FILE}: missing; `pipeline bench` runs from a source checkout of pipeline"
    )


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pipeline_bench", BENCH_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
