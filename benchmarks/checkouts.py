"""A/B runs over checkouts of this project: each measurement in a fresh process that imports
`pipeline` from one checkout, the checkouts' order reversed every other round so that a shared
machine's drift falls on each alike (`restore_start.py`, `restore_draws.py`,
`store_open_bench.py`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parser(description: str) -> argparse.ArgumentParser:
    """The options these benchmarks share: `--rounds`, `--root` (a checkout to compare; this
    one by default), `--dir` (the mixtures' stores) and the child's hidden `--child`."""
    parsed = argparse.ArgumentParser(description=description)
    parsed.add_argument("--rounds", type=int, default=3)
    parsed.add_argument("--root", type=Path, action="append")
    parsed.add_argument("--dir", type=Path, default=Path("/tmp/mixture-bench"))
    parsed.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return parsed


def roots(given: list[Path] | None) -> list[Path]:
    return [root.resolve() for root in given or [HERE.parent]]


def alternated(checkouts: list[Path], rounds: int) -> Iterator[tuple[int, Path]]:
    """(index, checkout) of every checkout in every round, the order reversed every other."""
    for round_ in range(rounds):
        for root in checkouts[:: 1 if round_ % 2 == 0 else -1]:
            yield checkouts.index(root), root


def child(script: str, root: Path, arg: Path, **env: str) -> Any:
    """`script --child arg` in a fresh process importing `pipeline` from `root` (and `env`
    set): the JSON value of its last line of output."""
    out = subprocess.run(
        [sys.executable, script, "--child", str(arg)],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(root), **env),
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def measured(
    script: str, checkouts: list[Path], configs: dict[int, Path], rounds: int, **env: str
) -> Iterator[tuple[int, int, Any]]:
    """(checkout index, sources, the child's measurement) of every config in every checkout,
    the checkouts alternated (`alternated`), after printing the load average."""
    print(f"load average at the start {os.getloadavg()[0]:.1f}")
    for i, root in alternated(checkouts, rounds):
        for k, config_file in configs.items():
            yield i, k, child(script, root, config_file, **env)
    print(f"load average at the end {os.getloadavg()[0]:.1f}\n")


def mixture_configs(directory: Path, sources: list[int]) -> dict[int, Path]:
    """The config file of `mixture_bench.py`'s mixture of each number of sources (its stores
    built in `directory` if missing)."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    from mixture_bench import build, config_of  # beside this file: its stores

    configs = {}
    for k in sorted(sources):
        configs[k] = directory / f"start-k{k}.json"
        configs[k].write_text(json.dumps(config_of(build(directory, k, 1 << 24))))
    return configs


def mixtures_start(
    description: str, measure: Callable[[Path], Any]
) -> tuple[argparse.Namespace, list[Path], dict[int, Path]] | None:
    """A benchmark over `mixture_bench.py`'s mixtures (`--sources`): in its child, `measure`
    of the config file printed as JSON, and None; else the arguments, the checkouts and each
    mixture's config file."""
    parsed = parser(description)
    parsed.add_argument("--sources", type=int, nargs="+", default=[1, 256, 1024])
    args = parsed.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return None
    return args, roots(args.root), mixture_configs(args.dir, args.sources)
