"""Start-up time of the `pipeline` command: wall time of `python -m pipeline --help`.

    .venv/bin/python benchmarks/startup_bench.py [--root CHECKOUT ...] [--runs 20]

Each `--root` is a source checkout put first on PYTHONPATH (default: this one), so two versions
compare in one run; the runs of the roots are interleaved, so load on a shared machine hits them
alike. Prints the median and the fastest run per root, and the heavy packages each one loads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEAVY = ("jax", "orbax", "grain")
LOADED = (
    "import runpy, sys\n"
    "sys.argv = ['pipeline', '--help']\n"
    "try:\n    runpy.run_module('pipeline', run_name='__main__')\n"
    "except SystemExit:\n    pass\n"
    f"print(','.join(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))\n"
)


def _env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


def _time(root: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pipeline", "--help"],
        env=_env(root),
        cwd=root,  # `-m` puts the working directory first on sys.path
        stdout=subprocess.DEVNULL,
        check=True,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, action="append", help="source checkout (repeatable)")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    roots = [r.resolve() for r in args.root or [Path(__file__).resolve().parents[1]]]
    times: dict[Path, list[float]] = {root: [] for root in roots}
    for _ in range(args.runs):
        for root in roots:
            times[root].append(_time(root))
    print("checkout | median (s) | fastest (s) | heavy packages loaded")
    print("--- | --- | --- | ---")
    for root, values in times.items():
        loaded = subprocess.run(
            [sys.executable, "-c", LOADED], env=_env(root), cwd=root, capture_output=True, text=True
        ).stdout.splitlines()[-1]
        print(f"{root} | {statistics.median(values):.3f} | {min(values):.3f} | {loaded or 'none'}")


if __name__ == "__main__":
    main()
