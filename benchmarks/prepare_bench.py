"""Throughput of `prepare`: the local runner beside the Beam runner (DirectRunner), same input.

    .venv/bin/python benchmarks/prepare_bench.py [INPUT ...] [--repeat 3] [--num-shards 8]

Every configuration writes the same store (checked: the manifests are identical), so the table
compares only how fast they get there. Each time is the median of `--repeat` runs, end to end
(validation, tokenizing, sorting, writing, commit; for Beam also pipeline construction and,
with several workers, starting the worker processes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.store.prepare import PrepareOptions, prepare
from pipeline.store.prepare_beam import prepare_beam


def _run(runner: str, workers: int, inputs: list[str], out: Path, num_shards: int) -> float:
    options = PrepareOptions(
        inputs, out, num_shards=num_shards, workers=workers, overwrite=True, progress=False
    )
    start = time.perf_counter()
    if runner == "local":
        prepare(options)
    else:
        prepare_beam(options)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", default=["builtin:python-code"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--num-shards", type=int, default=8)
    args = parser.parse_args()
    configs = [("local", 1), ("local", 2), ("beam", 1), ("beam", 2)]
    rows, manifests = [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for runner, workers in configs:
            out = Path(tmp) / f"{runner}-{workers}"
            times = [
                _run(runner, workers, args.inputs, out, args.num_shards) for _ in range(args.repeat)
            ]
            manifest = json.loads((out / "manifest.json").read_text())
            manifests.add(json.dumps(manifest, sort_keys=True))
            rows.append((runner, workers, statistics.median(times), manifest))
            shutil.rmtree(out)
    if len(manifests) != 1:
        raise SystemExit("the runners wrote different stores")
    docs, tokens = manifest["num_documents"], manifest["num_tokens"]
    print(f"# prepare {' '.join(args.inputs)}: {docs:,} documents, {tokens:,} tokens (bytes)")
    print(
        f"# {datetime.date.today()}, {platform.python_implementation()} "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, median of {args.repeat}"
    )
    print()
    print("| runner | workers | seconds | docs/s | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for runner, workers, seconds, _ in rows:
        name = "local" if runner == "local" else "beam (DirectRunner)"
        print(
            f"| {name} | {workers} | {seconds:.2f} | {docs / seconds:,.0f} "
            f"| {tokens / seconds:,.0f} |"
        )


if __name__ == "__main__":
    main()
